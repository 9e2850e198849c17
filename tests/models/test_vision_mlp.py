"""The vision MLP at an aligned width: Qwen2.5-VL's MLP, forward and backward, on zero-padded weights."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

from tests.models.test_loading import original_rotary, scalar_kernels
from tests.models.test_vision_attention import images
from turnrl.models import loading as loading_module
from turnrl.models import vlm_config
from turnrl.models.loading import compile_layer_parts, load_model, part_forward, vision_tower
from turnrl.models.vision_mlp import AlignedQwen2_5_VLMLP, align_vision_mlps, aligned, aligned_mlp_forward


def mlp(width: int, seed: int = 0) -> Qwen2_5_VLMLP:
    torch.manual_seed(seed)
    return Qwen2_5_VLMLP(SimpleNamespace(hidden_size=48, intermediate_size=width, hidden_act="silu"), bias=True)


def bound_aligned(module: nn.Module) -> bool:
    """Whether ``module`` runs the aligned forward: an :class:`AlignedQwen2_5_VLMLP`, with no forward of its own."""
    return type(module) is AlignedQwen2_5_VLMLP and "forward" not in vars(module)


def test_widths_round_up_to_64():
    assert [aligned(w) for w in (1, 64, 100, 3420, 3456)] == [64, 64, 128, 3456, 3456]


def test_an_unaligned_mlp_gives_the_plain_mlps_outputs_and_gradients():
    plain, padded = mlp(100), mlp(100)
    assert align_vision_mlps(padded) == 1 and bound_aligned(padded)
    x = torch.randn(5, 7, 48, dtype=torch.float64, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    plain.double(), padded.double()
    out, got = plain(x), padded(y)
    torch.testing.assert_close(got, out)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(y.grad, x.grad)
    for (name, a), (_, b) in zip(plain.named_parameters(), padded.named_parameters()):
        assert a.shape == b.shape, name  # the parameters keep the model's shapes
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_an_aligned_mlp_and_other_modules_are_left_alone():
    module = nn.Sequential(mlp(128), nn.Linear(48, 100))
    assert align_vision_mlps(module) == 0 and not bound_aligned(module[0])


class Shifted(nn.Linear):
    """A projection that is more than a linear layer (as peft's LoRA layers are)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1.0


def test_a_wrapped_projection_runs_the_mlps_own_forward():
    module = mlp(100)
    align_vision_mlps(module)
    shifted = Shifted(48, 100)
    shifted.load_state_dict(module.gate_proj.state_dict())
    module.gate_proj = shifted
    x = torch.randn(3, 48)
    torch.testing.assert_close(module(x), Qwen2_5_VLMLP.forward(module, x))


@pytest.mark.usefixtures(original_rotary.__name__)  # a pickled model rebuilds its family's own rotary function
def test_a_loaded_qwen2_5_vl_tower_of_an_unaligned_width_gives_its_features_and_its_copies_keep_the_forward(
        tiny_tokenizer, tmp_path):
    config = vlm_config("vlm-tiny", tiny_tokenizer)
    config.vision_config.intermediate_size = 100
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp_path / "model")
    model = load_model(tmp_path / "model").eval()
    blocks = vision_tower(model).blocks
    assert all(bound_aligned(block.mlp) for block in blocks)
    pixels, grids = images(model.config.vision_config, [[1, 16, 24], [1, 8, 8]])
    with torch.no_grad():
        features = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
        for block in blocks:
            block.mlp.__class__ = Qwen2_5_VLMLP  # its own forward again
        plain = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
    for mine, reference in zip(features, plain):
        torch.testing.assert_close(mine, reference)
    loaded = load_model(tmp_path / "model")
    for copied in (copy.deepcopy(loaded), pickle.loads(pickle.dumps(loaded))):  # a copy, a pickle (torch.save)
        assert all(bound_aligned(block.mlp) for block in vision_tower(copied).blocks)
        assert copied.state_dict().keys() == loaded.state_dict().keys()


@pytest.mark.usefixtures(original_rotary.__name__, scalar_kernels.__name__)
def test_a_compiled_tower_of_an_unaligned_width_compiles_the_aligned_forward(tiny_tokenizer, tmp_path):
    """``compile_layer_parts`` compiles the forward an unaligned MLP runs (the padded products), not its class's:
    the features are the eager tower's, and a copy of the compiled model keeps the compiled function."""
    config = vlm_config("vlm-tiny", tiny_tokenizer)
    config.vision_config.intermediate_size = 100
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp_path / "model")
    eager = load_model(tmp_path / "model").eval()
    compiled = copy.deepcopy(eager)
    compile_layer_parts(compiled)
    mlps = [block.mlp for block in vision_tower(compiled).blocks]
    assert all(part_forward(m) is loading_module._compiled_forwards[aligned_mlp_forward] for m in mlps)
    copied = copy.deepcopy(compiled)
    assert compile_layer_parts(copied) and all(
        part_forward(block.mlp) is loading_module._compiled_forwards[aligned_mlp_forward]
        for block in vision_tower(copied).blocks)
    for sides in ([[1, 16, 24], [1, 8, 8]], [[1, 8, 12]]):  # image sizes that change from call to call
        pixels, grids = images(eager.config.vision_config, sides)
        with torch.no_grad():
            mine = compiled.model.get_image_features(pixels, grids, return_dict=True).pooler_output
            reference = eager.model.get_image_features(pixels, grids, return_dict=True).pooler_output
        for a, b in zip(mine, reference):
            torch.testing.assert_close(a, b)
