"""Forward passes the trainer needs: token log-probs, entropy, values.

Notation: b batch size, s sequence length, h hidden size, v vocabulary size,
n number of scored tokens.

Alignment: every per-token tensor is indexed by the position of the token it
scores. ``logprobs[i] = log p(input_ids[i] | input_ids[:i])`` and
``values[i] = V(input_ids[:i])`` (the value of the state in which token ``i``
is chosen); position 0 is never scored. Masks use the same indexing.

Only the scored positions go through the LM head, in chunks whose logits are
never kept (:mod:`turnrl.training.head`): a full ``(b, s, v)`` logits tensor
for a 150k vocabulary would not fit. Rows may run packed, end to end without
padding (:mod:`turnrl.training.packing`). The body
runs as the model's own base model with every extra input of the batch
(``pixel_values``, ``image_grid_thw``, ...), so a VLM merges its image
features and computes its own positions (M-RoPE) exactly as in ``generate``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModel, PreTrainedModel

from turnrl.models.loading import model_structure, prepare_vision_tower
from turnrl.models.vision import position_inputs
from turnrl.training.head import DEFAULT_CHUNK, ScoringHead, chosen_logprobs
from turnrl.training.image_features import IMAGE_KEYS, ImageFeatures
from turnrl.training.packed_attention import BOUNDS, packed_forward, packs
from turnrl.training.packing import pack


def body_and_head(model: Any) -> tuple[nn.Module, nn.Module]:
    """The base model (everything but the LM head) and the LM head of a causal LM or VLM, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model, base.get_output_embeddings()


