"""The policy server's batcher, deterministically: a fake policy, so that timing cannot make the outcome vary."""

from __future__ import annotations

import asyncio
import time

from turnrl.config import SamplingConfig
from turnrl.policy.interface import Completion, GenerationRequest, Policy
from turnrl.serve.batching import GenerationBatcher


class FakePolicy(Policy):
    """Answers each prompt with its first id as text; fails any batch holding the id 666."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[tuple[int, SamplingConfig]] = []
        self.delay_s = delay_s

    def generate(self, requests, sampling):
        self.calls.append((len(requests), sampling))
        time.sleep(self.delay_s)
        if any(r.prompt_ids[0] == 666 for r in requests):
            raise RuntimeError("poisoned prompt")
        return [Completion(text=str(r.prompt_ids[0]), token_ids=[1] * (r.max_new_tokens or 1)) for r in requests]


def run_jobs(policy, jobs, max_batch_size=16, window_s=0.05):
    """Submit ``jobs`` = [(first_id, n, sampling)] at once; returns completions or exceptions per job."""

    async def main():
        batcher = GenerationBatcher(policy, max_batch_size=max_batch_size, window_s=window_s)
        batcher.start()
        try:
            submissions = [
                batcher.submit(
                    [GenerationRequest(prompt_ids=[first], messages=[], max_new_tokens=first % 7 + 1)] * n, s)
                for first, n, s in jobs
            ]
            return await asyncio.gather(*submissions, return_exceptions=True), batcher.stats
        finally:
            await batcher.stop()

    return asyncio.run(main())


def test_batcher_merges_concurrent_requests_into_one_call():
    policy, greedy = FakePolicy(), SamplingConfig(temperature=0)
    results, stats = run_jobs(policy, [(i, 2, greedy) for i in range(5)])
    assert len(policy.calls) == 1 and policy.calls[0][0] == 10
    assert policy.calls[0][1].max_new_tokens == 5  # the largest per-prompt budget
    assert [[c.text for c in r] for r in results] == [[str(i)] * 2 for i in range(5)]
    assert [len(r[0].token_ids) for r in results] == [i % 7 + 1 for i in range(5)]
    assert (stats.requests, stats.prompts, stats.generate_calls) == (5, 10, 1)


def test_batcher_groups_by_sampling_and_caps_batch_size():
    policy = FakePolicy()
    cold, hot = SamplingConfig(temperature=0), SamplingConfig(temperature=1.0, stop=["x"])
    results, _ = run_jobs(policy, [(1, 1, cold), (2, 1, hot), (3, 1, cold), (4, 1, hot)])
    assert sorted(size for size, _ in policy.calls) == [2, 2]
    assert {s.temperature for _, s in policy.calls} == {0, 1.0}
    assert [r[0].text for r in results] == ["1", "2", "3", "4"]

    policy = FakePolicy()
    run_jobs(policy, [(i, 3, cold) for i in range(4)], max_batch_size=7)
    assert [size for size, _ in policy.calls] == [6, 6]  # whole requests, at most 7 prompts per call


def test_batcher_isolates_a_request_that_breaks_generation():
    policy, greedy = FakePolicy(), SamplingConfig(temperature=0)
    results, _ = run_jobs(policy, [(1, 1, greedy), (666, 1, greedy), (3, 2, greedy)])
    assert results[0][0].text == "1" and [c.text for c in results[2]] == ["3", "3"]
    assert results[1].status == 500 and "poisoned prompt" in results[1].message


class AbortingPolicy(FakePolicy):
    """Reports every prompt of a batch holding the id 13 as failed, as the engine ends every request of a step
    that failed; the id 14 alone does not fit the context, as an HTTP policy reports it."""

    def generate(self, requests, sampling):
        completions = super().generate(requests, sampling)
        if any(r.prompt_ids[0] == 13 for r in requests):
            return [Completion(text="", finish_reason="error", error="decode failed: RuntimeError: boom")
                    for _ in requests]
        return [Completion(text="", finish_reason="context", error="the prompt has 9000 tokens")
                if r.prompt_ids[0] == 14 else completion for r, completion in zip(requests, completions)]


def test_a_request_reported_failed_is_an_error_and_fails_alone():
    """A policy reports a request it could not complete as a completion with ``finish_reason="error"`` (the engine
    reports every request of a failed step so): it was answered as a 200 of empty text with a finish_reason no
    client knows, and one request that broke the step took down every request batched with it."""
    policy, greedy = AbortingPolicy(), SamplingConfig(temperature=0)
    results, stats = run_jobs(policy, [(1, 1, greedy), (13, 1, greedy), (3, 2, greedy), (14, 1, greedy)])
    assert results[0][0].text == "1" and [c.text for c in results[2]] == ["3", "3"]
    assert stats.prompts == 5  # each prompt once, the failed batch's retries not counted twice
    assert results[1].status == 500 and results[1].type == "server_error"
    assert results[1].message == "the policy could not complete the request: decode failed: RuntimeError: boom"
    assert results[3].status == 400 and results[3].code == "context_length_exceeded"
    assert "the prompt has 9000 tokens" in results[3].message
