"""What a training pass keeps for its backward, in bytes a token (a patch for a trained vision tower).

The activations part of :func:`turnrl.training.memory.estimate_memory`, by layer and by dtype, as autograd's saved
tensors count them (tests/training/test_kept_bytes.py checks each figure against a tiny model's pass on the
CPU): the decoder's residual stream and the norms' inputs in float32 under autocast in one process (bf16 where
FSDP gathers bf16 weights), each projection's own cast of its input, the scoring head's chunk, a trained tower's
blocks, and the bf16 weight copies autocast keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnrl.training.head import DEFAULT_CHUNK
from turnrl.training.train_config import TrainConfig


@dataclass(frozen=True)
class ModelCounts:
    """A model's parameter counts and the sizes its activations scale with."""

    total: int
    """Every parameter (a tied embedding and head once)."""
    trained: int
    """Parameters the optimizer steps: all but a frozen vision tower, or the LoRA adapters."""
    stacked: int
    """Weights of the q/k/v and gate/up projections of the decoder."""
    head: int
    """Parameters of the LM head (0 when tied to the embedding; a critic has a value head instead)."""
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    key_width: int = 0
    """The decoder's key projections' outputs summed over its layers (key heads x head size x layers): a
    token's cached keys, and as many values; 0 for a model without ``k_proj`` layers."""
    frozen_tower: int = 0
    """Parameters of the vision tower when it is not trained: under FSDP each process holds it whole, in bf16."""
    tower_blocks: int = 0
    """The vision tower's blocks (0 for a text model); its activations count only when it trains."""
    tower_hidden: int = 0
    tower_intermediate: int = 0
    patch_values: int = 0
    """Pixel values of one patch (channels x frames x patch side squared: 1,176 for Qwen2.5-VL)."""
    patches_per_token: int = 0
    """Patches merged into one image token of the decoder (the 2x2 merge: 4)."""
    layer_params: int = 0
    """Parameters of one decoder layer: autocast's bf16 copies of a layer that keeps its activations."""

    @property
    def trains_tower(self) -> bool:
        """Whether the model has a vision tower and trains it (its activations are kept for the backward)."""
        return self.tower_blocks > 0 and self.frozen_tower == 0


@dataclass(frozen=True)
class PassBytes:
    """Bytes of a value in a training pass: in the decoder's residual stream, and in the matrix products."""

    stream: int
    """The residual stream between the decoder's layers: float32 where the weights are (one process under
    autocast: the embedding's output and every residual sum stay float32), bf16 where FSDP gathers bf16 weights."""
    compute: int
    """What autocast's products make and autograd keeps: 2 (bf16 or fp16), 4 under ``model.dtype=float32``."""


MIXED = PassBytes(stream=4, compute=2)
"""One process under mixed precision: bf16 products over float32 weights (the SFT stage, a one-process run)."""


def pass_bytes(config: TrainConfig, sharded: bool) -> PassBytes:
    """The :class:`PassBytes` of a run's training passes: FSDP gathers the weights in the compute dtype, so the
    stream is in it; one process keeps float32 weights, so the stream stays float32."""
    compute = 4 if config.model.dtype == "float32" else 2
    return PassBytes(stream=compute if sharded else 4, compute=compute)


def norm_bytes(counts: ModelCounts, dtypes: PassBytes) -> int:
    """A token's bytes that one layer's two RMSNorms keep in eager autograd: each its float32 input (a copy
    where the stream is bf16) and its normalized output in the stream's dtype. A compiled layer
    (``model.compile``) recomputes them in its backward: the 3B pass at 8k tokens without checkpointing peaked at
    52.5 GiB eager and 42.6 GiB compiled (docs/benchmarks.md), of which these are 9.0 GiB."""
    return 2 * (4 + dtypes.stream) * counts.hidden


