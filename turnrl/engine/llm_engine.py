"""Continuous batching over a KV cache that outlives each request.

One :meth:`Engine.step` admits waiting sequences into free cache rows (a prompt
that extends a row's cached tokens prefills only the new ones), prefills them,
then decodes one token for every running sequence. A finished sequence leaves
its row at once and a waiting one takes it: no sequence waits for a batch to
end (arrivals are admitted together, after a few decode steps at most, and wait
for pages that running sequences hold). The cache is a budget of pages (``EngineConfig.kv_cache_gb``;
:mod:`turnrl.engine.cache`) that rows take as their sequences need them.

Two parts do the work, as nano-vllm keeps them apart: the
:class:`~turnrl.engine.scheduler.Scheduler` decides what runs next (admission,
pages and eviction, prefill chunks, which rows decode, when a sequence ends)
and runs no model; the :class:`~turnrl.engine.model_runner.ModelRunner` runs
it (model inputs, a VLM's images, the forward passes, CUDA graphs,
sampling). :class:`Engine` passes the one's plans to the other and the
sampled tokens back, and keeps the weights current.

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
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from turnrl.config import EngineConfig
from turnrl.engine.cache import KVCache
from turnrl.engine.forward import DecoderKernels
from turnrl.engine.images import KeptFeatures
from turnrl.engine.model_runner import Launched, ModelRunner, kv_cache_for
from turnrl.engine.rows import RowTable
from turnrl.engine.scheduler import Scheduler
from turnrl.engine.sequences import EngineStats, Result, SamplingParams, SequenceRecord
from turnrl.engine.timing import DeviceTimer
from turnrl.engine.weights import DecoderWeights, ImageFeatures, WeightsChecksum, decoder_weights
from turnrl.models.throughput import decode_bytes, key_value_bytes, prefill_flops

__all__ = ["Engine", "EngineStats", "Result", "SamplingParams", "weights_version"]


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
        vocab_limit: the LM head's rows that are tokens (the tokenizer's); None: all of them.
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
        self.cache: KVCache = kv_cache_for(self.weights, config, self.dtype, self.device)
        """Pages of keys and values: the scheduler gives rows their pages, the runner reads and writes them."""
        self._stats = EngineStats()
        self.scheduler = Scheduler(self.cache, config.max_seq_len, config.prefill_chunk_tokens, self._stats,
                                   self.weights.shape.vocab_size, decode)
        self.runner = ModelRunner(self.weights, self.cache, config, self._stats, vocab_limit)
        self._version = weights_version(model)
        self._launched: Launched | None = None
        """The decode step whose tokens the host reads during the next step's decode."""
        self._prefilled: Launched | None = None
        """The last prefill chunk of :meth:`prefill_waiting`, read by the next call into the engine."""

    # ------------------------------------------------------------------ what callers read
    @property
    def rows(self) -> int:
        return self.cache.rows

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @stats.setter
    def stats(self, stats: EngineStats) -> None:
        """Count from ``stats`` on (a benchmark's fresh counters)."""
        self._stats = self.scheduler.stats = self.runner.stats = stats

    @property
    def table(self) -> RowTable:
        return self.scheduler.table

    @property
    def waiting(self) -> deque[SequenceRecord]:
        return self.scheduler.waiting

    @property
    def running(self) -> dict[int, SequenceRecord]:
        return self.scheduler.running

    @property
    def timer(self) -> DeviceTimer:
        return self.runner.timer

    def device_work(self) -> dict[str, float]:
        """The device's side of the counters, summed since the engine started: seconds of prefill and decode work
        while the timer was on (CUDA events; wall time on a CPU), and what a roofline of that work counts:
        prefill's model FLOPs (the decoder's over the prefilled tokens, and the vision tower's over the images it
        encoded while the timer was on, also apart) and the bytes the decode steps had to read (the weights once a
        step, each row's cached keys and values once a step). Work over a peak (:mod:`turnrl.models.throughput`)
        and the seconds is a phase's share of the hardware's limit."""
        self.timer.collect()
        shape, stats = self.weights.shape, self.stats
        decoder = prefill_flops(self.weights.layer_parameters(), shape.num_layers, shape.num_heads * shape.head_dim,
                                stats.prefill_tokens, stats.prefill_attention_pairs)
        token_bytes = key_value_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, self.dtype.itemsize)
        return {
            "prefill_device_s": self.timer.seconds["prefill"],
            "decode_device_s": self.timer.seconds["decode"],
            "prefill_flops": decoder + self.timer.vision_flops,
            "decode_bytes": decode_bytes(self.weights.decode_bytes(), stats.decode_steps, token_bytes,
                                         stats.decode_key_tokens),
            "vision_flops": self.timer.vision_flops,
            "images_encoded": float(self.timer.images),
        }

    @property
    def kernels(self) -> DecoderKernels:
        return self.runner.kernels

    @property
    def use_graphs(self) -> bool:
        return self.runner.use_graphs

    @property
    def triton(self) -> bool:
        return self.runner.triton

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], params: SamplingParams, model_inputs: dict[str, Any] | None = None,
               image_digests: Sequence[int] | None = None) -> int:
        """Queue a prompt; its :class:`Result` comes out of a later :meth:`step`.

        ``model_inputs``: a VLM prompt's images (``pixel_values``, ``image_grid_thw``, as its processor makes them),
        one per run of image placeholders in ``prompt``; ``image_digests``: theirs, as the image encoder made them
        (None: hashed from the pixel values; see :mod:`turnrl.engine.images`).
        """
        sequence = SequenceRecord(self.scheduler.new_id(), list(prompt), params)
        sequence.images, error = self.runner.read_prompt(sequence.prompt, model_inputs, image_digests)
        self.scheduler.add(sequence, error)
        return sequence.id

    @torch.no_grad()
    def generate(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[Result]:
        """Run ``prompts`` to completion; results in prompt order.

        Raises:
            ValueError: ``params`` is not one setting a prompt (a pairing cut short would drop prompts unseen).
        """
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts and {len(params)} sampling settings; give one setting a prompt")
        ids = [self.submit(prompt, p) for prompt, p in zip(prompts, params)]
        results: dict[int, Result] = {}
        while not all(i in results for i in ids):  # others' results may come out too: not counted
            for result in self.step():
                results[result.id] = result
        self.timer.collect()  # the spans still pending (none unless the timer is on)
        return [results[i] for i in ids]

    def abort(self, reason: str) -> list[Result]:
        """End every waiting and running sequence with an error (after a failed step); rows are freed."""
        self._launched = self._prefilled = None
        return self.scheduler.abort(reason)

    def sync_weights(self) -> None:
        """Pick up changed weights: recompute merged/cast buffers and forget cached keys and values."""
        version = weights_version(self.model)
        if version != self._version:
            if self.scheduler.running:
                raise RuntimeError("the weights changed while sequences were generating")
            self.weights.refresh()
            self.scheduler.drop_idle_rows()
            if self.runner.kept_images is not None:
                self.runner.kept_images.take()  # features of the old weights: never handed out as the new ones'
            self._version = version

    def weights_checksum(self) -> WeightsChecksum:
        """The checksum of a few of the weights the next generation computes with (:meth:`sync_weights` first,
        as a generation does): merged LoRA adapters, casts and fused projections as the engine holds them.

        Raises:
            RuntimeError: sequences are generating (the weights may not change under them).
        """
        if self.scheduler.running:
            raise RuntimeError("the engine's weights are checked between generations only; sequences are generating")
        self.sync_weights()
        return self.weights.checksum()

    def keep_image_features(self) -> bool:
        """From now on, keep a host copy of the features of every image a prefill encodes, for
        :meth:`take_image_features` (a training step with a frozen vision tower reuses them); returns whether
        this engine runs images at all (a text model keeps nothing)."""
        if self.weights.vision is None:
            return False
        if self.runner.kept_images is None:
            self.runner.kept_images = KeptFeatures()
        return True

    def take_image_features(self) -> dict[int, ImageFeatures]:
        """The features of the images encoded since the last call (or since the weights last changed), by digest
        (:mod:`turnrl.engine.images`), in host memory; empty unless :meth:`keep_image_features` was called."""
        kept = self.runner.kept_images
        return kept.take() if kept is not None else {}

    def release_memory(self) -> None:
        """Free the key/value cache, the CUDA graphs captured on it and the computed weights (stacked
        projections, casts, merged adapters) between generations, for a training update to use: the next
        generation computes the weights again and allocates the cache as its sequences need. The model's own
        parameters are left alone.

        Raises:
            RuntimeError: sequences are generating or waiting.
        """
        in_flight = self._launched is not None or self._prefilled is not None
        if self.scheduler.running or self.scheduler.waiting or in_flight:
            raise RuntimeError("the engine frees its memory between generations only; sequences are generating")
        self.scheduler.drop_idle_rows()
        self.cache.release()
        self.runner.drop_graphs()
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
        with self._own_precision():
            self._read_prefilled()
            admitting = self.scheduler.time_to_admit()
            # Rows and pages change hands, and the cache grows (dropping the graphs), only with no step in flight.
            if self._launched is not None and admitting:
                self._read(self._launched)
                self._launched = None
            if not self.scheduler.running:
                self.sync_weights()
            if admitting:
                self._admit_and_prefill()
            launched = self._decode()
            if self._launched is not None:
                self._read(self._launched)
            if launched is not None and not self.scheduler.running:
                # With no sequence left, the step just launched decoded only finished rows: nothing to read.
                self.scheduler.drop_launch(launched.rows)
                launched = None
            self._launched = launched
        self.timer.collect(wait=False)
        return self.scheduler.take_finished()

    @torch.no_grad()
    def prefill_waiting(self) -> None:
        """Admit and prefill the waiting sequences, decoding nothing, and return without waiting for the device:
        the last chunk's tokens are read by the next call into the engine. A caller that queues a round of
        requests in parts lets the device prefill one part while it builds the next, and starts decoding (with
        :meth:`step`) once every part is in, so that decode steps run the whole round's batch."""
        with self._own_precision():
            if self._launched is not None:  # a decode step in flight: its tokens first, as a step admitting does
                self._read(self._launched)
                self._launched = None
            if not self.scheduler.running:
                self.sync_weights()
            if self.scheduler.waiting:
                self._admit_and_prefill(read_last=False)
        self.timer.collect(wait=False)

    def _own_precision(self) -> contextlib.AbstractContextManager:
        """The engine computes in its own dtype: a caller's autocast is switched off (entering the context only
        when one is on: it costs more than the rest of a step's host work)."""
        if torch.is_autocast_enabled(self.device.type):
            return torch.autocast(self.device.type, enabled=False)
        return contextlib.nullcontext()

    def _read_prefilled(self) -> None:
        if self._prefilled is not None:
            self._read(self._prefilled)
            self._prefilled = None

    def _admit_and_prefill(self, read_last: bool = True) -> None:
        """Admit what fits, then run each sequence's uncached prompt tokens, in chunks of at most
        ``prefill_chunk_tokens`` padded tokens.

        A chunk's sampled tokens are read after the next chunk is launched, so that the host builds and launches
        a chunk while the GPU runs the one before, instead of the GPU waiting for the host's part of every chunk
        (two chunks at most in flight: the sampled-token buffers are two). Without ``read_last`` the last chunk is
        left in flight (:meth:`prefill_waiting`); a chunk left so by the call before is read after this call's
        first launch."""
        admitted = self.scheduler.admit()
        self.runner.sync_cache()
        if not admitted:
            return
        self.runner.start_rows(admitted)
        previous, self._prefilled = self._prefilled, None
        for chunk in self.scheduler.prefill_plan(admitted):
            launched = self.runner.prefill(chunk)
            self.scheduler.prefilled(chunk)
            self.scheduler.launched(launched.rows)
            if previous is not None:
                self._read(previous)
            previous = launched
        if previous is not None and read_last:
            self._read(previous)
        else:
            self._prefilled = previous

    def _decode(self) -> Launched | None:
        """Launch one token for every running sequence that may still generate one (None if none may)."""
        batch = self.scheduler.decode_batch()
        if batch is None:
            return None
        launched = self.runner.decode(batch)
        self.scheduler.launched(launched.rows)
        return launched

    def _read(self, launched: Launched) -> None:
        self.scheduler.record(launched.rows, self.runner.read(launched))
