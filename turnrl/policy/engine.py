"""The engine backend: the policy's own weights, KV cache kept across turns, continuous batching.

A drop-in for :class:`~turnrl.policy.hf.HFPolicy` on text models of the
Llama family and Qwen2.5-VL (see :mod:`turnrl.engine.weights`): same requests, same
completions (sampled ids with their end-of-turn token, logprobs under the
tempered untruncated distribution, stop strings cut at the token that
completes them). The rollout loop needs no engine-specific call: a turn whose
prompt extends the previous turn's tokens is found in the cache by its prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn

from turnrl.config import EngineConfig, SamplingConfig
from turnrl.engine.llm_engine import Engine, Result, SamplingParams
from turnrl.engine.weights import ImageFeatures, WeightsChecksum
from turnrl.models.loading import context_window
from turnrl.models.vision import ImageEncoder
from turnrl.policy.hf import end_of_turn_ids
from turnrl.policy.interface import Completion, GenerationRequest, Policy, StreamingPolicy


class EnginePolicy(Policy):
    """Sampling from ``model`` through the engine.

    Args:
        model: a Llama-family causal LM (possibly peft-wrapped); generation follows its weights as they train.
        tokenizer: its tokenizer.
        config: the engine's cache and batching settings.
        dtype: compute dtype; None uses the weights' own.
        max_sequences: the most sequences ever generated at once (the rollout's batch): no more cache rows
            than that are allocated.
        processor: a VLM's processor (its image processor encodes the rollout's images); None for a text model.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, config: EngineConfig, dtype: torch.dtype | None = None,
                 max_sequences: int | None = None, processor: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.eos_ids = end_of_turn_ids(tokenizer, model)  # type: ignore[arg-type]
        if not self.eos_ids:
            raise ValueError("the tokenizer defines no eos token, so responses could never end")
        if max_sequences is not None:
            config = replace(config, max_rows=max(1, min(config.max_rows, max_sequences)))
        self.engine = Engine(model, config, dtype=dtype,
                             decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                             vocab_limit=len(tokenizer))
        # A row's length, or the model's context window where that is shorter (the rollout ends an episode
        # whose next turn would pass it).
        self.max_sequence_tokens = min(config.max_seq_len, context_window(model) or config.max_seq_len)
        # Each rollout's metrics split its generation time into device work and the rest (timing.py: its cost).
        self.engine.timer.enabled = True
        # Pixels in the engine's dtype, the run's: the tower's first step casts to it, here and in training.
        self.image_encoder = ImageEncoder(processor, self.engine.dtype) if processor is not None else None
        self._failed: list[tuple[int, Completion]] = []
        """Requests ended by a failed :meth:`prefill`, handed out by the next :meth:`poll`."""

    def streaming(self) -> StreamingPolicy:
        """The engine takes requests one at a time (:meth:`submit`) and returns completions as they finish
        (:meth:`poll`)."""
        return self

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        handles = [self.submit(request, sampling) for request in requests]
        done: dict[int, Completion] = {}
        while not all(handle in done for handle in handles):  # others' completions may come out too: not counted
            done.update(self.poll())
        return [done[handle] for handle in handles]

    def submit(self, request: GenerationRequest, sampling: SamplingConfig) -> int:
        """Queue one request; its completion comes out of a later :meth:`poll`."""
        if request.prompt_ids is None:
            raise ValueError("EnginePolicy needs prompt_ids: the rollout must build token contexts with this tokenizer")
        params = SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_new_tokens=sampling.max_new_tokens if request.max_new_tokens is None else min(
                sampling.max_new_tokens, request.max_new_tokens),
            stop_ids=tuple(self.eos_ids), stop_strings=tuple(sampling.stop),
        )
        return self.engine.submit(list(request.prompt_ids), params, request.model_inputs, request.image_digests)

    def poll(self) -> list[tuple[int, Completion]]:
        """One engine step: the requests that finished, by handle. A failed step ends every queued request
        with an error completion, and the engine starts clean."""
        if self._failed:
            failed, self._failed = self._failed, []
            return failed
        try:
            results = self.engine.step()
        except Exception as error:
            return self._abort("generation", error)
        return [(result.id, self._completion(result)) for result in results]

    def prefill(self) -> None:
        """Start prefilling the queued requests without decoding or waiting (:meth:`Engine.prefill_waiting`).
        A failure ends every queued request with an error completion, handed out by the next :meth:`poll`."""
        try:
            self.engine.prefill_waiting()
        except Exception as error:
            self._failed.extend(self._abort("prefill", error))

    def _abort(self, stage: str, error: Exception) -> list[tuple[int, Completion]]:
        """Every queued request ended by ``error`` in ``stage``, by handle; the engine starts clean."""
        results = self.engine.abort(f"{stage} failed: {type(error).__name__}: {error}")
        return [(result.id, self._completion(result)) for result in results]

    def release_memory(self) -> None:
        self.engine.release_memory()

    def keep_image_features(self) -> bool:
        return self.engine.keep_image_features()

    def take_image_features(self) -> dict[int, ImageFeatures]:
        return self.engine.take_image_features()

    def counters(self) -> dict[str, float]:
        """The engine's counters (:class:`~turnrl.engine.sequences.EngineStats`) and its device work
        (:meth:`~turnrl.engine.llm_engine.Engine.device_work`)."""
        counts = {name: float(value) for name, value in asdict(self.engine.stats).items()}
        return {**counts, **self.engine.device_work()}

    def weights_checksum(self) -> WeightsChecksum:
        """The engine's view of the weights (merged adapters, casts, fused projections), brought up to date first."""
        return self.engine.weights_checksum()

    def _completion(self, result: Result) -> Completion:
        if result.finish_reason == "error":
            return Completion(text="", finish_reason="error", error=result.error)
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return Completion(text=text, token_ids=result.token_ids, logprobs=result.logprobs,
                          finish_reason=result.finish_reason)
