"""The engine's GPU paths (CUDA graphs for decode and small prefills, the Triton kernels compiled for the GPU),
against transformers and against the same engine without graphs. Skipped without a GPU (CI has none); run them
on one with ``pytest tests/engine/test_llm_engine_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_llm_engine import VOCAB, build, random_prompts
from turnrl.config import EngineConfig
from turnrl.engine.llm_engine import Engine, SamplingParams
from turnrl.engine.model_runner import PREFILL_GRAPH_TOKENS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def gpu_model():
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 to the bit, as generate computes it
    return build("qwen2", hidden_size=128, intermediate_size=256).cuda()


def gpu_engine(model, graphs: bool = True, rows: int = 16) -> Engine:
    return Engine(model, EngineConfig(kv_cache_gb=1.0, max_rows=rows, max_seq_len=1024, cuda_graphs=graphs))


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_with_graphed_decode_and_prefill_equal_transformers_generate():
    model = gpu_model()
    prompts = random_prompts([5, 23, 11, 1, 40, 17])
    prompts += [prompts[1], prompts[4], prompts[1]]  # copies: prefilled once, the keys and values copied
    engine = gpu_engine(model)
    results = engine.generate(prompts, [GREEDY] * len(prompts))
    assert engine.runner.graph_prefill and engine.runner._prefill_graphs, "a small prefill call replays a graph"
    assert engine.stats.shared_tokens == 2 * 23 + 40
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 12) for p in prompts]


def test_turns_that_never_wait_give_the_same_tokens_with_graphs_as_without():
    """Episodes of random response lengths submitted as soon as their previous turn ends: prefill calls of many
    sizes (each a graph of its bucket), a decode batch that shrinks and grows, KV reuse across turns."""
    model = gpu_model()
    generator = torch.Generator().manual_seed(3)
    first = random_prompts([30 + 7 * e for e in range(12)], seed=4)
    observations = torch.randint(0, VOCAB, (12, 5, 9), generator=generator).tolist()
    lengths = torch.randint(2, 20, (12, 5), generator=generator).tolist()

    def play(engine: Engine) -> list[list[list[int]]]:
        prompts, turn = [list(p) for p in first], [0] * 12
        responses: list[list[list[int]]] = [[] for _ in range(12)]
        owner = {engine.submit(prompts[e], SamplingParams(temperature=0, max_new_tokens=lengths[e][0])): e
                 for e in range(12)}
        while owner:
            for result in engine.step():
                e = owner.pop(result.id)
                responses[e].append(result.token_ids)
                prompts[e] = prompts[e] + result.token_ids + observations[e][turn[e]]
                turn[e] += 1
                if turn[e] < 5:
                    params = SamplingParams(temperature=0, max_new_tokens=lengths[e][turn[e]])
                    owner[engine.submit(prompts[e], params)] = e
        return responses

    graphed = gpu_engine(model)
    assert play(graphed) == play(gpu_engine(model, graphs=False))
    assert len(graphed.runner._prefill_graphs) >= 2
    assert graphed.stats.reused_tokens > 0


def test_a_prefill_call_too_large_for_a_graph_runs_without_one():
    model = gpu_model()
    prompts = random_prompts([1000] * 16)  # 16 x 1,024 padded tokens: one call, past PREFILL_GRAPH_TOKENS
    assert 16 * 1024 > PREFILL_GRAPH_TOKENS
    engine = gpu_engine(model)
    results = engine.generate(prompts, [GREEDY] * 16)
    assert not engine.runner._prefill_graphs and engine.stats.prefill_calls == 1
    assert [r.token_ids for r in results[:3]] == [hf_greedy(model, p, 12) for p in prompts[:3]]


def test_vlm_rollouts_with_images_equal_transformers_on_a_gpu(tiny_vlm_dir):
    """The VLM path with the GPU's kernels: compiled layers over per-call M-RoPE rows, the Triton attention, graphed
    decode with each row's rope delta."""
    from tests.policy.test_engine_policy import image_rollouts
    from turnrl.config import ModelConfig
    from turnrl.models.loading import load_processor
    from turnrl.policy.engine import EnginePolicy
    from turnrl.policy.hf import HFPolicy

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = HFPolicy.from_config(ModelConfig(device="cuda", dtype="float32"), str(tiny_vlm_dir))
    engine = EnginePolicy(hf.model, hf.tokenizer, EngineConfig(kv_cache_gb=1.0, max_rows=8, max_seq_len=4096),
                          processor=load_processor(str(tiny_vlm_dir)))
    for a, b in zip(image_rollouts(hf), image_rollouts(engine)):
        first, second = a.tokens.stream(), b.tokens.stream()
        assert (first.input_ids, first.loss_mask) == (second.input_ids, second.loss_mask)
        torch.testing.assert_close(first.logprobs, second.logprobs, atol=1e-3, rtol=1e-3)
    assert engine.engine.stats.reused_tokens > 0
