"""Continuous batching over a KV cache that outlives each request.

One :meth:`Engine.step` admits waiting sequences into free cache rows (a prompt
that extends a row's cached tokens prefills only the new ones), prefills them,
then decodes one token for every running sequence. A finished sequence leaves
its row at once and a waiting one takes it: sequences never wait for each
other. The cache is a budget of pages (``EngineConfig.kv_cache_gb``;
:mod:`turnrl.engine.cache`): a sequence takes, when it is admitted, the pages
of its prompt and its generation budget, not of ``max_seq_len``, so that short
turns share the budget among many. When the pages run short, the idle rows
(finished sequences kept for their next turn) give theirs up, those idle
longest first, and an evicted sequence is prefilled again if it returns; when
running sequences hold them all, new sequences wait. Nothing is dropped.

On a GPU, decode runs as CUDA graphs captured per batch bucket, and so do
small prefill calls (per bucket of sequences and new tokens), of layer
functions compiled by ``torch.compile`` (their elementwise work fused into a
few kernels; compiled once for every bucket and layer, and once for prefill
calls), with attention in one Triton kernel that reads each row only as far as
its sequence goes (:mod:`turnrl.engine.attention`); on a CPU, the same code
runs eagerly with torch's attention. A compilation that fails falls back to
eager work with a warning.

A VLM (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the families with a vision side in
:mod:`turnrl.engine.families`) runs the same way: its prompts' images go
through the model's own vision tower at prefill (Qwen3-VL's deepstack
features added to its first layers' outputs there), its tokens turn by their
M-RoPE positions, and its cache rows are matched on the images' pixels
(:mod:`turnrl.engine.images`).

The host work of a step is a few array operations for the whole batch, not
Python per sequence: the running sequences' counters live in arrays by row
(:class:`~turnrl.engine.running.RunningRows`), each row's next input token
stays on the device where it was sampled, and a step copies its sampled
tokens and logprobs to the host once. That host work overlaps the device's:
a step launches decode step n, then reads step n-1's tokens while step n runs
(a row's next input is already on the device, and its next position is known).
A row whose step n-1 token ended its sequence has decoded one token more,
which is dropped; a row whose budget ends at step n-1 is left out of step n.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from turnrl.config import GREEDY_BELOW_TEMPERATURE, EngineConfig
from turnrl.engine.attention import triton_available
from turnrl.engine.cache import KVCache, pages_for
from turnrl.engine.forward import (
    EAGER,
    DecoderKernels,
    Deepstack,
    DynamicCompiled,
    compiled_kernels,
    decoder_forward,
    final_logits,
    mrope_rows,
    power_of_two_at_least,
    rotary_table,
    round_up,
)
from turnrl.engine.graphs import DecodeGraph, PrefillGraph
from turnrl.engine.images import PromptImages, prompt_images
from turnrl.engine.rows import PREFIX_KEY_TOKENS, RowTable
from turnrl.engine.running import RunningRows
from turnrl.engine.sampler_kernels import sample_two_pass
from turnrl.engine.sampling import logprobs_before_suppression, sample_tokens, sample_untruncated
from turnrl.engine.stops import TAIL_SLACK_TOKENS, StopStringFilter, stop_string_in_tail
from turnrl.engine.timing import DeviceTimer, causal_pairs
from turnrl.engine.weights import DecoderWeights, decoder_weights
from turnrl.models.devices import to_device

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_ids: tuple[int, ...] = ()
    """Token ids that end the sequence (kept as its last token)."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end the sequence at the token that completes one (needs the engine's ``decode``)."""


@dataclass
class Result:
    """A finished sequence."""

    id: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """``stop`` (a stop id or string), ``length`` (max_new_tokens) or ``error``."""
    error: str | None = None
    reused_tokens: int = 0
    """Prompt tokens found in the cache (not prefilled)."""


@dataclass
class _Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    images: PromptImages | None = None
    """A VLM prompt's images (None: text)."""
    row: int = -1
    cached: int = 0
    """Prompt tokens whose keys and values are in the row (while it is prefilled; then the row's counters hold
    the sequence's progress, :class:`RunningRows`)."""
    reused: int = 0

    @property
    def keys(self) -> list[int]:
        """What the cache rows are matched on: the prompt, with each image's placeholders standing for its pixels."""
        return self.images.keys if self.images is not None else self.prompt


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_calls: int = 0
    reused_tokens: int = 0
    shared_tokens: int = 0
    """Prompt tokens copied from the prefill of an identical prompt admitted with them, not computed again."""
    decode_steps: int = 0
    generated_tokens: int = 0
    evictions: int = 0
    prefill_attention_pairs: int = 0
    """Query-key pairs of the prefilled tokens' causal attention: each new token against its sequence's cached
    prefix and the new tokens up to itself (:func:`~turnrl.engine.timing.causal_pairs`)."""
    decode_key_tokens: int = 0
    """Cached tokens the decode steps attended to: each step, every decoded row's keys and values up to its new
    token, summed over the steps (what the decode steps read of the cache: this x a token's key and value bytes)."""


@dataclass
class _Launched:
    """A sampling launched on the device whose tokens the host has not read yet."""

    rows: np.ndarray
    """The rows sampled, Shape (n,)."""
    sampled: torch.Tensor
    """Tokens and logprobs, Shape (2, n) float64, on the host (pinned on a GPU); filled when ``done`` is."""
    done: torch.cuda.Event | None
    """Recorded after the copy to the host; None on a CPU (the copy is synchronous)."""


ADMIT_AFTER_STEPS = 8
"""Decode steps a waiting sequence waits at most for others to be prefilled with it."""

