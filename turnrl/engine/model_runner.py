"""How a planned step runs: the model inputs of a prefill call or a decode step (a VLM's images among them), the
forward pass over the paged key/value cache, CUDA graphs, and sampling.

On a GPU, decode runs as CUDA graphs captured per batch bucket, and so do small prefill calls (per bucket of
sequences and new tokens), of layer functions compiled by ``torch.compile`` (their elementwise work fused into a
few kernels; compiled once for every bucket and layer, and once for prefill calls), with attention in one Triton
kernel that reads each row only as far as its sequence goes (:mod:`turnrl.engine.attention`); on a CPU, the same
code runs eagerly with torch's attention. A compilation that fails falls back to eager work with a warning.

A VLM's prompts' images go through the model's own vision tower at prefill (Qwen3-VL's deepstack features added
to its first layers' outputs there), and its tokens turn by their M-RoPE positions.

Each row's next input token stays on the device where it was sampled, and a launch copies its sampled tokens and
logprobs to the host once, without waiting (:class:`Launched`); :meth:`ModelRunner.read` waits for them. What runs
when, and what the tokens mean for their sequences, is the :class:`~turnrl.engine.scheduler.Scheduler`'s.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

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
from turnrl.engine.images import KeptFeatures, PromptImages, prompt_images
from turnrl.engine.sampler_kernels import sample_two_pass
from turnrl.engine.sampling import logprobs_before_suppression, sample_tokens, sample_untruncated
from turnrl.engine.scheduler import DecodeBatch, PrefillChunk
from turnrl.engine.sequences import EngineStats, SequenceRecord
from turnrl.engine.timing import DeviceTimer, causal_pairs
from turnrl.engine.weights import DecoderWeights
from turnrl.models.devices import cat_to_device, to_device

logger = logging.getLogger(__name__)
T = TypeVar("T")

PREFILL_GRAPH_TOKENS = 8192
"""Prefill calls of at most this many padded tokens (sequences and new tokens in power-of-two buckets) replay CUDA
graphs: launching a prefill's layers from Python cost about 25 ms a call on an H100 whatever its size, which
turns that prefill a few arrivals at a time paid dearly. Larger calls keep the device busy longer than their
launches take."""


@dataclass
class Launched:
    """A sampling launched on the device whose tokens the host has not read yet."""

    rows: np.ndarray
    """The rows sampled, Shape (n,)."""
    sampled: torch.Tensor
    """Tokens and logprobs, Shape (2, n) float64, on the host (pinned on a GPU); filled when ``done`` is."""
    done: torch.cuda.Event | None
    """Recorded after the copy to the host; None on a CPU (the copy is synchronous)."""


def bucket(value: int, buckets: Sequence[int]) -> int:
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


def kv_cache_for(weights: DecoderWeights, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> KVCache:
    """The key/value cache of ``config.max_rows`` rows within the budget (:func:`cache_budget_bytes`), its scratch
    page allocated."""
    token_bytes = KVCache.bytes_per_token(weights.shape.key_width, dtype)
    pages = KVCache.pages_in(cache_budget_bytes(config, device), token_bytes)
    # At least one sequence of max_len, whatever the budget (as a cache of rows held one row at least).
    pages = max(pages, pages_for(config.max_seq_len) + 1)
    cache = KVCache(weights.shape, config.max_rows, config.max_seq_len, pages, dtype, device)
    cache.reserve_scratch()
    return cache


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


class ModelRunner:
    """Runs prefill calls and decode steps of a decoder's weights over a paged cache, and samples; called under
    ``torch.no_grad`` (as :meth:`~turnrl.engine.llm_engine.Engine.step` runs it).

    Args:
        weights: the model's weights as the engine reads them (:mod:`turnrl.engine.weights`).
        cache: the key/value cache (:func:`kv_cache_for`); its rows are the sampling settings' rows.
        config: CUDA graphs, compilation, Triton kernels, the longest sequence.
        stats: the counters it adds its prefill and decode work to.
        vocab_limit: the LM head's rows that are tokens (None: all of them).
    """

    def __init__(self, weights: DecoderWeights, cache: KVCache, config: EngineConfig, stats: EngineStats,
                 vocab_limit: int | None = None) -> None:
        self.weights = weights
        self.cache = cache
        self.stats = stats
        self.device = device = cache.device
        rows = cache.rows
        self.rope = rotary_table(weights, cache.capacity + 1, device)  # scratch position too
        self._batch_buckets = sorted({min(2**i, rows) for i in range(20) if 2 ** (i - 1) < rows} | {rows})
        # Key lengths in steps of 256: decode reads every key position up to the bucket, so a coarser
        # bucket wastes reads (512 + 256 tokens in a 1,024 bucket read a third more than needed).
        self._key_buckets = sorted({min(256 * i, cache.capacity) for i in range(1, config.max_seq_len // 256 + 2)})
        self._next_tokens = torch.zeros(rows, dtype=torch.long, device=device)
        """Each running row's last sampled token, the input of its next decode step, Shape (rows,)."""
        self._temperature = torch.ones(rows, dtype=torch.float32, device=device)
        self._top_k = torch.zeros(rows, dtype=torch.long, device=device)
        self._top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self._truncating = np.zeros(rows, dtype=bool)
        """Rows whose sequence samples with top-k or top-p."""
        pinned = device.type == "cuda"
        # Positions are built on the host and copied in one transfer (from pinned memory on a GPU: no stall).
        # Two of each host buffer, used in turn: a step fills one while the previous step's may still be copied.
        self._positions = [torch.zeros(rows, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        # Flat, so that a step's (2, n) view is contiguous: a copy into a strided view waits for the device.
        self._sampled = [torch.zeros(2 * rows, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        self._turn = 0
        self._rows_on_device: tuple[np.ndarray, torch.Tensor | None] | None = None
        """The last decode rows sent, and the same on the device (None while they are 0 .. n-1)."""
        self.timer = DeviceTimer(device)
        """Device time of prefill and decode work, when enabled (a policy's rollouts and benchmarks split their
        time with it)."""
        self._graphs: dict[tuple[int, int], DecodeGraph] = {}
        self._prefill_graphs: dict[tuple[int, int], PrefillGraph] = {}
        self._graph_pool: Any = None
        self.use_graphs = config.cuda_graphs and device.type == "cuda"
        self.triton = triton_enabled(config.triton, device)
        """Attention and sampling in Triton kernels (:mod:`turnrl.engine.attention`,
        :mod:`turnrl.engine.cache_write`, :mod:`turnrl.engine.sampler_kernels`)."""
        vision = weights.vision
        self.graph_prefill = self.use_graphs and self.triton and vision is None
        """Small prefill calls replay CUDA graphs (:data:`PREFILL_GRAPH_TOKENS`); the Triton attention reads each row
        to its own length, so a graph needs no key-length bucket. (A VLM's prefill, with images and 3D positions,
        runs without.)"""
        self._rope_delta = torch.zeros(rows, dtype=torch.long, device=device)
        """A VLM's rows: a generated token at index i turns by M-RoPE position i + delta (0 for text)."""
        self.kept_images: KeptFeatures | None = None
        """Where a VLM's prefill keeps a host copy of every image's features (the trainer's step reuses them), or
        None (the default): not kept."""
        self._suppressed = (torch.tensor(vision.special_token_ids, device=device)
                            if vision is not None and vision.special_token_ids else None)
        """Tokens never sampled (a VLM's image placeholders and vision markers), or None."""
        head_rows = weights.shape.vocab_size
        self.vocab_limit = head_rows if vocab_limit is None else min(vocab_limit, head_rows)
        """The LM head's rows that are tokens (the tokenizer's): the rows past it are no token, never sampled,
        and out of the log-probs' normalizer, as in the trainer."""
        self.kernels: DecoderKernels = EAGER
        self._sample_untruncated: Callable[..., tuple[torch.Tensor, torch.Tensor]] = sample_untruncated
        if compile_enabled(config.compile, device):
            self.kernels = compiled_kernels()
            self._sample_untruncated = DynamicCompiled(sample_untruncated, {0: (0,), 1: (0,)})

    # ------------------------------------------------------------------ inputs
    def read_prompt(self, prompt: list[int], model_inputs: dict[str, Any] | None,
                    image_digests: Sequence[int] | None) -> tuple[PromptImages | None, str | None]:
        """A prompt's images as the model takes them (None for text), or why the model cannot run the prompt.

        ``model_inputs``: a VLM prompt's images (``pixel_values``, ``image_grid_thw``, as its processor makes them),
        one per run of image placeholders in ``prompt``; ``image_digests``: theirs, as the image encoder made them
        (None: hashed from the pixel values; see :mod:`turnrl.engine.images`).
        """
        vision = self.weights.vision
        images = None
        if vision is not None:
            if vision.video_token_id in prompt or (model_inputs or {}).get("pixel_values_videos") is not None:
                return None, "the engine runs images, not videos: use model.backend=hf for a prompt with a video"
            try:
                images = prompt_images(prompt, model_inputs, vision.image_token_id, vision.merge_size, image_digests)
            except ValueError as invalid:
                return None, str(invalid)
            width = vision.patch_width()
            for index, pixels in enumerate(images.pixel_values):
                # Caught here, alone: in the batch's tower call it would fail every sequence of the prefill.
                if pixels.dim() != 2 or pixels.shape[1] != width or not pixels.is_floating_point():
                    return None, (f"image {index}'s pixel_values are {tuple(pixels.shape)} {pixels.dtype}; this "
                                  f"model's patches are rows of {width} floats: make them with its own processor")
        elif model_inputs and model_inputs.get("pixel_values") is not None:
            return None, "this model takes no images (a text model); send the prompt without them"
        vocab = len(self.weights.embed.value)
        if prompt and (min(prompt) < 0 or max(prompt) >= vocab):
            # Caught here, alone: in the batch's forward pass it would fail every sequence (on a GPU, the process).
            outside = next(token for token in prompt if not 0 <= token < vocab)
            return images, (f"the prompt holds token id {outside}, outside the model's {vocab} embeddings (a "
                            "tokenizer that does not match the model, or tokens added to it without resizing the "
                            "embeddings)")
        return images, None

    def start_rows(self, sequences: list[SequenceRecord]) -> None:
        """Set the rows' sampling settings (and a VLM's rotary deltas) for the sequences that take them."""
        for sequence in sequences:
            self._truncating[sequence.row] = sequence.params.top_k > 0 or sequence.params.top_p < 1.0
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

    def sync_cache(self) -> None:
        """Bring the device up to the cache's page accounting after rows took and gave pages: graphs captured on a
        pool that grew are dropped, and the page table is copied. Called only where no step is in flight (a copy
        from pageable memory would wait for one); between calls the table may still show pages that finished
        sequences gave back: only rows not running read those (their output is discarded)."""
        if self.cache.grown:
            self.cache.grown = False
            self.drop_graphs()
        self.cache.sync()

    def drop_graphs(self) -> None:
        """Forget every CUDA graph, and their memory pool with them (the cache's tensors they were captured on are
        gone)."""
        self._graphs.clear()
        self._prefill_graphs.clear()
        self._graph_pool = None

    # ------------------------------------------------------------------ prefill
    def prefill(self, chunk: PrefillChunk) -> Launched:
        """Launch a chunk's prefill and the sampling of each sequence's first token (:meth:`read` takes them); the
        followers copy their leader's keys and values and sample from its logits."""
        sequences, followers = chunk.sequences, chunk.followers
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
            key_len = self.key_len(max(len(s.prompt) for s in sequences))
            logits = self._prefill_logits(tokens_t, positions_t, write_t, rows_t, last_t, key_len, rope=rope,
                                          rope_positions=rope_positions, embeddings=embeddings, deepstack=deepstack)
        self.stats.prefill_tokens += sum(len(n) for n in news)
        self.stats.prefill_calls += 1
        self.stats.prefill_attention_pairs += sum(causal_pairs(start, len(n)) for start, n in zip(starts, news))
        if followers:
            leaders = np.array([i for i, _ in followers], dtype=np.int64)
            copies = np.array([f.row for _, f in followers], dtype=np.int64)
            self.cache.copy_rows(rows[leaders], copies, max(len(f.prompt) for _, f in followers))
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

    def _vlm_prefill_inputs(self, sequences: list[SequenceRecord], tokens: torch.Tensor
                            ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor, Deepstack | None]:
        """A VLM prefill's rotary rows, the rows each token takes, input embeddings with the images in them, and the
        images' deepstack features (Qwen3-VL; None for other VLMs and calls without image tokens).

        Each new token turns by its own M-RoPE position (three axes; :func:`~turnrl.models.mrope.mrope_positions`),
        so the call gets its own table: one cos/sin row per token, Shape (b * t, D), and rope positions
        ``0 .. b*t-1``. The images whose placeholders are among the new tokens run through the vision tower, and
        their features replace those placeholders' embeddings (their deepstack features go to the same tokens);
        :attr:`kept_images`, where set, keeps a copy of them.

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
        digests: list[int] = []
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
                digests.append(images.keys[begin])
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
            if self.timer.enabled:  # a few host operations on the grids (the tower's weights are walked once)
                self.timer.encoded(len(grids), vision.forward_flops(encoded))
            features = vision.features(cat_to_device(pixels, self.device), encoded)
            if self.kept_images is not None:
                self.kept_images.keep(digests, (encoded.prod(-1) // vision.merge_size**2).tolist(), features)
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


    # ------------------------------------------------------------------ decode
    def decode(self, batch: DecodeBatch) -> Launched:
        """Launch one token for each of the batch's rows; rows ``0 .. B-1`` are computed, those not in the batch
        write to scratch."""
        rows = batch.rows
        rows_t = self._on_device(rows)
        # Graphs replay fixed shapes, so a graphed step pads the batch and the keys to buckets.
        top = int(rows[-1]) + 1
        size = bucket(top, self._batch_buckets) if self.use_graphs else top
        cached = batch.positions
        key_len = self.key_len(int(cached.max()) + 1, graphed=self.use_graphs)
        host_positions = self._positions[self._turn]
        positions = host_positions.numpy()
        positions[:size] = self.cache.capacity  # rows not running write to scratch
        positions[rows] = cached
        self.timer.start("decode")
        positions_t = host_positions[:size].to(self.device, non_blocking=True)
        tokens_t = self._next_tokens[:size]
        if self.use_graphs:
            logits = self.decode_graph(size, key_len).run(tokens_t, positions_t)
        else:
            logits = self.decode_logits(tokens_t, positions_t, key_len)
        self.stats.decode_steps += 1
        self.stats.decode_key_tokens += int(cached.sum()) + len(rows)  # each row's keys up to its new token
        return self._sample(rows, rows_t, logits[rows_t] if rows_t is not None else logits[: len(rows)])

    def _on_device(self, rows: np.ndarray) -> torch.Tensor | None:
        """``rows`` on the device, or None while they are ``0 .. n-1`` (which slicing serves); the copy is kept
        while the scheduler hands out the same array (its running rows, until a sequence starts or finishes)."""
        if self._rows_on_device is None or self._rows_on_device[0] is not rows:
            dense = bool(rows[-1] == len(rows) - 1)
            self._rows_on_device = rows, None if dense else to_device(rows, self.device)
        return self._rows_on_device[1]

    def key_len(self, length: int, graphed: bool = False) -> int:
        """Key positions attended for sequences of at most ``length`` tokens, within the capacity: a bucket for
        a CUDA graph (a graph replays fixed shapes), else ``length`` rounded up to aligned rows (the positions
        past a sequence are masked). The Triton kernel reads each row to its own length whatever this is: its
        graphs are captured per batch bucket alone, at the capacity."""
        if self.triton:
            return self.cache.capacity
        return min(bucket(length, self._key_buckets) if graphed else round_up(length), self.cache.capacity)

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> torch.Tensor:
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
                    raise  # the capture is broken: decode_graph retries it eagerly
                self._disable_compile(error)
        return eager()

    def _disable_compile(self, error: Exception) -> None:
        message = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        logger.warning("engine: torch.compile failed (%s: %s); decoding without it", type(error).__name__, message)
        self.kernels = EAGER
        self._sample_untruncated = sample_untruncated

    def decode_graph(self, batch: int, key_len: int) -> DecodeGraph:
        """The CUDA graph of a decode step of ``batch`` rows attending ``key_len`` positions, captured on first
        use."""
        key = (batch, key_len)

        def capture() -> DecodeGraph:
            return DecodeGraph(lambda tokens, positions: self.decode_logits(tokens, positions, key_len), batch,
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

    # ------------------------------------------------------------------ sampling
    def _sample(self, rows: np.ndarray, rows_t: torch.Tensor | None, logits: torch.Tensor) -> Launched:
        """Launch sampling a token for each of ``rows`` from ``logits``, Shape (n, vocab); :meth:`read` takes
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
            tokens, logprobs = self.sample_full(logits, temperature)
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
        return Launched(rows, sampled, done)

    def sample_full(self, logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~turnrl.engine.sampling.sample_untruncated` through the Triton kernel, compiled, or eager."""
        if self.triton:
            return sample_two_pass(logits, temperature)
        return self._compiled_or_eager(lambda: self._sample_untruncated(logits, temperature),
                                       lambda: sample_untruncated(logits, temperature))

    @staticmethod
    def read(launched: Launched) -> np.ndarray:
        """Wait for a launched sampling's tokens (a step's one wait for the device): tokens and logprobs, Shape
        (2, n) float64, a view of a host buffer that a launch two calls later fills again."""
        if launched.done is not None:
            launched.done.synchronize()
        return launched.sampled.numpy()
