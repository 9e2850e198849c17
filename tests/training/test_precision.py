"""How training computes: autocast only where the dtype asks, without a cache of weight casts; the weights' copies
cast once an optimizer step, which give autocast's gradients."""

import torch

from turnrl.training.precision import WeightsCastOnce, autocast, skip_cudnn_attention


def test_autocast_is_off_for_float32_and_keeps_no_weight_casts_otherwise():
    cpu = torch.device("cpu")
    with autocast(cpu, torch.float32):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(cpu, torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert not torch.is_autocast_cache_enabled()


def test_cudnn_attention_is_left_alone_off_a_gpu():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    skip_cudnn_attention(torch.device("cpu"))
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


class Tied(torch.nn.Module):
    """An embedding whose rows are also the LM head's, two trained linear layers and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 8)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.down(torch.nn.functional.silu(self.up(x)))
        return self.head(self.frozen(x)).float().logsumexp(-1).sum()


def gradients(model: torch.nn.Module, cast_once: bool) -> dict[str, torch.Tensor]:
    """Two micro-batches' gradients under bf16 autocast, the weights cast once (and again after a change of the
    float32 weights between them, as an optimizer step makes) or by autocast in each pass."""
    up = model.up.weight  # the float32 weight (inside, the module holds its copy)
    with autocast(torch.device("cpu"), torch.bfloat16), WeightsCastOnce(model, torch.bfloat16 if cast_once
                                                                        else None) as copies:
        for seed in (1, 2):
            model(torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(seed))).backward()
            with torch.no_grad():
                up.mul_(1.5)
            copies.refresh()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_weights_cast_once_give_autocasts_gradients_bit_for_bit():
    each_pass, once = Tied(), Tied()
    expected, got = gradients(each_pass, cast_once=False), gradients(once, cast_once=True)
    assert sorted(got) == sorted(expected) == ["down.bias", "down.weight", "embed.weight", "up.bias", "up.weight"]
    for name, gradient in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], gradient), name
    assert torch.equal(once.up.weight, each_pass.up.weight)


def test_only_trained_untied_linear_weights_are_copied_while_open():
    model = Tied()
    weights = {name: p for name, p in model.named_parameters()}
    with WeightsCastOnce(model, torch.bfloat16):
        assert model.up.weight.dtype == model.down.weight.dtype == torch.bfloat16
        assert model.up.weight is not weights["up.weight"]
        assert model.up.bias is weights["up.bias"] and model.frozen.weight.dtype == torch.float32
        assert model.head.weight is model.embed.weight is weights["embed.weight"]  # tied: left alone
    assert dict(model.named_parameters()) == weights
    for dtype in (None, torch.float32):
        with WeightsCastOnce(model, dtype):
            assert dict(model.named_parameters()) == weights