PREFILL_GRAPH_TOKENS = 8192
"""Prefill calls of at most this many padded tokens (sequences and new tokens in power-of-two buckets) replay CUDA
graphs: launching a prefill's layers from Python cost about 25 ms a call on an H100 whatever its size, which
turns that prefill a few arrivals at a time paid dearly. Larger calls keep the device busy longer than their
launches take."""


def _bucket(value: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= value)


def prefill_inputs(news: Sequence[list[int]], starts: Sequence[int], scratch: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prefill call's right-padded inputs: each sequence's new tokens, from its position ``starts[i]`` on.

    Notation: b sequences, t the most new tokens of one.

    Returns:
        tokens, positions (a padding token repeats its sequence's last position), write positions (``scratch``
        for padding), each Shape (b, t) int64.
    """
    lengths = np.array([len(n) for n in news], dtype=np.int64)
    begin = np.array(starts, dtype=np.int64)[:, None]
    offsets = np.arange(int(lengths.max()), dtype=np.int64)[None, :]
    real = offsets < lengths[:, None]
    tokens = np.zeros(real.shape, dtype=np.int64)
    tokens[real] = np.fromiter(itertools.chain.from_iterable(news), dtype=np.int64, count=int(lengths.sum()))
    positions = begin + np.minimum(offsets, lengths[:, None] - 1)
    return tokens, positions, np.where(real, positions, scratch)


def cache_budget_bytes(config: EngineConfig, device: torch.device) -> float:
    """``kv_cache_gb``, or when it is 0: 30% of the free GPU memory, 4 GiB on a CPU."""
    if config.kv_cache_gb > 0:
        return config.kv_cache_gb * 2**30
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return 0.3 * free
    return 4.0 * 2**30


def compile_enabled(setting: str, device: torch.device) -> bool:
    """``model.engine.compile``: ``auto`` compiles on a GPU only (on a CPU, compiling costs more than it saves)."""
    value = str(setting).lower()
    return device.type == "cuda" if value == "auto" else value == "true"


def triton_enabled(setting: str, device: torch.device) -> bool:
    """``model.engine.triton``: ``auto`` takes the Triton kernels on a GPU when Triton is installed."""
    value = str(setting).lower()
    if value == "false":
        return False
    if value == "true":
        if not triton_available():
            raise RuntimeError("model.engine.triton=true needs Triton, which this torch install lacks (CUDA builds "
                               "of torch ship it); set model.engine.triton=false or auto")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"model.engine.triton=true runs Triton kernels on a GPU, and this engine is on "
                               f"{device.type} (only Triton's interpreter, TRITON_INTERPRET=1, runs them on a CPU, "
                               "slowly: the tests do); set model.engine.triton=auto or false")
        return True
    return device.type == "cuda" and triton_available()


def identical_prompts(sequences: list[_Sequence]) -> tuple[list[_Sequence], dict[int, list[_Sequence]]]:
    """The first of each distinct prompt (with its images), in order, and by ``id`` of each the later sequences with
    the same one. Prompts are compared whole only within a bucket of equal length and first tokens: a pass that
    hashed every prompt would cost the host as much as the prefill's own bookkeeping."""
    leaders: list[_Sequence] = []
    followers: dict[int, list[_Sequence]] = {}
    buckets: dict[tuple[int, ...], list[_Sequence]] = {}
    for sequence in sequences:
        keys = sequence.keys
        bucket = buckets.setdefault((len(keys), *keys[:PREFIX_KEY_TOKENS]), [])
        leader = next((other for other in bucket if other.keys == keys), None)
        if leader is None:
            bucket.append(sequence)
            leaders.append(sequence)
            followers[id(sequence)] = []
        else:
            followers[id(leader)].append(sequence)
    return leaders, followers


def weights_version(model: nn.Module) -> int:
    """A number that changes whenever a parameter is modified in place (an optimizer step, a load)."""
    return sum(p._version for p in model.parameters())


class Engine:
    """Generation from ``model``'s own weights (a model of a family in :mod:`turnrl.engine.families`; see
    :mod:`turnrl.engine.weights`).

    Args:
        model: the policy, possibly peft-wrapped; its parameters are read where they live.
        config: cache budget, sequence length, CUDA graphs, compilation, fused projections.
        dtype: the compute dtype (bf16 on a GPU in mixed precision).
        decode: token ids to text, for stop strings.
    """

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig,
        dtype: torch.dtype | None = None,
        decode: Callable[[list[int]], str] | None = None,
        vocab_limit: int | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = dtype or next(model.parameters()).dtype
        self.weights: DecoderWeights = decoder_weights(model, self.dtype, fuse=config.fuse_projections)
        self.decode = decode
        self.max_len = config.max_seq_len
        rows = config.max_rows
        pages = KVCache.pages_in(cache_budget_bytes(config, self.device),
                                 KVCache.bytes_per_token(self.weights.shape.key_width, self.dtype))
        # At least one sequence of max_len, whatever the budget (as a cache of rows held one row at least).
        pages = max(pages, pages_for(self.max_len) + 1)
        self.cache = KVCache(self.weights.shape, rows, self.max_len, pages, self.dtype, self.device)
        """Pages of keys and values; a row (a sequence's slot) takes them as it is admitted."""
        self.cache.reserve_scratch()
        self.table = RowTable(rows)
        self.rope = rotary_table(self.weights, self.cache.capacity + 1, self.device)  # scratch position too
        self.waiting: deque[_Sequence] = deque()
        self.running: dict[int, _Sequence] = {}  # by row
        self.finished: list[Result] = []
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._steps_waited = 0
        self._version = weights_version(model)
        self._batch_buckets = sorted({min(2**i, rows) for i in range(20) if 2 ** (i - 1) < rows} | {rows})
        # Key lengths in steps of 256: decode reads every key position up to the bucket, so a coarser
        # bucket wastes reads (512 + 256 tokens in a 1,024 bucket read a third more than needed).
        self._key_buckets = sorted({min(256 * i, self.cache.capacity) for i in range(1, self.max_len // 256 + 2)})
        vocab = self.weights.shape.vocab_size
        self.state = RunningRows(rows, vocab)
        """The running sequences' tokens, logprobs and counters, by row."""
        self._stop_filter = StopStringFilter(decode, vocab) if decode is not None else None
        self._next_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        """Each running row's last sampled token, the input of its next decode step, Shape (rows,)."""
        self._temperature = torch.ones(rows, dtype=torch.float32, device=self.device)
        self._top_k = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._top_p = torch.ones(rows, dtype=torch.float32, device=self.device)
        self._truncating = np.zeros(rows, dtype=bool)
        """Rows whose sequence samples with top-k or top-p."""
        pinned = self.device.type == "cuda"
        # Positions are built on the host and copied in one transfer (from pinned memory on a GPU: no stall).
        # Two of each host buffer, used in turn: a step fills one while the previous step's may still be copied.
        self._positions = [torch.zeros(rows, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        # Flat, so that a step's (2, n) view is contiguous: a copy into a strided view waits for the device.
        self._sampled = [torch.zeros(2 * rows, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        self._launched: _Launched | None = None
        """The decode step whose tokens the host reads during the next step's decode."""
        self._live = np.zeros(rows, dtype=bool)
        """Rows whose sequence is running (a launched step's row that finished since is dropped when read)."""
        self._in_flight = np.zeros(rows, dtype=np.int64)
        """Tokens sampled for each row that the host has not read yet (0 or 1)."""
        self._running_rows: tuple[np.ndarray, torch.Tensor | None] | None = None
        """The running rows in order, and the same on the device (None while they are 0 .. n-1); None after the
        running set changed."""
        self.timer = DeviceTimer(self.device)
        """Device time of prefill and decode work, when enabled (benchmarks split a call's time with it)."""
        self._graphs: dict[tuple[int, int], DecodeGraph] = {}
        self._prefill_graphs: dict[tuple[int, int], PrefillGraph] = {}
        self._graph_pool: Any = None
        self.use_graphs = config.cuda_graphs and self.device.type == "cuda"
        self.triton = triton_enabled(config.triton, self.device)
        """Attention and sampling in Triton kernels (:mod:`turnrl.engine.attention`,
        :mod:`turnrl.engine.cache_write`, :mod:`turnrl.engine.sampler_kernels`)."""
        vision = self.weights.vision
        self.graph_prefill = self.use_graphs and self.triton and vision is None
        """Small prefill calls replay CUDA graphs (:data:`PREFILL_GRAPH_TOKENS`); the Triton attention reads each row
        to its own length, so a graph needs no key-length bucket. (A VLM's prefill, with images and 3D positions,
        runs without.)"""
        self._rope_delta = torch.zeros(rows, dtype=torch.long, device=self.device)
        """A VLM's rows: a generated token at index i turns by M-RoPE position i + delta (0 for text)."""
        self._suppressed = (torch.tensor(vision.special_token_ids, device=self.device)
                            if vision is not None and vision.special_token_ids else None)
        """Tokens never sampled (a VLM's image placeholders and vision markers), or None."""
        head_rows = self.weights.shape.vocab_size
        self.vocab_limit = head_rows if vocab_limit is None else min(vocab_limit, head_rows)
        """The LM head's rows that are tokens (the tokenizer's): the rows past it are no token, never sampled,
        and out of the log-probs' normalizer, as in the trainer."""
        self.kernels: DecoderKernels = EAGER
        self._sample_untruncated: Callable[..., tuple[torch.Tensor, torch.Tensor]] = sample_untruncated
        if compile_enabled(config.compile, self.device):
            self.kernels = compiled_kernels()
            self._sample_untruncated = DynamicCompiled(sample_untruncated, {0: (0,), 1: (0,)})

    @property
    def rows(self) -> int:
        return self.cache.rows

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], params: SamplingParams, model_inputs: dict[str, Any] | None = None,
               image_digests: Sequence[int] | None = None) -> int:
        """Queue a prompt; its :class:`Result` comes out of a later :meth:`step`.

        ``model_inputs``: a VLM prompt's images (``pixel_values``, ``image_grid_thw``, as its processor makes them),
        one per run of image placeholders in ``prompt``; ``image_digests``: theirs, as the image encoder made them
        (None: hashed from the pixel values; see :mod:`turnrl.engine.images`).
        """
        sequence = _Sequence(next(self._ids), list(prompt), params)
        error = None
        vision = self.weights.vision
        vocab = len(self.weights.embed.value)
        if vision is not None:
            if vision.video_token_id in sequence.prompt or (model_inputs or {}).get("pixel_values_videos") is not None:
                error = "the engine runs images, not videos: use model.backend=hf for a prompt with a video"
            else:
                try:
                    sequence.images = prompt_images(sequence.prompt, model_inputs, vision.image_token_id,
                                                    vision.merge_size, image_digests)
                except ValueError as invalid:
                    error = str(invalid)
        elif model_inputs and model_inputs.get("pixel_values") is not None:
            error = "this model takes no images (a text model); send the prompt without them"
        if error is not None:
            self.finished.append(Result(sequence.id, [], [], "error", error))
        elif not prompt:
            self.finished.append(Result(sequence.id, [], [], "error", "empty prompt"))
        elif min(prompt) < 0 or max(prompt) >= vocab:
            # Caught here, alone: in the batch's forward pass it would fail every sequence (on a GPU, the process).
            outside = next(token for token in prompt if not 0 <= token < vocab)
            self.finished.append(Result(
                sequence.id, [], [], "error",
                f"the prompt holds token id {outside}, outside the model's {vocab} embeddings (a tokenizer that does "
                "not match the model, or tokens added to it without resizing the embeddings)",
            ))
        elif len(prompt) >= self.max_len:
            self.finished.append(Result(
                sequence.id, [], [], "error",
                f"the prompt has {len(prompt)} tokens; the engine holds {self.max_len} a sequence "
                "(raise model.engine.max_seq_len)",
            ))
        else:
            self.waiting.append(sequence)
        return sequence.id

    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[Result]:
        """Run ``prompts`` to completion; results in prompt order."""
        ids = [self.submit(prompt, p) for prompt, p in zip(prompts, params)]
        results: dict[int, Result] = {}
        while len(results) < len(ids):
            for result in self.step():
                results[result.id] = result
        self.timer.collect()  # the spans still pending (none unless the timer is on)
        return [results[i] for i in ids]

    def abort(self, reason: str) -> list[Result]:
        """End every waiting and running sequence with an error (after a failed step); rows are freed."""
        self._launched = None
        self._in_flight[:] = 0
        self._live[:] = False
        aborted = [Result(s.id, [], [], "error", reason) for s in self.waiting]
        aborted += [Result(s.id, *self.state.generated(row), "error", reason) for row, s in self.running.items()]
        self.waiting.clear()
        for row in list(self.running):
            del self.running[row]
            self._release_row(row, [])
        self._running_rows = None
        self._drop_idle_rows()
        self.finished = []
        return aborted

    def sync_weights(self) -> None:
        """Pick up changed weights: recompute merged/cast buffers and forget cached keys and values."""
        version = weights_version(self.model)
        if version != self._version:
            if self.running:
                raise RuntimeError("the weights changed while sequences were generating")
            self.weights.refresh()
            self._drop_idle_rows()
            self._version = version

    def release_memory(self) -> None:
        """Free the key/value cache, the CUDA graphs captured on it and the computed weights (stacked
        projections, casts, merged adapters) between generations, for a training update to use: the next
        generation computes the weights again and allocates the cache as its sequences need. The model's own
        parameters are left alone.

        Raises:
            RuntimeError: sequences are generating or waiting.
        """
        if self.running or self.waiting or self._launched is not None:
            raise RuntimeError("the engine frees its memory between generations only; sequences are generating")
        self._drop_idle_rows()
        self.cache.release()
        self._drop_graphs()
        self.weights.release()
        self._version = -1  # no version of the weights: the next generation computes the buffers again

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new weights into the engine's model (a rollout worker's copy); caches are cleared."""
        self.model.load_state_dict(state_dict)
        self.sync_weights()

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def step(self) -> list[Result]:
        """Admit, prefill, launch a decode step, then read the previous one's tokens; returns the sequences that
        finished."""
        # The engine computes in its own dtype: a caller's autocast is switched off (entering the context only
        # when one is on: it costs more than the rest of a step's host work).
        outer_autocast = torch.is_autocast_enabled(self.device.type)
        with torch.autocast(self.device.type, enabled=False) if outer_autocast else contextlib.nullcontext():
            admitting = self._time_to_admit()
            # Rows and pages change hands, and the cache grows (dropping the graphs), only with no step in flight.
            if self._launched is not None and admitting:
                self._read(self._launched)
                self._launched = None
            if not self.running:
                self.sync_weights()
            admitted = self._admit() if admitting else []
            if admitted:
                self._prefill(admitted)
            launched = self._decode() if self.running else None
            if self._launched is not None:
                self._read(self._launched)
            if launched is not None and not self.running:
                # With no sequence left, the step just launched decoded only finished rows: nothing to read, and
                # its rows are no longer in flight (a row's next sequence would count that token against its
                # budget, and stop one token early or never end).
                self._in_flight[launched.rows] -= 1
                launched = None
            self._launched = launched
        self.timer.collect(wait=False)
        done, self.finished = self.finished, []
        return done

    def _time_to_admit(self) -> bool:
        """Prefill waiting sequences in batches: a prefill call costs about as much for one sequence as for
        many, so while others decode, arrivals wait until they are a quarter of the running batch, or for
        ``ADMIT_AFTER_STEPS`` decode steps at most."""
        if not self.waiting:
            return False
        self._steps_waited += 1
        if not self.running or len(self.waiting) * 4 >= len(self.running) or self._steps_waited > ADMIT_AFTER_STEPS:
            self._steps_waited = 0
            return True
        return False

    def _admit(self) -> list[_Sequence]:
        admitted = []
        self.cache.reserve_scratch()  # after release_memory
        while self.waiting:
            sequence = self.waiting[0]
            placement = self.table.place(sequence.keys)
            if placement is None:
                break
            if not self._take_pages(placement.row, len(sequence.prompt) + self._budget(sequence)):
                # Running sequences hold the pages: it waits for one to finish, keeping the row's cached prefix.
                self._release_row(placement.row, sequence.keys[: placement.reused])
                break
            self.waiting.popleft()
            sequence.row, sequence.cached, sequence.reused = placement.row, placement.reused, placement.reused
            self.stats.evictions += int(placement.evicted)
            self.stats.reused_tokens += placement.reused
            self.running[sequence.row] = sequence
            admitted.append(sequence)
        if self.cache.grown:  # graphs captured on the old tensors are dropped
            self.cache.grown = False
            self._drop_graphs()
        # The page table reaches the device only here, where no step is in flight (a copy from pageable memory
        # would wait for one). Between admissions it may still show pages that finished sequences gave back:
        # only rows not running read those (their output is discarded), and no page changes hands until now.
        self.cache.sync()
        if admitted:
            self._start_rows(admitted)
        return admitted

    def _budget(self, sequence: _Sequence) -> int:
        """Tokens it may generate: ``max_new_tokens``, or what is left of ``max_len`` after its prompt."""
        return min(sequence.params.max_new_tokens, self.max_len - len(sequence.prompt))

    def _take_pages(self, row: int, positions: int) -> bool:
        """Give ``row`` the pages of ``positions`` positions, evicting idle rows (those idle longest first) when the
        pool lacks them; False, evicting none, when running sequences hold too many."""
        missing = pages_for(positions) - self.cache.held(row)
        if missing > self.cache.free_pages:  # rare: the idle rows are looked at only then
            idle = [index for index in self.table.idle_rows() if index != row]
            if missing > self.cache.free_pages + sum(self.cache.held(index) for index in idle):
                return False  # the idle rows keep their tokens for their episodes' next turns
            for index in idle:
                if self.cache.free_pages >= missing:
                    break
                self.table.evict(index)
                self.cache.resize(index, 0)
                self.stats.evictions += 1
        return self.cache.resize(row, positions)

    def _release_row(self, row: int, cached_tokens: list[int]) -> None:
        """The row's sequence has ended (or was not admitted): the row keeps ``cached_tokens`` for a later prompt
        to extend (when the table indexes them) and the pages that hold them; its other pages go back."""
        self.table.release(row, cached_tokens)
        self.cache.resize(row, len(self.table.rows[row].tokens))

    def _drop_graphs(self) -> None:
        """Forget every CUDA graph, and their memory pool with them (the cache's tensors they were captured on are
        gone)."""
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._graph_pool = None

    def _drop_idle_rows(self) -> None:
        """Forget every idle row's cached tokens and free their pages (the weights changed, or the memory goes)."""
        for index in self.table.clear():
            self.cache.resize(index, 0)

    def _start_rows(self, sequences: list[_Sequence]) -> None:
        """Set the rows' counters and sampling settings for the sequences that take them."""
        for sequence in sequences:
            params = sequence.params
            # A sequence ends at max_new_tokens or when it fills its row, whichever comes first.
            self.state.start(sequence.row, len(sequence.prompt), self._budget(sequence), params.stop_ids,
                             params.stop_strings,
                             self._stop_filter.candidates if self._stop_filter is not None else None)
            self._truncating[sequence.row] = params.top_k > 0 or params.top_p < 1.0
            self._live[sequence.row] = True
        rows = to_device(np.array([s.row for s in sequences], dtype=np.int64), self.device)
        if self.weights.family.rotary.mrope:
            deltas = np.array([s.images.delta if s.images is not None else 0 for s in sequences], dtype=np.int64)
            self._rope_delta[rows] = to_device(deltas, self.device)
        settings = to_device(np.array([[s.params.temperature, s.params.top_k, s.params.top_p] for s in sequences],
                                      dtype=np.float32), self.device)
        # A temperature below GREEDY_BELOW_TEMPERATURE is greedy: stored as 0, which every sampler (the Triton
        # kernels included) reads as greedy.
        self._temperature[rows] = settings[:, 0].masked_fill(settings[:, 0] < GREEDY_BELOW_TEMPERATURE, 0.0)
        self._top_k[rows] = settings[:, 1].long()
        self._top_p[rows] = settings[:, 2]
        self._running_rows = None

    def _prefill(self, sequences: list[_Sequence]) -> None:
        """Run each sequence's uncached prompt tokens, in chunks of at most ``prefill_chunk_tokens`` padded tokens.

        A chunk's sampled tokens are read after the next chunk is launched, so that the host builds and launches
        a chunk while the GPU runs the one before, instead of the GPU waiting for the host's part of every chunk
        (two chunks at most in flight: the sampled-token buffers are two).

        Identical prompts (a group's episodes on one seed, n samples of one prompt) are prefilled once: the first
        is run, and the others ("followers") ride in its chunk, taking copies of its keys and values and
        sampling their first token from its logits."""
        leaders, followers = identical_prompts(sequences)
        pending = sorted(leaders, key=lambda s: len(s.prompt) - s.cached)
        chunks: list[list[_Sequence]] = [[]]
        for sequence in pending:
            chunk = chunks[-1]
            width = max([len(s.prompt) - s.cached for s in chunk] + [len(sequence.prompt) - sequence.cached])
            if chunk and width * (len(chunk) + 1) > self.config.prefill_chunk_tokens:
                chunks.append([])
            chunks[-1].append(sequence)
        previous = None
        for chunk in chunks:
            launched = self._prefill_chunk(chunk, [(i, f) for i, s in enumerate(chunk) for f in followers[id(s)]])
            if previous is not None:
                self._read(previous)
            previous = launched
        if previous is not None:
            self._read(previous)

    def _prefill_chunk(self, sequences: list[_Sequence], followers: Sequence[tuple[int, _Sequence]] = ()
                       ) -> _Launched:
        """Launch a chunk's prefill and the sampling of each sequence's first token (read with :meth:`_read`).

        Args:
            followers: (index in ``sequences`` of the sequence whose prompt it repeats, follower); see
                :meth:`_prefill`.
        """
        news = [s.prompt[s.cached :] for s in sequences]
        starts = [s.cached for s in sequences]
        b = len(sequences)
        tokens, positions, write_pos = prefill_inputs(news, starts, self.cache.capacity)
        rows = np.array([s.row for s in sequences], dtype=np.int64)
        last = np.array([len(n) - 1 for n in news], dtype=np.int64)
        self.timer.start("prefill")
        rows_t = to_device(rows, self.device)
        graph = self._prefill_graph(b, tokens.shape[1])
        if graph is not None:
            logits = graph.run(tokens, positions, write_pos, rows, last)[:b]
        else:
            tokens_t, positions_t, write_t, last_t = (
                to_device(a, self.device) for a in (tokens, positions, write_pos, last))
            rope_positions = embeddings = deepstack = None
            rope = self.rope
            if self.weights.vision is not None:
                rope, rope_positions, embeddings, deepstack = self._vlm_prefill_inputs(sequences, tokens_t)
            key_len = self._key_len(max(len(s.prompt) for s in sequences))
            logits = self._prefill_logits(tokens_t, positions_t, write_t, rows_t, last_t, key_len, rope=rope,
                                          rope_positions=rope_positions, embeddings=embeddings, deepstack=deepstack)
        for sequence, new in zip(sequences, news):
            sequence.cached += len(new)
        self.stats.prefill_tokens += sum(len(n) for n in news)
        self.stats.prefill_calls += 1
        self.stats.prefill_attention_pairs += sum(causal_pairs(start, len(n)) for start, n in zip(starts, news))
        if followers:
            leaders = np.array([i for i, _ in followers], dtype=np.int64)
            copies = np.array([f.row for _, f in followers], dtype=np.int64)
            self.cache.copy_rows(rows[leaders], copies, max(len(f.prompt) for _, f in followers))
            for _, follower in followers:
                self.stats.shared_tokens += len(follower.prompt) - follower.cached
                follower.cached = len(follower.prompt)
            logits = torch.cat((logits, logits[to_device(leaders, self.device)]))
            rows = np.concatenate((rows, copies))
            rows_t = to_device(rows, self.device)
        return self._sample(rows, rows_t, logits)

    def _prefill_logits(self, tokens: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor,
                        rows: torch.Tensor, last: torch.Tensor, key_len: int,
                        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                        rope_positions: torch.Tensor | None = None,
                        embeddings: torch.Tensor | None = None, deepstack: Deepstack | None = None) -> torch.Tensor:
        """The logits after each sequence's last new token, Shape (b, vocab), writing the new tokens' keys and
        values into the cache.

        Args:
            tokens, positions, write_pos: :func:`prefill_inputs`, Shape (b, t). rows: each sequence's cache row,
                Shape (b,). last: the index of each sequence's last new token, Shape (b,).
            rope, rope_positions, embeddings, deepstack: a VLM's (:meth:`_vlm_prefill_inputs`); None: the text
                model's.
        """
        def run(kernels: DecoderKernels) -> torch.Tensor:
            return decoder_forward(self.weights, self.cache, rope or self.rope, tokens, positions, write_pos, rows,
                                   key_len, kernels, self.triton, rope_positions=rope_positions, embeddings=embeddings,
                                   deepstack=deepstack)

        # As in decode, a failed compiled pass is run again eagerly: it rewrites the same keys and values.
        hidden = self._compiled_or_eager(lambda: run(self.kernels), lambda: run(EAGER))
        return final_logits(hidden[torch.arange(len(last), device=self.device), last], self.weights.norm.value,
                            self.weights.lm_head.value, self.weights.shape.rms_eps)

    def _vlm_prefill_inputs(self, sequences: list[_Sequence], tokens: torch.Tensor
                            ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor, Deepstack | None]:
        """A VLM prefill's rotary rows, the rows each token takes, input embeddings with the images in them, and the
        images' deepstack features (Qwen3-VL; None for other VLMs and calls without image tokens).

        Each new token turns by its own M-RoPE position (three axes; :func:`~turnrl.engine.images.mrope_positions`),
        so the call gets its own table: one cos/sin row per token, Shape (b * t, D), and rope positions
        ``0 .. b*t-1``. The images whose placeholders are among the new tokens run through the vision tower, and
        their features replace those placeholders' embeddings (their deepstack features go to the same tokens).

        Args:
            tokens: the call's tokens on the device, Shape (b, t).
        """
        vision = self.weights.vision
        assert vision is not None
        b, t = tokens.shape
        turns = np.zeros((b, t, 3), dtype=np.int64)  # padding turns by position 0: its output is never read
        pixels: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        slots: list[tuple[int, int]] = []
        feature_rows: list[int] = []
        features_before = 0
        for i, sequence in enumerate(sequences):
            start, length = sequence.cached, len(sequence.prompt) - sequence.cached
            images = sequence.images
            if images is None:
                turns[i, :length] = np.arange(start, start + length)[:, None]
                continue
            turns[i, :length] = images.positions[:, start:].T
            for (begin, end), image, grid in zip(images.spans, images.pixel_values, images.grids):
                if end <= start:
                    continue  # cached in the row already
                pixels.append(image)
                grids.append(grid)
                first = max(begin, start)  # a row may hold the start of an image: only the rest is prefilled
                slots += [(i, position - start) for position in range(first, end)]
                feature_rows += range(features_before + first - begin, features_before + end - begin)
                features_before += end - begin
        positions = to_device(turns.reshape(-1, 3), self.device)
        axes = vision.rope_axes
        rope = (mrope_rows(self.rope[0], positions, axes), mrope_rows(self.rope[1], positions, axes))
        embeddings = torch.nn.functional.embedding(tokens, self.weights.embed.value)
        deepstack = None
        if pixels:
            encoded = torch.stack(grids)
            self.timer.encoded(encoded)
            features = vision.features(torch.cat(pixels).to(self.device), encoded.to(self.device))
            index = to_device(np.array(slots, dtype=np.int64).T.copy(), self.device)
            taken = to_device(np.array(feature_rows, dtype=np.int64), self.device)
            embeddings[index[0], index[1]] = features.merged[taken].to(embeddings.dtype)
            if features.deepstack:
                deepstack = Deepstack((index[0], index[1]),
                                      [layer[taken].to(embeddings.dtype) for layer in features.deepstack])
        return rope, torch.arange(b * t, device=self.device).view(b, t), embeddings, deepstack

    def _prefill_graph(self, batch: int, width: int) -> PrefillGraph | None:
        """The CUDA graph for a prefill call of ``batch`` sequences and ``width`` new tokens, captured on first use;
        None when the call is run without one (too large, no graphs, or capturing failed)."""
        if not self.graph_prefill:
            return None
        key = (power_of_two_at_least(batch), power_of_two_at_least(width, 16))
        if key[0] * key[1] > PREFILL_GRAPH_TOKENS:
            return None
        if key not in self._prefill_graphs:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            try:
                self._prefill_graphs[key] = PrefillGraph(
                    lambda tokens, positions, write_pos, rows, last: self._prefill_logits(
                        tokens, positions, write_pos, rows, last, self.cache.capacity),
                    *key, self.cache.capacity, self.device, self._graph_pool)
            except Exception as error:
                logger.warning("engine: capturing a prefill graph failed (%s: %s); prefilling without graphs",
                               type(error).__name__, str(error).strip()[:200])
                self.graph_prefill = False
                return None
        return self._prefill_graphs[key]

    def _decode(self) -> _Launched | None:
        """Launch one token for every running sequence that may still generate one (None if none may); rows
        ``0 .. B-1`` are computed, idle ones write to scratch."""
        rows, rows_t = self._rows()
        # A row whose in-flight token is its last (its budget) has nothing more to decode.
        spent = self.state.count[rows] + self._in_flight[rows] >= self.state.budget[rows]
        if spent.any():
            rows = rows[~spent]
            if not len(rows):
                return None
            rows_t = None if rows[-1] == len(rows) - 1 else to_device(rows, self.device)
        # Graphs replay fixed shapes, so a graphed step pads the batch and the keys to buckets.
        top = int(rows[-1]) + 1
        batch = _bucket(top, self._batch_buckets) if self.use_graphs else top
        cached = self.state.cached[rows]
        longest = int(cached.max()) + 1
        key_len = self._key_len(longest, graphed=self.use_graphs)
        host_positions = self._positions[self._turn]
        positions = host_positions.numpy()
        positions[:batch] = self.cache.capacity  # rows not running write to scratch
        positions[rows] = cached
        self.timer.start("decode")
        positions_t = host_positions[:batch].to(self.device, non_blocking=True)
        tokens_t = self._next_tokens[:batch]
        if self.use_graphs:
            logits = self._graph(batch, key_len).run(tokens_t, positions_t)
        else:
            logits = self._decode_logits(tokens_t, positions_t, key_len)
        self.state.cached[rows] = cached + 1
        self.stats.decode_steps += 1
        self.stats.decode_key_tokens += int(cached.sum()) + len(rows)  # each row's keys up to its new token
        return self._sample(rows, rows_t, logits[rows_t] if rows_t is not None else logits[: len(rows)])

    def _rows(self) -> tuple[np.ndarray, torch.Tensor | None]:
        """The running rows in order, Shape (n,), and the same on the device (None while they are 0 .. n-1, which
        slicing serves); kept until a sequence starts or finishes."""
        if self._running_rows is None:
            rows = np.array(sorted(self.running), dtype=np.int64)
            dense = bool(rows[-1] == len(rows) - 1)
            self._running_rows = rows, None if dense else to_device(rows, self.device)
        return self._running_rows

    def _key_len(self, length: int, graphed: bool = False) -> int:
        """Key positions attended for sequences of at most ``length`` tokens, within the capacity: a bucket for
        a CUDA graph (a graph replays fixed shapes), else ``length`` rounded up to aligned rows (the positions
        past a sequence are masked). The Triton kernel reads each row to its own length whatever this is: its
        graphs are captured per batch bucket alone, at the capacity."""
        if self.triton:
            return self.cache.capacity
        return min(_bucket(length, self._key_buckets) if graphed else round_up(length), self.cache.capacity)

    def _decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> torch.Tensor:
        """Logits of one token per row, Shape (B, vocab), in the compute dtype; a position of ``cache.capacity``
        writes to scratch."""

        # A VLM's generated tokens turn by their index plus the row's M-RoPE delta (within the table: a row
        # writing to scratch may have a stale delta).
        turns = None
        if self.weights.family.rotary.mrope:
            turns = (positions + self._rope_delta[: len(positions)]).clamp(0, self.rope[0].shape[0] - 1).unsqueeze(1)

        def run(kernels: DecoderKernels) -> torch.Tensor:
            hidden = decoder_forward(
                self.weights, self.cache, self.rope, tokens.unsqueeze(1), positions.unsqueeze(1), None, None,
                key_len, kernels, self.triton, rope_positions=turns,
            )
            return kernels.final_logits(hidden[:, 0], self.weights.norm.value, self.weights.lm_head.value,
                                        self.weights.shape.rms_eps)

        # A failed compiled step may have written some layers' keys and values: the eager step rewrites them
        # with the same values (they depend only on the inputs), so nothing cached goes wrong.
        return self._compiled_or_eager(lambda: run(self.kernels), lambda: run(EAGER))

    def _compiled_or_eager(self, compiled: Callable[[], T], eager: Callable[[], T]) -> T:
        """``compiled()``, or ``eager()`` once compiling has failed (then for the rest of the run)."""
        if self.kernels.compiled:
            try:
                return compiled()
            except Exception as error:  # no triton, a compiler error: a slower run, never a failed one
                if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise  # the capture is broken: _graph retries it eagerly
                self._disable_compile(error)
        return eager()

    def _disable_compile(self, error: Exception) -> None:
        message = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        logger.warning("engine: torch.compile failed (%s: %s); decoding without it", type(error).__name__, message)
        self.kernels = EAGER
        self._sample_untruncated = sample_untruncated

    def _graph(self, batch: int, key_len: int) -> DecodeGraph:
        key = (batch, key_len)

        def capture() -> DecodeGraph:
            return DecodeGraph(lambda tokens, positions: self._decode_logits(tokens, positions, key_len), batch,
                               self.cache.capacity, self.device, self._graph_pool)

        if key not in self._graphs:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            try:
                self._graphs[key] = capture()
            except Exception as error:
                if not self.kernels.compiled:
                    raise
                # Compiled kernels that cannot be captured: capture the eager ones instead (in a fresh pool,
                # since the broken capture may have left allocations in the old one).
                self._disable_compile(error)
                self._graphs.clear()
                self._graph_pool = torch.cuda.graph_pool_handle()
                self._graphs[key] = capture()
        return self._graphs[key]

    def _sample(self, rows: np.ndarray, rows_t: torch.Tensor | None, logits: torch.Tensor) -> _Launched:
        """Launch sampling a token for each of ``rows`` from ``logits``, Shape (n, vocab); :meth:`_read` takes
        the tokens.

        ``rows_t`` is ``rows`` on the device, or None when they are ``0 .. n-1``.
        """
        n = len(rows)
        pick: Callable[[torch.Tensor], torch.Tensor] = (lambda t: t[:n]) if rows_t is None else (lambda t: t[rows_t])
        temperature = pick(self._temperature)
        logits = logits[:, : self.vocab_limit]  # a view: rows stay contiguous in the vocabulary dim
        if self._suppressed is not None:
            suppressed_logits = logits.index_select(1, self._suppressed)  # a copy: kept for the logprobs
            # index_fill_, not `logits[:, ids] = -inf`: that assignment copies its value to the GPU from pageable
            # memory, which waits for the decode step in flight, so the host could not prepare the next one.
            logits.index_fill_(1, self._suppressed, float("-inf"))
        if self._truncating[rows].any():
            tokens, logprobs = sample_tokens(logits, temperature, pick(self._top_k), pick(self._top_p))
        else:
            tokens, logprobs = self._sample_full(logits, temperature)
        if self._suppressed is not None:
            token_logits = logits.gather(1, tokens.view(-1, 1)).squeeze(1)
            logprobs = logprobs_before_suppression(logprobs, token_logits, suppressed_logits, temperature)
        self.timer.stop()
        if rows_t is None:
            self._next_tokens[:n] = tokens
        else:
            self._next_tokens[rows_t] = tokens
        # The step's one copy to the host: tokens and logprobs together.
        sampled = self._sampled[self._turn][: 2 * n].view(2, n)
        sampled.copy_(torch.stack((tokens.double(), logprobs.double())), non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self._turn ^= 1
        self._in_flight[rows] += 1
        return _Launched(rows, sampled, done)

    def _read(self, launched: _Launched) -> None:
        """Wait for a launched sampling's tokens (the step's one wait for the device), record them, and end the
        sequences they finish; rows that finished since the launch are skipped."""
        if launched.done is not None:
            launched.done.synchronize()
        self._in_flight[launched.rows] -= 1
        alive = self._live[launched.rows]
        sampled = launched.sampled.numpy()
        rows = launched.rows
        if not alive.all():
            rows, sampled = rows[alive], sampled[:, alive]
        if not len(rows):
            return
        new_tokens = sampled[0].astype(np.int64)
        checks = self.state.record(rows, new_tokens, sampled[1].astype(np.float32))
        self.stats.generated_tokens += len(rows)
        stopped = checks.stop_id.copy()
        for i in np.flatnonzero(checks.search & ~stopped).tolist():
            stopped[i] = self._stop_string_found(int(rows[i]))
        for i in np.flatnonzero(stopped | checks.spent).tolist():
            self._finish(int(rows[i]), "stop" if stopped[i] else "length")

    def _sample_full(self, logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~turnrl.engine.sampling.sample_untruncated` through the Triton kernel, compiled, or eager."""
        if self.triton:
            return sample_two_pass(logits, temperature)
        return self._compiled_or_eager(lambda: self._sample_untruncated(logits, temperature),
                                       lambda: sample_untruncated(logits, temperature))

    def _stop_string_found(self, row: int) -> bool:
        """Whether the row's generated text now holds one of its stop strings (after a token that can end one)."""
        stop_strings = self.running[row].params.stop_strings
        assert self.decode is not None  # rows are searched only where a decode was given
        tail = self.state.tail(row, max(len(s) for s in stop_strings) + TAIL_SLACK_TOKENS)
        return stop_string_in_tail(tail, stop_strings, self.decode)

    def _finish(self, row: int, reason: str) -> None:
        sequence = self.running.pop(row)
        self._live[row] = False
        generated, logprobs = self.state.generated(row)
        # The row holds the keys and values of its ``cached`` tokens: all but the last sampled one, or all of them
        # when the next step was launched before this one's tokens were read.
        self._release_row(row, (sequence.keys + generated)[: int(self.state.cached[row])])
        self._running_rows = None
        self.finished.append(Result(sequence.id, generated, logprobs, reason, reused_tokens=sequence.reused))

