"""The engine's weight buffers: fused projections equal the separate ones and follow the parameters."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.engine.paging import filled_cache
from tests.engine.test_llm_engine import build, random_prompts
from tests.new_memory import FloatOutputs
from turnrl.engine.forward import decoder_forward, final_logits, rotary_table
from turnrl.engine.weights import (
    DecoderWeights,
    UnsupportedModel,
    decoder_weights,
    lora_merged_weight,
    model_checksum,
)


def logits_of(weights: DecoderWeights, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of a prefill of ``prompts`` (right-padded) and of one decode step after it, Shape (2, b, vocab)."""
    b, width = len(prompts), max(len(p) for p in prompts)
    cache = filled_cache(weights.shape, b, 128)
    rope = rotary_table(weights, cache.capacity + 1, torch.device("cpu"))
    tokens = torch.zeros(b, width, dtype=torch.long)
    positions = torch.zeros(b, width, dtype=torch.long)
    write_pos = torch.full((b, width), cache.capacity, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = torch.tensor(prompt)
        positions[i] = torch.arange(width).clamp(max=len(prompt) - 1)
        write_pos[i, : len(prompt)] = torch.arange(len(prompt))
    hidden = decoder_forward(weights, cache, rope, tokens, positions, write_pos, torch.arange(b), cache.capacity)
    last = torch.tensor([len(p) - 1 for p in prompts])
    eps = weights.shape.rms_eps
    prefill = final_logits(hidden[torch.arange(b), last], weights.norm.value, weights.lm_head.value, eps)
    next_tokens = prefill.argmax(-1, keepdim=True)
    step = (last + 1).unsqueeze(1)
    hidden = decoder_forward(weights, cache, rope, next_tokens, step, step, None, cache.capacity)
    decode = final_logits(hidden[:, 0], weights.norm.value, weights.lm_head.value, eps)
    return torch.stack([prefill, decode])


def test_fused_projections_give_the_logits_of_separate_ones():
    model = build("qwen2")  # q/k/v biases: fused too
    prompts = random_prompts([9, 30, 4])
    fused, separate = decoder_weights(model, torch.float32), decoder_weights(model, torch.float32, fuse=False)
    assert len(fused.layers[0].qkv) == 1 and len(separate.layers[0].qkv) == 3
    assert fused.layers[0].qkv_bias is not None and len(fused.layers[0].qkv_bias) == 1
    torch.testing.assert_close(logits_of(fused, prompts), logits_of(separate, prompts), atol=1e-5, rtol=1e-5)


def test_separate_weights_in_the_compute_dtype_are_the_parameters_themselves():
    model: Any = build("llama")
    weights = decoder_weights(model, torch.float32, fuse=False)
    assert weights.layers[0].qkv[0].value is model.model.layers[0].self_attn.q_proj.weight
    assert weights.tensors == []  # nothing to recompute


def test_a_parameter_update_rebuilds_only_the_fused_buffers_that_read_it():
    model: Any = build("qwen2")
    weights = decoder_weights(model, torch.float32)
    assert weights.refresh() == 0  # nothing changed since the buffers were built
    attention = model.model.layers[1].self_attn
    with torch.no_grad():
        attention.k_proj.weight.mul_(-2)  # what an optimizer step does: an in-place update
        attention.v_proj.bias.add_(1)
    assert weights.refresh() == 2  # layer 1's q/k/v weight and bias buffers, nothing else
    expected = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
    torch.testing.assert_close(weights.layers[1].qkv[0].value, expected, atol=0, rtol=0)
    bias = weights.layers[1].qkv_bias
    assert bias is not None
    torch.testing.assert_close(bias[0].value[-attention.v_proj.bias.numel():], attention.v_proj.bias, atol=0, rtol=0)
    assert weights.refresh() == 0


def test_float32_parameters_are_cast_into_bfloat16_fused_buffers():
    model: Any = build("qwen2")
    weights = decoder_weights(model, torch.bfloat16)
    mlp = model.model.layers[0].mlp
    gate_up = weights.layers[0].gate_up[0].value
    assert gate_up.dtype == torch.bfloat16 and gate_up.shape == (2 * mlp.gate_proj.out_features, 64)
    torch.testing.assert_close(gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).bfloat16())


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_embedding_and_lm_head_are_cast_into_one_buffer(tied):
    """A tied input embedding and LM head are one parameter: one bf16 buffer (0.58 GiB at 3B), refreshed once."""
    model: Any = build("qwen2", tie_word_embeddings=tied)
    weights = decoder_weights(model, torch.bfloat16)
    assert (weights.embed is weights.lm_head) == tied
    assert (weights.embed.value.data_ptr() == weights.lm_head.value.data_ptr()) == tied
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    assert weights.refresh() == 1
    torch.testing.assert_close(weights.lm_head.value, model.lm_head.weight.bfloat16(), atol=0, rtol=0)


