"""The memory estimate's activations against what autograd really keeps: the tensors a training pass of the built-in
``tiny`` model and ``vlm-tiny`` saves for its backward, counted through saved-tensor hooks on the CPU under the
trainer's autocast."""

from __future__ import annotations

import pytest
import torch

from turnrl.models.loading import enable_checkpointing, freeze_vision_tower, load_model
from turnrl.training.head import DEFAULT_CHUNK, install_scoring_head
from turnrl.training.kept_bytes import (
    MIXED,
    PassBytes,
    activation_bytes,
    kept_layer_cast_bytes,
    kept_token_bytes,
    tower_patch_bytes,
    weight_cast_bytes,
)
from turnrl.training.memory import count_model
from turnrl.training.model_passes import token_logprobs
from turnrl.training.precision import autocast

TOLERANCE = 0.05
"""The estimate's activations are within 5% of the bytes measured (the rest: norms' variances, the attention's
log-sum-exps, rotary tables and indices, a few bytes a token)."""

GRID = 8
"""Patches a side of each test image: 64 patches, 16 image tokens."""


def _model(path, *, checkpointing: bool, bf16_weights: bool = False, train_vision: bool = True,
           checkpointed_layers: int | None = None):
    model = load_model(path, attention="sdpa")
    install_scoring_head(model, None)
    if not train_vision:
        freeze_vision_tower(model)
    if checkpointing:
        enable_checkpointing(model, checkpointed_layers)
    if bf16_weights:  # the weights FSDP gathers for a pass in a bf16 run
        model.to(torch.bfloat16)
    return model.train()


