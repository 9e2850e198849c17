"""The transformers backend: any causal LM or VLM by path, batched sampling with logprobs.

Prompts arrive as token ids (the token-exact context) and are left-padded into
one batch; ``generate`` returns the sampled ids and, for each, its log-probability
under the sampling distribution ``softmax(logits / temperature)`` (before top-p /
top-k truncation, which is the distribution the PPO ratio is taken against).

A VLM takes the requests' extra model inputs (pixel values, grid sizes) with
them, concatenated in request order, and its own ``generate`` places the
image features and computes its positions (M-RoPE). The vision tokens are
suppressed in sampling: a response never contains an image placeholder.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, StoppingCriteria, StoppingCriteriaList

from turnrl.config import ModelConfig, SamplingConfig, is_greedy
from turnrl.engine.families import UnsupportedModel
from turnrl.engine.stops import stop_string_in_tail, tail_tokens
from turnrl.engine.weights import WeightsChecksum, model_checksum
from turnrl.models.devices import resolve_device, resolve_dtype
from turnrl.models.loading import context_window, load_model, load_processor, load_tokenizer
from turnrl.models.vision import ImageEncoder, position_inputs
from turnrl.policy.interface import Completion, GenerationRequest, Policy

PLAIN_LOGITS: dict[str, Any] = dict(
    repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0,
    min_new_tokens=0, guidance_scale=1.0, suppress_tokens=[], begin_suppress_tokens=[], renormalize_logits=False,
    remove_invalid_values=False,
)
"""Every option of transformers' ``generate`` that reshapes the logits before any choice, at the value that leaves
them alone. ``generate`` fills each option it is not given from the checkpoint's ``generation_config.json`` (Qwen2.5's
instruct and VL models ship ``repetition_penalty: 1.05``): sampled that way, the responses would differ from the
engine's and their logprobs, taken from the raw logits, would not be those of the distribution that sampled them."""

PLAIN_WARPERS: dict[str, Any] = dict(typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, min_p=0.0)
"""The same for the truncations that only sampling applies, besides ``top_k`` and ``top_p`` (set from the
sampling settings)."""

UNNEUTRAL_OPTIONS = ("bad_words_ids", "sequence_bias", "forced_bos_token_id", "forced_eos_token_id",
                     "exponential_decay_length_penalty", "watermarking_config", "top_h")
"""Options that reshape the distribution and have no value that turns them off (None is read as "take the
checkpoint's"): a model whose generation config sets one is refused rather than sampled from silently."""


def reshaping_options(model: PreTrainedModel) -> list[str]:
    """The :data:`UNNEUTRAL_OPTIONS` that ``model``'s generation config sets."""
    config = getattr(model, "generation_config", None)
    return [name for name in UNNEUTRAL_OPTIONS if getattr(config, name, None) is not None]


def end_of_turn_ids(tokenizer: Any, model: PreTrainedModel | None = None) -> list[int]:
    """Token ids that end a response: the tokenizer's eos plus the model's configured eos ids."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in configured if isinstance(configured, list) else [configured]:
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def outside_vocabulary(prompt_ids: Sequence[int] | None, vocab: int) -> str | None:
    """Why ``prompt_ids`` cannot go through a model of ``vocab`` embeddings (a token id outside them), or None."""
    if not prompt_ids or (min(prompt_ids) >= 0 and max(prompt_ids) < vocab):  # builtins: 9 us for 512 tokens
        return None
    outside = next(token for token in prompt_ids if not 0 <= token < vocab)
    return (f"the prompt holds token id {outside}, outside the model's {vocab} embeddings (a tokenizer that does not "
            "match the model, or tokens added to it without resizing the embeddings)")


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompts into ``input_ids`` and ``attention_mask``, both Shape (b, max_len)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def batch_model_inputs(requests: Sequence[GenerationRequest], device: torch.device) -> dict[str, torch.Tensor]:
    """The requests' extra model inputs, each concatenated along dim 0 in request order (Qwen-VL's layout)."""
    keys = sorted({key for r in requests for key in (r.model_inputs or {})})
    return {
        key: torch.cat([r.model_inputs[key] for r in requests if r.model_inputs and key in r.model_inputs]).to(device)
        for key in keys
    }


def sampled_logprobs(
    step_logits: Sequence[torch.Tensor], tokens: torch.Tensor, temperature: float, vocab_limit: int | None = None
) -> torch.Tensor:
    """Log-probabilities of the sampled tokens under ``softmax(logits / temperature)``.

    Args:
        step_logits: one raw logits tensor per generated position, each Shape (b, vocab).
        tokens: the generated ids, Shape (b, n).
        temperature: sampling temperature; greedy (0, or below ``GREEDY_BELOW_TEMPERATURE``) scores with
            temperature 1.
        vocab_limit: rows at or past it are no tokens (see :class:`VocabularyLimit`); None: every row.

    Returns:
        Shape (b, n), float32.
    """
    scale = 1.0 if is_greedy(temperature) else temperature
    logits = torch.stack(list(step_logits), dim=1)[..., :vocab_limit].float() / scale  # (b, n, vocab)
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class VocabularyLimit(LogitsProcessor):
    """Rows of the LM head at or past ``limit`` are no tokens (a checkpoint's padding rows, or the rows past a
    small tokenizer): they are never sampled, and the log-probs are taken over the rows below (as the trainer
    takes them)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores[:, self.limit :] = float("-inf")
        return scores