def test_a_fused_buffer_is_refreshed_without_a_float32_copy_of_its_group():
    """Each refresh casts the float32 parameters into the bf16 buffer block by block: no float32 concatenation of
    the group (0.17 GiB for a 3B model's gate and up projections, at the rollout's peak)."""
    model: Any = build("qwen2")
    weights = decoder_weights(model, torch.bfloat16)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.gate_proj.weight.add_(1)
    with FloatOutputs() as made:
        assert weights.refresh() == 1
    gate_up = weights.layers[0].gate_up[0].value
    assert tuple(gate_up.shape) not in made.shapes
    torch.testing.assert_close(gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).bfloat16(), atol=0,
                               rtol=0)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])  # q/k/v biases; per-head q/k norms
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("tied", [True, False])
def test_the_weights_a_token_goes_through_and_a_decode_step_reads_are_the_models_own(name, fuse, tied):
    """The layers' parameters, and the bytes of the layers, the final norm and the LM head in the compute dtype
    (a tied head once; the embedding lookup never), whether or not the projections are fused."""
    model: Any = build(name, tie_word_embeddings=tied)
    layers = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    head = model.lm_head.weight.numel()
    final_norm = model.model.norm.weight.numel()
    weights = decoder_weights(model, torch.bfloat16, fuse=fuse)  # float32 parameters cast into bf16 buffers
    assert weights.layer_parameters() == layers
    assert weights.decode_bytes() == 2 * (layers + final_norm + head)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_s_checksum_is_the_model_s_computed_as_the_engine_computes(fuse, dtype):
    """What a rollout's engine computes with and what the trainer's actor holds agree, LoRA adapters merged and
    cast as the engine does; an adapter update the buffers have not taken shows, and is gone once refreshed."""
    peft = pytest.importorskip("peft")
    lora: Any = peft.get_peft_model(build("qwen2"), peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"],
                                                                     init_lora_weights=False))
    weights = decoder_weights(lora, dtype, fuse=fuse)
    assert weights.checksum().agrees(model_checksum(lora, dtype))
    with torch.no_grad():
        lora.base_model.model.model.layers[-1].mlp.down_proj.lora_B["default"].weight.add_(0.5)
    stale = weights.checksum()
    assert not stale.agrees(model_checksum(lora, dtype))  # the buffers still hold the old adapters
    weights.refresh()
    assert weights.checksum().agrees(model_checksum(lora, dtype)) and weights.checksum().total != stale.total


def test_the_checksum_summed_in_chunks_is_the_plain_float64_sum(monkeypatch):
    """A few elements at a time (a tensor's tail a chunk of its own, tensors of other shapes and dtypes): the
    plain sum and norm of the tensors cast to the dtype, in float64."""
    from turnrl.engine import weights as weights_module

    monkeypatch.setattr(weights_module, "CHECKSUM_CHUNK", 7)
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 6, generator=generator), torch.randn(23, generator=generator).to(torch.bfloat16),
               torch.randn(3, 4, 2, generator=generator)]
    made = weights_module.checksum(tensors, torch.bfloat16)
    values = torch.cat([t.to(torch.bfloat16).double().reshape(-1) for t in tensors])
    assert made.dtype == torch.bfloat16
    assert made.total == pytest.approx(float(values.sum()), rel=1e-12, abs=1e-12)
    assert made.norm == pytest.approx(float(values.square().sum().sqrt()), rel=1e-12)


