"""The model runner without the scheduler: prefill calls and decode steps planned by hand give transformers' greedy
tokens; a copy of a prompt takes its leader's keys and values and logits; the inputs of a prefill call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_llm_engine import GREEDY, build, hf_greedy, random_prompts
from turnrl.config import EngineConfig
from turnrl.engine.attention import triton_available
from turnrl.engine.model_runner import ModelRunner, kv_cache_for, prefill_inputs, triton_enabled
from turnrl.engine.scheduler import DecodeBatch, PrefillChunk
from turnrl.engine.sequences import EngineStats, SequenceRecord
from turnrl.engine.weights import decoder_weights


def test_prefill_and_decode_steps_planned_by_hand_give_transformers_greedy_tokens():
    """Two prompts prefilled in one call (in rows 2 and 0: the rows need not be in order) and a copy of the first in
    row 1, then decode steps of all three rows: each row's greedy tokens are generate's, and the copy's are its
    leader's."""
    model = build("qwen2")
    config = EngineConfig(kv_cache_gb=1.0, max_rows=4, max_seq_len=256, triton="false")
    weights = decoder_weights(model, torch.float32)
    cache = kv_cache_for(weights, config, torch.float32, torch.device("cpu"))
    stats = EngineStats()
    runner = ModelRunner(weights, cache, config, stats)
    first, second = random_prompts([21, 9], seed=3)
    sequences = [SequenceRecord(0, first, GREEDY, row=2), SequenceRecord(1, second, GREEDY, row=0)]
    copy = SequenceRecord(2, list(first), GREEDY, row=1)
    everyone = [*sequences, copy]
    for sequence in everyone:
        assert cache.resize(sequence.row, len(sequence.prompt) + GREEDY.max_new_tokens)
    cache.sync()
    runner.start_rows(everyone)
    with torch.no_grad():  # as the engine's step runs it
        launched = runner.prefill(PrefillChunk(sequences, [(0, copy)]))
        assert launched.rows.tolist() == [2, 0, 1]
        generated: dict[int, list[int]] = {s.row: [int(t)] for s, t in zip(everyone, runner.read(launched)[0])}
        rows = np.array([0, 1, 2], dtype=np.int64)
        lengths = np.array([len(second), len(first), len(first)], dtype=np.int64)
        for step in range(GREEDY.max_new_tokens - 1):
            tokens = runner.read(runner.decode(DecodeBatch(rows, lengths + step)))[0]
            for row, token in zip(rows.tolist(), tokens.tolist()):
                generated[row].append(int(token))
    assert generated[2] == generated[1] == hf_greedy(model, first, GREEDY.max_new_tokens)
    assert generated[0] == hf_greedy(model, second, GREEDY.max_new_tokens)
    assert (stats.prefill_calls, stats.prefill_tokens, stats.decode_steps) == (1, 21 + 9, GREEDY.max_new_tokens - 1)


def test_a_text_model_names_what_it_cannot_run_in_a_prompt():
    model = build("qwen2")
    config = EngineConfig(kv_cache_gb=1.0, max_rows=2, max_seq_len=256, triton="false")
    weights = decoder_weights(model, torch.float32)
    runner = ModelRunner(weights, kv_cache_for(weights, config, torch.float32, torch.device("cpu")), config,
                         EngineStats())
    vocab = model.config.vocab_size
    assert runner.read_prompt([1, 2, 3], None, None) == (None, None)
    _, images = runner.read_prompt([1, 2], {"pixel_values": torch.zeros(4, 12)}, None)
    assert "takes no images" in (images or "")
    _, outside = runner.read_prompt([1, vocab, 2], None, None)
    assert f"token id {vocab}" in (outside or "")


def test_triton_kernels_asked_for_on_a_cpu_without_the_interpreter_are_refused_with_what_to_do(monkeypatch):
    if not triton_available():
        pytest.skip("Triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="model.engine.triton=auto or false"):
        triton_enabled("true", torch.device("cpu"))
    assert not triton_enabled("auto", torch.device("cpu"))
    assert not triton_enabled("false", torch.device("cuda"))


def test_prefill_inputs_equal_a_plain_loop():
    news, starts, scratch = [[5, 6, 7], [8], [9, 10]], [0, 12, 3], 99
    tokens, positions, write_pos = prefill_inputs(news, starts, scratch)
    for i, (new, start) in enumerate(zip(news, starts)):
        width = len(new)
        assert tokens[i].tolist() == new + [0] * (3 - width)
        assert positions[i].tolist() == [start + min(j, width - 1) for j in range(3)]
        assert write_pos[i].tolist() == [start + j if j < width else scratch for j in range(3)]