def layer_token_bytes(counts: ModelCounts, dtypes: PassBytes) -> int:
    """A token's bytes that autograd keeps of one decoder layer (Qwen2's, eager), as the saved tensors of a pass
    count them (tests/training/test_kept_bytes.py):

        norms        2 (4 + stream) h      (:func:`norm_bytes`)
        inputs       5 compute h           q, k, v, gate and up each keep autocast's own cast of a float32
                                           norm output (2 compute h where the stream is in the compute dtype:
                                           the norm's output is then shared)
        attention    2 compute h + 2 compute kv   o_proj's input (the attention output), the rotated queries;
                                           the keys and values (kv = key heads x head size)
        MLP          4 compute i           gate and up outputs, the activation's output, their product

    30 h + 4 kv + 8 i bytes in one process under mixed precision, 20 h + 4 kv + 8 i under FSDP in bf16.
    """
    h, c = counts.hidden, dtypes.compute
    inputs = (2 if dtypes.stream == c else 5) * c * h
    attention = 2 * c * h + 2 * c * counts.key_width // max(1, counts.layers)
    return norm_bytes(counts, dtypes) + inputs + attention + 4 * c * counts.intermediate


def outside_layers_token_bytes(counts: ModelCounts, dtypes: PassBytes) -> int:
    """A token's bytes kept outside the layers: the final norm's (:func:`norm_bytes`' one norm), the hidden
    state the scoring head keeps for its backward, in the stream's dtype, and the int64 index of its position and
    of its target (every token counted scored)."""
    return (4 + 2 * dtypes.stream) * counts.hidden + 16


def tower_patch_bytes(counts: ModelCounts, dtypes: PassBytes, checkpointing: bool) -> int:
    """A patch's bytes that autograd keeps of a trained vision tower (Qwen2.5-VL's, its stream in the compute
    dtype): its pixel values, the merger's (its norm's float32 input and normalized output, three products of
    4 d per image token: 12 d in bf16), and each block's ``c (15 d + 4 i)`` (its two norms 12 d, four casts of
    projection inputs 8 d, q/k/v and the rotated q and k 10 d, the MLP's four products 8 i in bf16), or with
    checkpointing each block's input (``c d``) and one block's set, recomputed."""
    c, d = dtypes.compute, counts.tower_hidden
    block = c * (15 * d + 4 * counts.tower_intermediate)
    blocks = counts.tower_blocks * c * d + block if checkpointing else counts.tower_blocks * block
    return c * counts.patch_values + (4 + 4 * c) * d + blocks


def kept_layer_token_bytes(counts: ModelCounts, compiled: bool, dtypes: PassBytes) -> int:
    """A token's bytes that autograd keeps of one layer that is not recomputed: :func:`layer_token_bytes`, less its
    norms' copies when ``compiled`` (the compiled norms recompute them in their backward)."""
    return layer_token_bytes(counts, dtypes) - (norm_bytes(counts, dtypes) if compiled else 0)


def kept_token_bytes(counts: ModelCounts, checkpointing: bool, compiled: bool = False,
                     dtypes: PassBytes = MIXED, kept_layers: int = 0) -> int:
    """A token's bytes that autograd keeps from the forward pass to the backward, the vision tower aside: every
    layer's set (:func:`layer_token_bytes`, without its norms' copies when ``compiled``), or with checkpointing
    each recomputed layer's input in the stream's dtype and the set of the ``kept_layers`` that keep theirs; and
    what is kept outside the layers."""
    kept_layer = kept_layer_token_bytes(counts, compiled, dtypes)
    if not checkpointing:
        kept_layers = counts.layers
    recomputed = counts.layers - kept_layers
    return (recomputed * dtypes.stream * counts.hidden + kept_layers * kept_layer
            + outside_layers_token_bytes(counts, dtypes))