SHARDED_CHECKSUM = """
import sys, torch
from pathlib import Path
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from turnrl.engine.weights import model_checksum
from turnrl.training import ranks
from turnrl.training.head import install_scoring_head
from turnrl.training.parallel.fsdp2 import shard_model, structure_of

# As on a GPU host, where FSDP's default mesh would follow the machine's accelerator (torch asks either of these
# two): a CPU run's shards must stay on its CPU whatever the machine holds.
torch._C._get_accelerator = torch.accelerator.current_accelerator = lambda *args, **kwargs: torch.device("cuda")
ranks.init_process_group("cpu", timeout_s=120)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
install_scoring_head(model, None)
whole = {dtype: model_checksum(model, dtype) for dtype in (torch.float32, torch.bfloat16)}
sharded_model = structure_of(model)
shard_model(sharded_model, torch.float32, model.state_dict() if ranks.is_main() else {})
head = sharded_model.get_output_embeddings().weight
assert isinstance(head, DTensor) and head.to_local().shape[0] < head.shape[0], "the LM head is not sharded"
gathers = []
real_full_tensor = DTensor.full_tensor

def counted_full_tensor(self, *args, **kwargs):
    gathers.append(tuple(self.shape))
    return real_full_tensor(self, *args, **kwargs)

DTensor.full_tensor = counted_full_tensor
sharded = {dtype: model_checksum(sharded_model, dtype) for dtype in whole}
for dtype in whole:
    assert sharded[dtype].agrees(whole[dtype]), (dtype, sharded[dtype], whole[dtype])
    assert sharded[dtype].total != 0 and sharded[dtype].norm > 0
assert gathers == [], gathers
with torch.no_grad():  # a changed shard of one process changes the checksum every process computes
    if ranks.rank() == 1:
        head.to_local()[0, 0] += 1.0
assert not model_checksum(sharded_model, torch.float32).agrees(whole[torch.float32])
Path(sys.argv[2], f"agreed{ranks.rank()}").write_text(repr(sharded[torch.float32]))
torch.distributed.destroy_process_group()
ranks.end_process(0)  # as a run's processes leave: gloo's threads can abort an interpreter's teardown
"""


def test_the_checksum_of_a_sharded_model_is_the_whole_model_s_without_gathering_a_tensor(tiny_model_dir, tmp_path):
    """Two gloo processes, the tiny model sharded by the trainer's FSDP2 helper: each sums its shards and the sums
    are all-reduced, agreeing with the unsharded model's checksum, and no probed tensor is gathered whole
    (``DTensor.full_tensor``, counted where it is called); a change in one process's shard shows on every one.
    The processes see a GPU as the machine's accelerator, which a CPU run's sharding must not follow."""
    script = tmp_path / "sharded_checksum.py"
    script.write_text(SHARDED_CHECKSUM)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                             str(script), str(tiny_model_dir), str(tmp_path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(path.name for path in tmp_path.glob("agreed*")) == ["agreed0", "agreed1"]


@pytest.mark.parametrize(("adapters", "problem"), [
    (lambda peft: peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"], use_dora=True), "a LoRA variant"),
    (lambda peft: peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"], lora_bias=True),
     "a bias on its adapters"),
    (lambda peft: peft.LoHaConfig(r=2, target_modules=["q_proj", "down_proj"]), "peft.tuners.loha"),
], ids=["dora", "lora_bias", "loha"])
def test_adapters_whose_merged_weight_is_not_w_plus_scaled_b_a_are_refused_not_merged_wrongly(adapters, problem):
    """DoRA rescales the merged weight by its magnitude vector and ``lora_bias`` adds to the layer's bias: merged as
    plain LoRA, the engine would sample from weights the trained model does not hold. Other tuners (LoHa) have no
    LoRA matrices to merge."""
    peft = pytest.importorskip("peft")
    model: Any = peft.get_peft_model(build("qwen2"), adapters(peft))
    for run in (lambda: decoder_weights(model, torch.float32), lambda: model_checksum(model, torch.float32)):
        with pytest.raises(UnsupportedModel, match=problem) as refused:
            run()
        assert "merge_and_unload" in str(refused.value) and "model.backend=hf" in str(refused.value)


def test_lora_adapters_of_every_layer_kind_merge_into_the_weights_peft_s_own_merge_makes():
    """What the Ray rollout workers receive: each LoRA layer's weight merged out of place equals peft's
    ``merge_and_unload``, the input embeddings' adapters (kept apart from linear layers' lora_A) included; the
    base weights are left as they were."""
    peft = pytest.importorskip("peft")
    model: Any = peft.get_peft_model(build("qwen2"), peft.LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:  # an embedding's lora_embedding_A starts at zeros: its delta would be nothing
                parameter.normal_()
    base = model.get_base_model()
    layers = {name: module for name, module in base.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}
    assert {type(layer).__name__ for layer in layers.values()} == {"Embedding", "Linear"}
    before = {name: layer.base_layer.weight.clone() for name, layer in layers.items()}
    with torch.no_grad():
        merged = {name: lora_merged_weight(layer) for name, layer in layers.items()}
    plain = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    for name, layer in layers.items():
        torch.testing.assert_close(merged[name], plain[f"{name}.weight"], atol=1e-6, rtol=1e-6)
        assert not torch.equal(merged[name], before[name]) and torch.equal(layer.base_layer.weight, before[name])
