"""The engine follows the weights it serves as they train: an optimizer step, LoRA adapters merged, float32 masters
cast, a separate copy given a state dict; models it cannot serve are refused with the reason; compiled decoding
gives the eager tokens (against transformers, as in test_llm_engine.py)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_llm_engine import (
    GREEDY,
    build,
    engine_for,
    hf_greedy,
    kernels,  # noqa: F401 (a fixture: each test that asks for it runs with both kernels)
    random_prompts,
)
from turnrl.config import EngineConfig
from turnrl.engine.llm_engine import Engine, SamplingParams
from turnrl.engine.weights import UnsupportedModel
from turnrl.training.optimizers import adamw


@pytest.mark.parametrize("optimizer_kind", ["sgd", "trainer's fused adamw"])
def test_an_optimizer_step_is_seen_by_the_next_generation_and_drops_the_stale_cache(optimizer_kind):
    model = build("qwen2")
    engine = engine_for(model)
    prompt = random_prompts([30])[0]
    engine.generate([prompt], [GREEDY])
    # The fused AdamW kernel (the trainer's on a GPU) writes parameters without counting their versions.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5) if optimizer_kind == "sgd" else \
        adamw(list(model.parameters()), lr=0.5, weight_decay=0.0, eps=1e-8, fused=True)
    loss = model(input_ids=torch.tensor([prompt])).logits.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    longer = prompt + random_prompts([5], seed=3)[0]
    result = engine.generate([longer], [GREEDY])[0]
    assert result.reused_tokens == 0  # the cached keys were computed with the old weights
    assert result.token_ids == hf_greedy(model, longer, 12)


def test_lora_adapters_are_merged_into_the_weights_the_engine_uses():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    prompts = random_prompts([6, 14])
    engine = engine_for(model)
    results = engine.generate(prompts, [GREEDY] * 2)
    base = build("qwen2")
    assert [r.token_ids for r in results] != [hf_greedy(base, p, 12) for p in prompts]
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 12) for p in prompts]
    with torch.no_grad():  # an adapter update reaches the merged weights
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(-1)
    assert [r.token_ids for r in engine.generate(prompts, [GREEDY] * 2)] == [hf_greedy(model, p, 12) for p in prompts]


def test_float32_weights_computed_in_bfloat16_follow_the_weights():
    model = build("qwen2")
    engine = Engine(model, EngineConfig(kv_cache_gb=1.0, max_rows=4, max_seq_len=256), dtype=torch.bfloat16)
    assert engine.cache.kv[0].dtype == torch.bfloat16
    prompts = random_prompts([9, 16])
    before = engine.generate(prompts, [GREEDY] * 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = [hf_greedy(model, p, 12) for p in prompts]
    agree = sum(a == b for r, e in zip(before, expected) for a, b in zip(r.token_ids, e))
    assert agree >= 20  # bf16 rounding differs from autocast's in places; most tokens agree
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)
    after = engine.generate(prompts, [GREEDY] * 2)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]


def test_unsupported_models_are_refused_with_the_reason():
    with pytest.raises(UnsupportedModel, match="sliding-window"):
        engine_for(build("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0))
    gpt2 = __import__("transformers").GPT2LMHeadModel(__import__("transformers").GPT2Config(n_layer=1, n_embd=32,
                                                                                             n_head=2))
    with pytest.raises(UnsupportedModel, match="gpt2"):
        engine_for(gpt2)


def test_a_separate_copy_takes_new_weights_from_a_state_dict():
    trained, worker = build("qwen2", seed=0), build("qwen2", seed=1)
    engine = engine_for(worker)
    prompts = random_prompts([12, 7])
    assert [r.token_ids for r in engine.generate(prompts, [GREEDY] * 2)] != [hf_greedy(trained, p, 12) for p in prompts]
    engine.load_state_dict(trained.state_dict())
    assert [r.token_ids for r in engine.generate(prompts, [GREEDY] * 2)] == [hf_greedy(trained, p, 12) for p in prompts]


@pytest.mark.slow
def test_compiled_decoding_gives_the_eager_tokens_and_compiles_once_for_every_bucket(kernels):
    """torch.compile's CPU backend (a GPU's is Triton): same greedy tokens (prefill and decode compiled); a new
    batch and key length reuse the compiled functions. With the Triton kernels, the compiled layer functions are
    the GPU's (the projection and the pending MLP output around the fused cache write)."""
    import torch._dynamo.utils

    model = build("qwen2")
    prompts = random_prompts([5, 23, 11, 40])
    eager = engine_for(model).generate(prompts, [GREEDY] * 4)
    engine = engine_for(model, compile="true")
    assert [r.token_ids for r in engine.generate(prompts, [GREEDY] * 4)] == [r.token_ids for r in eager]
    assert engine.kernels.compiled
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    longer = random_prompts([300, 7, 9], seed=2)  # another batch and key length
    results = engine.generate(longer, [SamplingParams(temperature=1.0, max_new_tokens=5)] * 3)
    assert all(r.finish_reason == "length" for r in results)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_a_compilation_that_fails_falls_back_to_eager_decoding(caplog):
    import torch._inductor.config

    model = build("qwen2")
    prompts = random_prompts([5, 23])
    eager = engine_for(model).generate(prompts, [GREEDY] * 2)
    engine = engine_for(model, compile="true")
    torch._dynamo.reset()  # compile again, with a C++ compiler that does not exist
    with torch._inductor.config.patch({"cpp.cxx": ("no-such-compiler",), "fx_graph_cache": False}):
        results = engine.generate(prompts, [GREEDY] * 2)
    assert [r.token_ids for r in results] == [r.token_ids for r in eager]
    assert not engine.kernels.compiled
    assert "torch.compile failed" in caplog.text