class StopStringsInResponse(StoppingCriteria):
    """Ends a row once the text of its generated tokens holds a stop string, as the engine does
    (:func:`~turnrl.engine.stops.stop_string_in_tail`). transformers' own ``stop_strings`` also match a stop string
    that begins in the prompt (``"\\n\\n"`` after a generation prompt ending in a newline): the row would end one
    token in, with nothing to cut it at.

    Args:
        prompt_width: the padded prompt's length; the tokens after it are the responses.
        stops: the stop strings.
        decode: token ids to text, special tokens removed.
    """

    def __init__(self, prompt_width: int, stops: Sequence[str], decode: Any) -> None:
        self.prompt_width = prompt_width
        self.stops = list(stops)
        self.decode = decode

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        start = max(self.prompt_width, input_ids.shape[1] - tail_tokens(self.stops))  # a new stop lies within
        generated = input_ids[:, start:].tolist()
        done = [bool(row) and stop_string_in_tail(row, self.stops, self.decode) for row in generated]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


class HFPolicy(Policy):
    """Sampling from a transformers causal LM.

    Args:
        model: a loaded model (its device is used) — or use :meth:`from_config`.
        tokenizer: its tokenizer; ``pad_token_id`` must be set.
        max_batch_size: prompts sampled together at most.
        processor: a VLM's processor (its image processor encodes images); None for a text model.
    """

    def __init__(
        self, model: PreTrainedModel, tokenizer: Any, max_batch_size: int = 64, processor: Any | None = None
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token: set tokenizer.pad_token (e.g. to its eos token)")
        if options := reshaping_options(model):
            raise ValueError(f"the model's generation config sets {', '.join(options)}, which would reshape what it "
                             "samples away from the logprobs it reports: remove them from generation_config.json")
        self.model: Any = model  # a transformers model; its generate() is what we call
        self.tokenizer = tokenizer
        self.max_batch_size: int = max_batch_size
        self.eos_ids = end_of_turn_ids(tokenizer, model)
        if not self.eos_ids:
            raise ValueError("the tokenizer defines no eos token, so responses could never end")
        self.image_encoder = ImageEncoder(processor) if processor is not None else None
        """Encodes images for the context (None: a text model, which refuses image observations)."""
        self.vocab_limit = len(tokenizer)
        """The head's rows that are tokens; the rows past it are never sampled (:class:`VocabularyLimit`)."""
        self.max_sequence_tokens = context_window(model)
        """The model's context window: the rollout ends an episode whose next turn would pass it."""

    @classmethod
    def from_config(cls, config: ModelConfig, path: str, max_batch_size: int = 64) -> HFPolicy:
        device = resolve_device(config.device)
        model = load_model(path, dtype=resolve_dtype(config.dtype, device), device=device).eval()
        processor = load_processor(path, config.min_pixels, config.max_pixels)
        return cls(model, load_tokenizer(path), max_batch_size=max_batch_size, processor=processor)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def weights_checksum(self) -> WeightsChecksum | None:
        """The model's own parameters are what ``generate`` computes with (adapters applied on the fly): their
        checksum in the parameters' dtype; None for a model of no engine family (whose weights it cannot probe)."""
        try:
            return model_checksum(self.model, next(self.model.parameters()).dtype)
        except UnsupportedModel:
            return None

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        # A token id outside the embeddings fails its request alone: in the batch it would fail them all (on a GPU,
        # the process).
        vocab = self.model.get_input_embeddings().num_embeddings
        refused = {index: Completion(text="", finish_reason="error", error=error)
                   for index, request in enumerate(requests)
                   if (error := outside_vocabulary(request.prompt_ids, vocab)) is not None}
        valid = [request for index, request in enumerate(requests) if index not in refused]
        completions: list[Completion] = []
        for start in range(0, len(valid), self.max_batch_size):
            completions.extend(self._generate_batch(valid[start : start + self.max_batch_size], sampling))
        generated = iter(completions)
        return [refused[index] if index in refused else next(generated) for index in range(len(requests))]

    @torch.no_grad()
    def _generate_batch(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        if any(r.prompt_ids is None for r in requests):
            raise ValueError("HFPolicy needs prompt_ids: the rollout must build token contexts with this tokenizer")
        prompts = [list(r.prompt_ids) for r in requests]  # type: ignore[arg-type]
        max_new = max(min(sampling.max_new_tokens, r.max_new_tokens or sampling.max_new_tokens) for r in requests)
        input_ids, attention_mask = left_pad(prompts, self.tokenizer.pad_token_id)
        was_training = self.model.training
        self.model.eval()
        greedy = is_greedy(sampling.temperature)
        options: dict[str, Any] = dict(
            **PLAIN_LOGITS,
            max_new_tokens=max_new,
            do_sample=not greedy,
            eos_token_id=self.eos_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if not greedy:
            options.update(PLAIN_WARPERS, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if sampling.stop:
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            options.update(stopping_criteria=StoppingCriteriaList(
                [StopStringsInResponse(input_ids.shape[1], sampling.stop, decode)]))
        if self.image_encoder is not None:
            options.update(suppress_tokens=self.image_encoder.special_token_ids)
        if self.vocab_limit < self.model.get_output_embeddings().out_features:
            options.update(logits_processor=LogitsProcessorList([VocabularyLimit(self.vocab_limit)]))
        model_inputs = batch_model_inputs(requests, self.device)
        if model_inputs:  # a VLM: its image tokens get their own (3D) positions
            model_inputs.update(position_inputs(self.model, input_ids.to(self.device)))
        output = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
            **model_inputs, **options,
        )
        if was_training:
            self.model.train()
        generated = output.sequences[:, input_ids.shape[1] :].cpu()
        logprobs = sampled_logprobs(output.logits, generated.to(output.logits[0].device), sampling.temperature,
                                    self.vocab_limit).cpu()
        return [
            self._completion(generated[row], logprobs[row], min(max_new, r.max_new_tokens or max_new), sampling)
            for row, r in enumerate(requests)
        ]

    def _completion(
        self, tokens: torch.Tensor, logprobs: torch.Tensor, limit: int, sampling: SamplingConfig
    ) -> Completion:
        ids = tokens.tolist()[:limit]
        end = next((i + 1 for i, t in enumerate(ids) if t in self.eos_ids), None)
        if sampling.stop:
            # Look for stop strings before the first end-of-turn id: a row that
            # hit a stop string is padded by generate(), and the pad id is often
            # an eos id (e.g. <|endoftext|>) that the model never sampled.
            stop_end = self._stop_string_end(ids[:end], sampling.stop)
            if stop_end is not None:
                end = stop_end
        finish_reason = "stop" if end is not None else "length"
        if end is not None:
            ids = ids[:end]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(text=text, token_ids=ids, logprobs=logprobs[: len(ids)].tolist(), finish_reason=finish_reason)

    def _stop_string_end(self, ids: list[int], stops: list[str]) -> int | None:
        """Length of the shortest prefix of ``ids`` whose text contains a stop string.

        generate() keeps sampling pad ids after a row hits a stop string, so the
        row is cut here at the token that completed the stop string.
        """
        for end in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:end], skip_special_tokens=True)
            if any(stop in text for stop in stops):
                return end
        return None