def last_hidden_states(
    body: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    model_inputs: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Shape (b, s, h): final-layer (normed) hidden states of ``body`` given the extra inputs."""
    extra = dict(model_inputs or {})
    if extra:  # a VLM: its image tokens get their own (3D) positions, as in generation
        extra.update(position_inputs(body, input_ids))
    output = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
    return output.last_hidden_state


def packed_hidden_states(
    body: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    model_inputs: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Shape (t, h): the hidden states of the real tokens of a right-padded batch, its rows run end to end
    without padding (:func:`~turnrl.training.packing.pack`), each attending only to itself.

    Raises:
        ValueError: the model's attention cannot keep packed rows apart (loaded without ``model.attention=sdpa``).
    """
    config: Any = body.config
    if not packs(config.get_text_config()):
        raise ValueError(f"packed rows (algorithm.micro_batch_tokens) need the trainer's attention (model.attention="
                         f"sdpa); this model attends with {config.get_text_config()._attn_implementation}")
    layout = pack(input_ids, attention_mask, config, model_inputs)
    lengths = attention_mask.sum(1).tolist()
    ends = list(itertools.accumulate(lengths))
    bounds = [(end - n, end) for n, end in zip(lengths, ends) if n]
    extra = dict(model_inputs or {})
    if extra:
        extra.update(position_inputs(body, layout.input_ids))
    with packed_forward(config.get_text_config()):
        output = body(input_ids=layout.input_ids, position_ids=layout.position_ids, attention_mask=None,
                      use_cache=False, **{BOUNDS: bounds}, **extra)
    return output.last_hidden_state[0]


def scored_positions(score_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and columns of scored tokens; position 0 is never scored.

    Args:
        score_mask: Shape (b, s), nonzero where a token is scored.

    Returns:
        Two index tensors of Shape (n,).
    """
    mask = score_mask.bool().clone()
    mask[:, 0] = False
    rows, cols = mask.nonzero(as_tuple=True)
    return rows, cols


def states_before(
    body: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    model_inputs: Mapping[str, torch.Tensor] | None = None,
    packed: bool = False,
    image_features: ImageFeatures | None = None,
) -> torch.Tensor:
    """Shape (n, h): the hidden state before each token at ``(rows, cols)`` (every col at least 1).

    ``packed`` runs the rows end to end without their padding (:func:`~turnrl.training.packing.pack`); the
    states are the same up to rounding. ``model_inputs`` may be on the host (a batch keeps its pixel values
    there): they are moved to the tokens' device for this pass only. ``image_features``: a frozen tower's
    features of the step's images (:mod:`~turnrl.training.image_features`), used where the inputs name their
    images (:data:`~turnrl.training.image_features.IMAGE_KEYS`); where every image of the pass is stored, no
    pixel leaves the host (where some are not, all of the pass's pixels are moved, and the tower encodes the
    others' alone).
    """
    inputs, serving = image_inputs(body, model_inputs, image_features)
    inputs = {key: value.to(input_ids.device) for key, value in inputs.items()}
    with serving:
        if not packed:
            hidden = last_hidden_states(body, input_ids, attention_mask, inputs)
            return hidden[rows, cols - 1]
        hidden = packed_hidden_states(body, input_ids, attention_mask, inputs)
    lengths = attention_mask.sum(1)
    starts = lengths.cumsum(0) - lengths  # where each row begins in the packed sequence
    return hidden[starts[rows] + cols - 1]


def image_inputs(
    body: nn.Module, model_inputs: Mapping[str, torch.Tensor] | None, image_features: ImageFeatures | None
) -> tuple[dict[str, torch.Tensor], AbstractContextManager]:
    """The inputs a pass gives ``body`` (never the image keys) and the context it runs in: the tower served
    from ``image_features`` where the inputs name their images, else as it is. Rows without an image (a VLM
    batch's text-only turns) pass no image input: transformers' Qwen-VL towers take no empty batch, and
    without images the 3D positions are the 1D ones."""
    inputs = dict(model_inputs or {})
    keys = inputs.pop(IMAGE_KEYS, None)
    grids = inputs.get("image_grid_thw")
    if grids is not None and not len(grids):
        return {key: value for key, value in inputs.items() if key not in ("pixel_values", "image_grid_thw")}, \
            nullcontext()
    if image_features is None or keys is None or "pixel_values" not in inputs:
        return inputs, nullcontext()
    if image_features.holds(keys):  # the model still takes its image path; the served tower reads no pixel
        inputs["pixel_values"] = inputs["pixel_values"][:0]
    return inputs, image_features.serving(body, keys)


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
    model_inputs: Mapping[str, torch.Tensor] | None = None,
    packed: bool = False,
    image_features: ImageFeatures | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of the scored tokens under ``softmax(logits / temperature)``.

    The head scores chunks of ``chunk_size`` tokens without keeping their logits
    (:func:`~turnrl.training.head.chosen_logprobs`): through the module when it is a
    :class:`~turnrl.training.head.ScoringHead` (the trainer installs one: it carries the vocabulary limit, and
    FSDP needs the module's forward), else from its weight over every row.

    Args:
        input_ids: Shape (b, s).
        attention_mask: Shape (b, s).
        score_mask: Shape (b, s); which tokens to score (usually the loss mask).
        temperature: the sampling temperature (0 is treated as 1).
        model_inputs: extra inputs of the model (a VLM's pixel values and grid sizes), passed to its forward.
        packed: run the rows end to end without padding (right-padded rows).
        image_features: the step's stored image features (a frozen tower), see :func:`states_before`.

    Returns:
        ``logprobs`` Shape (b, s) and ``entropy`` Shape (b, s) or None; zero where not scored.
    """
    body, head = body_and_head(model)
    rows, cols = scored_positions(score_mask)
    states = states_before(body, input_ids, attention_mask, rows, cols, model_inputs, packed, image_features)
    scored, entropies = _score(head, states, input_ids[rows, cols], temperature, chunk_size)
    # Even with nothing scored the zeros hang off the graph, so backward() on a loss of a batch without
    # trained tokens works.
    logprobs = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    logprobs = logprobs.index_put((rows, cols), scored)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        entropy = entropy.index_put((rows, cols), entropies)
    return logprobs, entropy


def _score(
    head: nn.Module, states: torch.Tensor, targets: torch.Tensor, temperature: float, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` (Shape (n,)) and entropies from ``states`` (Shape (n, h)), each Shape (n,)."""
    if isinstance(head, ScoringHead):  # through the module: FSDP gathers its weight and reduces its gradient
        return head(states, targets=targets, temperature=temperature, chunk=chunk_size)
    return chosen_logprobs(states, head.get_parameter("weight"), targets, temperature, chunk=chunk_size)


def token_and_candidate_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    candidate_rows: torch.Tensor,
    candidate_cols: torch.Tensor,
    candidates: torch.Tensor,
    model_inputs: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs`'s log-probs, and at some scored positions those of other tokens too (a soft
    target's candidates), scored from the same hidden state as the position's own token: one pass of the body.

    Args:
        input_ids, attention_mask, score_mask: as for :func:`token_logprobs`.
        candidate_rows, candidate_cols: Shape (m,), positions that ``score_mask`` scores.
        candidates: Shape (m, k), the token ids to score at each of them.

    Returns:
        ``logprobs`` Shape (b, s) (zero where not scored) and ``candidate_logprobs`` Shape (m, k).
    """
    body, head = body_and_head(model)
    rows, cols = scored_positions(score_mask)
    states = states_before(body, input_ids, attention_mask, rows, cols, model_inputs)
    # scored_positions lists positions row by row, column by column: their flat indices are sorted.
    width = input_ids.shape[1]
    scored_flat = rows * width + cols
    wanted = candidate_rows * width + candidate_cols
    index = torch.searchsorted(scored_flat, wanted).clamp(max=max(len(scored_flat) - 1, 0))
    if len(wanted) and (len(scored_flat) == 0 or not bool((scored_flat[index] == wanted).all())):
        raise ValueError("every candidate position must be a scored position (score_mask nonzero, not column 0)")
    k = candidates.shape[1]
    all_states = torch.cat([states, states[index].repeat_interleave(k, dim=0)])
    all_targets = torch.cat([input_ids[rows, cols], candidates.reshape(-1)])
    scored, _ = _score(head, all_states, all_targets, 1.0, DEFAULT_CHUNK)
    logprobs = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    logprobs = logprobs.index_put((rows, cols), scored[: len(rows)])
    return logprobs, scored[len(rows) :].reshape(len(wanted), k)


class ValueModel(nn.Module):
    """A critic: a transformer backbone of its own plus a linear value head.

    Built from the actor's weights (the backbone without the LM head), as is
    usual for PPO on language models.
    """

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        hidden_size = backbone.config.get_text_config().hidden_size  # a VLM keeps it in its text config
        self.value_head = nn.Linear(hidden_size, 1, device=next(backbone.parameters()).device)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, attention: str | None = None,
                        device: torch.device | str = "cpu") -> ValueModel:
        """The critic saved at ``path`` on ``device``; on ``meta``, its structure only (see
        :func:`~turnrl.models.loading.load_model`)."""
        path = Path(path)
        if torch.device(device).type == "meta":
            return cls(model_structure(AutoModel, path, dtype, attention))
        options: dict[str, Any] = {"attn_implementation": attention} if attention is not None else {}
        backbone = AutoModel.from_pretrained(path, dtype=dtype, **options)
        prepare_vision_tower(backbone)  # as the actor's, which a new critic is a copy of
        critic = cls(backbone)
        head = path / "value_head.pt"
        if head.exists():
            critic.value_head.load_state_dict(torch.load(head, map_location="cpu", weights_only=True))
        return critic.to(device)

    def save_pretrained(self, path: str | Path, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """The backbone as a transformers model and ``value_head.pt``; ``state_dict`` (the critic's own keys,
        gathered from a sharded critic) replaces the module's weights."""
        path = Path(path)
        if state_dict is None:
            self.backbone.save_pretrained(path)
            torch.save(self.value_head.state_dict(), path / "value_head.pt")
            return
        backbone = {k.removeprefix("backbone."): v for k, v in state_dict.items() if k.startswith("backbone.")}
        head = {k.removeprefix("value_head."): v for k, v in state_dict.items() if k.startswith("value_head.")}
        self.backbone.save_pretrained(path, state_dict=backbone)
        torch.save(head, path / "value_head.pt")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        model_inputs: Mapping[str, torch.Tensor] | None = None,
        packed: bool = False,
        image_features: ImageFeatures | None = None,
    ) -> torch.Tensor:
        """Shape (b, s): ``values[i] = V(input_ids[:i])`` on the real tokens; position 0 and padding are 0.

        ``packed`` runs the rows end to end without padding (right-padded rows); ``image_features`` as
        :func:`states_before`.
        """
        backbone: Any = self.backbone
        backbone = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
        rows, cols = scored_positions(attention_mask)
        states = states_before(backbone, input_ids, attention_mask, rows, cols, model_inputs, packed,
                               image_features)
        # The head is one row of weights: in the weights' dtype (float32 under autocast) it costs nothing, where
        # autocast's bf16 would round every value to 8 bits (steps of 1/16 at a return of 10), a floor under the
        # critic's error and noise in every advantage.
        with torch.autocast(states.device.type, enabled=False):
            values = self.value_head(states.to(self.value_head.weight.dtype)).squeeze(-1).float()
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        return out.index_put((rows, cols), values)