def _saved(model, tokens: int, images: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[int, torch.Tensor]:
    """The tensors (by storage) that a scoring pass of ``tokens`` tokens, ``images`` of them images, saves for its
    backward, the model's own parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in params:
            saved[tensor.untyped_storage().data_ptr()] = tensor
        return tensor

    ids = torch.randint(3, 200, (1, tokens), generator=torch.Generator().manual_seed(0))
    inputs = None
    if images:
        per = GRID * GRID // 4
        for k in range(images):
            ids[0, 10 + k * (per + 4): 10 + k * (per + 4) + per] = model.config.image_token_id
        inputs = {"pixel_values": torch.randn(images * GRID * GRID, 3 * 2 * 14 * 14).to(torch.bfloat16),
                  "image_grid_thw": torch.tensor([[1, GRID, GRID]] * images)}
    mask = torch.ones_like(ids)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast(torch.device("cpu"), dtype):
        token_logprobs(model, ids, mask, mask, with_entropy=True, model_inputs=inputs)
    return saved


def _bytes(saved: dict[int, torch.Tensor]) -> int:
    return sum(tensor.untyped_storage().nbytes() for tensor in saved.values())


def _per_token(model, dtype: torch.dtype = torch.bfloat16, images: int = 0) -> float:
    """Saved bytes a token, from two passes past the scoring head's first chunk (its buffers then stay)."""
    low, high = DEFAULT_CHUNK + 64, DEFAULT_CHUNK + 576
    return (_bytes(_saved(model, high, images, dtype)) - _bytes(_saved(model, low, images, dtype))) / (high - low)


@pytest.mark.parametrize("dtypes", [MIXED, PassBytes(stream=2, compute=2), PassBytes(stream=4, compute=4)],
                         ids=["one-process", "fsdp-bf16", "float32"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_what_autograd_keeps_of_a_token_is_what_the_estimate_counts(tiny_model_dir, dtypes, checkpointing):
    """Under autocast over float32 weights the residual stream, the norms' copies and the head's states stay
    float32, and each projection keeps its own bf16 cast of its input; with checkpointing each layer keeps its
    float32 input."""
    counts = count_model(tiny_model_dir)
    model = _model(tiny_model_dir, checkpointing=checkpointing, bf16_weights=dtypes == PassBytes(2, 2))
    measured = _per_token(model, torch.float32 if dtypes.compute == 4 else torch.bfloat16)
    assert kept_token_bytes(counts, checkpointing, dtypes=dtypes) == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.parametrize("dtypes", [MIXED, PassBytes(stream=2, compute=2)], ids=["one-process", "fsdp-bf16"])
def test_a_layer_left_out_of_checkpointing_keeps_what_the_estimate_counts(tiny_model_dir, dtypes):
    """``model.checkpointed_layers=1`` of the tiny model's 2 layers: the first keeps its input, the second its whole
    set, halfway between checkpointing every layer and none; in one process autograd also keeps autocast's bf16
    copies of the second layer's float32 weights."""
    counts = count_model(tiny_model_dir)
    assert counts.layers == 2
    bf16 = dtypes == PassBytes(2, 2)
    model = _model(tiny_model_dir, checkpointing=True, bf16_weights=bf16, checkpointed_layers=1)
    measured = _per_token(model)
    assert kept_token_bytes(counts, True, dtypes=dtypes, kept_layers=1) == pytest.approx(measured, rel=TOLERANCE)
    assert kept_token_bytes(counts, True, dtypes=dtypes) < measured < kept_token_bytes(counts, False, dtypes=dtypes)
    if not bf16:
        shapes = {tuple(p.shape) for p in model.parameters() if p.dim() > 1}
        saved = _saved(model, 300)
        casts = sum(t.untyped_storage().nbytes() for t in saved.values()
                    if t.dtype == torch.bfloat16 and (tuple(t.shape) in shapes or tuple(t.shape)[::-1] in shapes))
        # The layer's matrices; its norms' vectors are counted too (a few bytes a parameter of the layer).
        assert casts <= kept_layer_cast_bytes(counts, 1) <= casts * 1.05


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_activations_of_a_one_process_update_grow_by_what_autograd_keeps_of_a_token(tiny_model_dir,
                                                                                       checkpointing):
    """What a token adds to the estimate's activations is what it adds to the saved tensors, and with
    checkpointing one layer's set recomputed in the backward (measured as a layer's share without it)."""
    counts = count_model(tiny_model_dir)
    measured = _per_token(_model(tiny_model_dir, checkpointing=checkpointing))
    if checkpointing:
        without = _per_token(_model(tiny_model_dir, checkpointing=False))
        measured += (without - measured) / counts.layers  # about one layer's set
    low, high = DEFAULT_CHUNK, 2 * DEFAULT_CHUNK  # the head's chunk is the same
    estimated = (activation_bytes(counts, high, checkpointing) - activation_bytes(counts, low, checkpointing)) / low
    assert estimated == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_trained_vision_tower_keeps_what_the_estimate_counts_for_each_patch(tiny_vlm_dir, checkpointing):
    counts = count_model(tiny_vlm_dir, train_vision=True)
    model = _model(tiny_vlm_dir, checkpointing=checkpointing)
    tokens = 512
    per_patch = (_bytes(_saved(model, tokens, 12)) - _bytes(_saved(model, tokens, 4))) / (8 * GRID * GRID)
    if checkpointing:  # one block's set, recomputed in the backward
        whole = _model(tiny_vlm_dir, checkpointing=False)
        without = (_bytes(_saved(whole, tokens, 12)) - _bytes(_saved(whole, tokens, 4))) / (8 * GRID * GRID)
        per_patch += (without - per_patch) / counts.tower_blocks
    assert tower_patch_bytes(counts, MIXED, checkpointing) == pytest.approx(per_patch, rel=TOLERANCE)
    # The estimate counts the tower for as many patches as a micro-batch of image tokens has, where a frozen
    # tower keeps nothing.
    frozen = count_model(tiny_vlm_dir)
    added = activation_bytes(counts, tokens, checkpointing) - activation_bytes(frozen, tokens, checkpointing)
    assert added == pytest.approx(tokens * counts.patches_per_token * per_patch, rel=TOLERANCE)


def test_a_frozen_tower_keeps_no_cast_of_its_weights(tiny_vlm_dir):
    """Autograd keeps autocast's bf16 copy of each decoder matrix (the inputs' gradients need them), and none of a
    frozen tower's: the estimate's weight casts are the decoder's (with its vectors and its embedding, whose
    casts the head makes once a pass, counted too)."""
    counts = count_model(tiny_vlm_dir)
    model = _model(tiny_vlm_dir, checkpointing=False, train_vision=False)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() > 1}
    saved = _saved(model, 300, images=5)  # 300 tokens and 320 patches: no weight's size
    casts = sum(t.untyped_storage().nbytes() for t in saved.values()
                if t.dtype == torch.bfloat16 and (tuple(t.shape) in shapes or tuple(t.shape)[::-1] in shapes))
    decoder = [p for name, p in model.named_parameters() if "visual" not in name]
    uncast = sum(p.numel() for p in decoder if p.dim() == 1) + model.get_input_embeddings().weight.numel()
    assert casts <= weight_cast_bytes(counts) <= casts + 2 * uncast
