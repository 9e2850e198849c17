"""The batcher of ``turnrl serve-policy``: concurrent requests share forward passes.

A background task takes the first waiting request, waits ``batch_window_s`` (5 ms by default) for
others, and runs up to ``max_batch_size`` prompts in one ``policy.generate``
call per distinct sampling setting (temperature, top_p, top_k, stop; each
prompt keeps its own ``max_tokens``). Requests arriving while the model is busy
wait and form the next batch. Generation runs on one dedicated thread, so the
event loop keeps accepting requests (and ``/health`` answers) meanwhile. If a
batch fails (``generate`` raises, or reports requests as failed, as the engine
reports every request of a step that failed), its failed requests are run one
by one, so a request that breaks generation fails alone with a 500 and the
server keeps serving.

A request whose client went away while it waits is dropped from its batch (nobody would receive it). Once its
``generate`` call runs, it runs to its end: a policy's ``generate`` cannot be stopped part-way, and a batch holds
other clients' prompts too. A request of more prompts than ``max_batch_size`` (``n`` of 128) runs alone, in
calls of ``max_batch_size`` prompts each, and is stopped between them: at most one call of ``max_batch_size``
prompts is generated for a client that left.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from turnrl.config import SamplingConfig
from turnrl.policy.interface import Completion, GenerationRequest, Policy
from turnrl.serve.chat_schema import APIError

logger = logging.getLogger("turnrl.server")


@dataclass
class BatcherStats:
    """Counters of the batcher (reported by ``/health``)."""

    requests: int = 0
    """HTTP requests submitted."""
    prompts: int = 0
    """Prompts generated (a request with ``n`` choices counts ``n``)."""
    generate_calls: int = 0
    """Calls of the policy's ``generate``."""


@dataclass
class _Job:
    """The prompts of one HTTP request and where its completions go."""

    requests: list[GenerationRequest]
    sampling: SamplingConfig
    future: asyncio.Future = field(repr=False)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; send the request again once it is back", type="server_error")


def sampling_key(sampling: SamplingConfig) -> tuple:
    """What must be equal for prompts to share a ``generate`` call (``max_new_tokens`` may differ per prompt)."""
    return (sampling.temperature, sampling.top_p, sampling.top_k, tuple(sampling.stop))


class GenerationBatcher:
    """Collects concurrent requests into shared ``generate`` calls on one worker thread.

    Args:
        policy: the policy whose ``generate`` the batches go to.
        max_batch_size: prompts per ``generate`` call at most (a larger request runs alone, in parts of this many).
        window_s: how long the first waiting request waits for others to join it.
    """

    def __init__(self, policy: Policy, max_batch_size: int, window_s: float) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.window_s = window_s
        self.stats = BatcherStats()
        self._pending: deque[_Job] = deque()
        self._taken: list[_Job] = []
        """The jobs of the batch being generated (out of ``_pending``, not yet answered)."""
        self._closed = False
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        # One thread: the model runs one batch at a time, always from the same thread.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turnrl-generate")

    @property
    def pending(self) -> int:
        """Requests waiting for a batch (one whose client went away is not counted)."""
        return sum(not job.future.done() for job in self._pending)

    @property
    def generating(self) -> int:
        """Requests of the batch being generated whose client still waits for them."""
        return sum(not job.future.done() for job in self._taken)

    def start(self) -> None:
        self._arrived = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="turnrl-batcher")

    async def stop(self) -> None:
        """Stop taking requests: those waiting or being generated, and any submitted later, get a 503."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for job in [*self._taken, *self._pending]:
            if not job.future.done():
                job.future.set_exception(shutting_down())
        self._taken, self._pending = [], deque()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        """Queue one HTTP request's prompts; returns their completions once their batch ran."""
        if self._arrived is None:
            raise RuntimeError("the batcher is not started")
        if self._closed:
            raise shutting_down()
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Job(requests, sampling, future))
        self.stats.requests += 1
        self._arrived.set()
        return await future

    async def _run(self) -> None:
        assert self._arrived is not None
        while True:
            await self._arrived.wait()
            if sum(len(job.requests) for job in self._pending) < self.max_batch_size:
                await asyncio.sleep(self.window_s)  # let concurrent requests join this batch
            jobs = self._take()
            if not self._pending:
                self._arrived.clear()
            self._taken = jobs
            groups: dict[tuple, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(sampling_key(job.sampling), []).append(job)
            for group in groups.values():
                await self._generate(group)
            self._taken = []

    def _take(self) -> list[_Job]:
        """Waiting jobs in arrival order, up to ``max_batch_size`` prompts (at least one job)."""
        jobs: list[_Job] = []
        size = 0
        while self._pending:
            job = self._pending[0]
            if job.future.done():  # the client went away
                self._pending.popleft()
                continue
            if jobs and size + len(job.requests) > self.max_batch_size:
                break
            jobs.append(self._pending.popleft())
            size += len(job.requests)
        return jobs

    async def _generate(self, jobs: list[_Job]) -> None:
        jobs = [job for job in jobs if not job.future.done()]  # a client that went away meanwhile is not served
        if not jobs:
            return
        requests = [request for job in jobs for request in job.requests]
        sampling = replace(jobs[0].sampling, max_new_tokens=max(r.max_new_tokens or 1 for r in requests))
        loop = asyncio.get_running_loop()
        completions: list[Completion] = []
        try:
            # More prompts than a batch are one request's alone (``_take``): in parts, so that a client that
            # leaves meanwhile is generated no further than the part in progress.
            for start in range(0, len(requests), self.max_batch_size):
                if all(job.future.done() for job in jobs):  # every client went away
                    return
                part = requests[start : start + self.max_batch_size]
                self.stats.generate_calls += 1
                answers = await loop.run_in_executor(self._executor, self.policy.generate, part, sampling)
                if len(answers) != len(part):
                    raise RuntimeError(f"generate returned {len(answers)} completions for {len(part)} prompts")
                completions.extend(answers)
        except Exception as error:
            if len(jobs) > 1:
                # Find the request that broke the batch: the others still get their answers.
                for job in jobs:
                    await self._generate([job])
                return
            logger.exception("generation failed")
            if not jobs[0].future.done():
                jobs[0].future.set_exception(
                    APIError(500, f"generation failed: {type(error).__name__}: {error}", type="server_error")
                )
            return
        start, failed = 0, []
        for job in jobs:
            answers = completions[start : start + len(job.requests)]
            start += len(job.requests)
            if any(answer.finish_reason == "error" for answer in answers) and len(jobs) > 1:
                failed.append(job)  # a failed step (the engine's) ends every request of the batch: retried alone
                continue
            self.stats.prompts += len(job.requests)  # a retried job's count when it is answered, once
            if not job.future.done():
                settle(job.future, answers)
        for job in failed:
            await self._generate([job])


def settle(future: asyncio.Future, completions: list[Completion]) -> None:
    """Answer a request with its completions, or with the error of the first that failed: a policy reports a
    request it could not complete as a completion (``finish_reason`` ``error`` or ``context``), which is no
    answer to send as text."""
    failure = next((c for c in completions if c.finish_reason in ("error", "context")), None)
    if failure is None:
        future.set_result(completions)
    elif failure.finish_reason == "context":
        future.set_exception(APIError(400, f"the prompt does not fit the model's context: {failure.error}",
                                      param="messages", code="context_length_exceeded"))
    else:
        logger.error("the policy could not complete a request: %s", failure.error)
        future.set_exception(APIError(500, f"the policy could not complete the request: {failure.error}",
                                      type="server_error"))