def activation_bytes(counts: ModelCounts, tokens: int, checkpointing: bool, compiled: bool = False,
                     trains_head: bool = True, dtypes: PassBytes = MIXED, kept_layers: int = 0) -> float:
    """One micro-batch of ``tokens`` through the model, forward and backward.

    What autograd keeps (:func:`kept_token_bytes`; with checkpointing, ``kept_layers`` of the decoder's layers
    keep their activations: ``model.checkpointed_layers``), plus with checkpointing one layer's set recomputed
    at a time (the 7B pass with checkpointing peaked at 38.1 GiB compiled or not), less what the kept layers free
    first: the backward reaches the recomputed layers, the first ones, after the kept ones have let go of their
    sets; a trained vision tower's for the
    micro-batch's images (:func:`tower_patch_bytes`), counted as if every token were an image token (an upper
    bound: a micro-batch holds no more image tokens than tokens). The scoring head holds two float32 chunks of
    logits and a bf16 copy of its weight, and in its backward pass (``trains_head``: not under LoRA) the float32
    sum of its weight's gradient beside one chunk's bf16 product (2.3 + 1.2 GiB for an 8B VLM's 152k x 4096 head).
    """
    kept = tokens * kept_token_bytes(counts, checkpointing, compiled, dtypes, kept_layers)
    recomputed = 0
    if checkpointing and kept_layers < counts.layers:
        recomputed = tokens * max(0, layer_token_bytes(counts, dtypes)
                                  - kept_layers * kept_layer_token_bytes(counts, compiled, dtypes))
    tower = tokens * counts.patches_per_token * tower_patch_bytes(counts, dtypes, checkpointing) \
        if counts.trains_tower else 0
    head = head_chunk_bytes(counts, tokens) + (6 * counts.vocab * counts.hidden if trains_head else 0)
    return kept + recomputed + tower + head


def layer_working_bytes(counts: ModelCounts, tokens: int, dtypes: PassBytes = MIXED) -> int:
    """One layer's set for ``tokens`` (:func:`layer_token_bytes`): what a pass without autograd holds of a layer
    at most."""
    return tokens * layer_token_bytes(counts, dtypes)


def head_chunk_bytes(counts: ModelCounts, tokens: int) -> int:
    """The scoring head's two float32 chunks of logits for a pass of ``tokens``, and its weight's bf16 copy (held
    over a pass's chunks: float32 weights are cast once a pass)."""
    return 2 * 4 * min(tokens, DEFAULT_CHUNK) * counts.vocab + 2 * counts.vocab * counts.hidden


def scoring_activation_bytes(counts: ModelCounts, tokens: int) -> float:
    """One pass of ``tokens`` that only scores (no backward: ``algorithm.score_micro_batch_tokens``): a layer's
    working set at a time (:func:`activation_bytes`' per-layer count, an upper bound without autograd's copies) and
    the scoring head's (:func:`head_chunk_bytes`)."""
    return layer_working_bytes(counts, tokens) + head_chunk_bytes(counts, tokens)


def kept_layer_cast_bytes(counts: ModelCounts, kept_layers: int) -> float:
    """Autocast's bf16 copies of the float32 weights of the ``kept_layers`` decoder layers that keep their
    activations under checkpointing (``model.checkpointed_layers``), in one process: autograd keeps them for the
    backward as it keeps every weight's without checkpointing (:func:`weight_cast_bytes`). Actor and critic have
    as many layers of one size."""
    return 2.0 * kept_layers * counts.layer_params


def weight_cast_bytes(counts: ModelCounts, critic_total: int = 0) -> float:
    """Autocast's bf16 copies of the float32 weights that autograd keeps for a backward pass in one process
    without checkpointing: of the larger of the actor (``counts``) and the critic of ``critic_total`` parameters,
    as they update one after the other. A frozen vision tower keeps none: no gradient flows into or through it, so
    each copy is freed after its product (a frozen decoder's are kept: its inputs' gradients need them)."""
    return 2.0 * max(counts.total, critic_total) - 2.0 * counts.frozen_tower
