"""Whether a run fits its GPUs: an estimate of each GPU's memory by part, checked before the models load.

A run that cannot fit should say so in seconds, with what to turn on, rather than after minutes of loading
and a first rollout, in an out-of-memory traceback. The estimate counts what the trainer holds (see
:mod:`turnrl.training.trainer` and :mod:`turnrl.training.parallel.fsdp2`):

    actor, critic     float32 weights, gradients and AdamW's two moments (16 bytes a trained parameter,
                      4 a frozen one), divided among the processes under FSDP, on the host with
                      ``distributed.cpu_offload``; under FSDP a frozen vision tower whole on every process,
                      in bf16 (2 bytes a parameter), offloaded or not. Under LoRA the actor trains its adapters
                      beside its whole frozen base; the critic trains all its weights, LoRA or not
    reference         the compute dtype (2 bytes a parameter), sharded likewise (its tower whole)
    rollout weights   the engine's bf16 weights: under FSDP an unsharded copy of the actor plus the engine's
                      stacked q/k/v and gate/up buffers; in one process the engine's bf16 buffers of the
                      float32 actor (the ``hf`` backend reads the actor itself); with
                      ``distributed.async_rollout`` the rollout thread's bf16 copy of the actor and the
                      engine's stacked buffers (under LoRA a float32 copy and the engine's merged bf16
                      buffers; on ``distributed.rollout_device`` when set: then neither they nor the
                      key/value cache are on this GPU; the trainer's own engine, which only validates,
                      holds nothing between validations)
    staging           ``distributed.async_rollout``: the trained weights published for the rollout copy, in
                      its dtype
    gathered layers   FSDP's all-gathered layer and the one prefetched beside it
    key/value cache   ``model.engine.kv_cache_gb``; when 0, the engine's default (30% of what is free when
                      it starts) capped at what the update leaves free (:func:`default_cache_bytes`): a run
                      sets ``kv_cache_gb`` to it, since the engine starts before the optimizer's states exist
    activations       one micro-batch of the update, as autograd keeps it: with checkpointing every recomputed
                      layer's input (float32 in one process, where the residual stream stays float32 under
                      autocast; bf16 under FSDP) plus one layer's working set, and the whole set of each layer
                      that ``model.checkpointed_layers`` leaves out; without, every layer's working set (less
                      the norms' float32 copies under ``model.compile``); a trained vision tower's for the
                      micro-batch's images (at most every token an image token); plus the scoring head's
                      chunk; or one scoring pass of ``algorithm.score_micro_batch_tokens`` (one layer's working
                      set), whichever is larger
    weight casts      one process under mixed precision without checkpointing: the bf16 copy of each float32
                      weight that autocast makes for a forward pass and autograd keeps for its backward (with
                      checkpointing, of the layers ``model.checkpointed_layers`` leaves out)
                      (under FSDP the layers are gathered in bf16 and freed after their forward instead)
    rollback copy     ``algorithm.rollback_kl``: the copy of the actor's trained weights and AdamW's two moments
                      taken before each optimizer step (float32, this process's shards), held through the update

The SFT stage, which runs in one process, is checked on its own once its samples' lengths are known
(:func:`check_sft_memory`): the model's training states, one micro-batch and the weight casts.

With ``model.engine.free_during_update`` the rollout weights and the key/value cache are freed before the scores
and the update (on the trainers beside a pool of rollout processes, which sample only to validate, after each
validation), so they are never held with the gathered layers, the activations and the gradients (a quarter of
the trained parameters' states, freed after each optimizer step): the peak counts the larger of the two groups.

Parameters are counted on the ``meta`` device from the model's own config (no weights are read). The
activations are an approximation fitted to measured peaks (docs/benchmarks.md compares the estimate with the
measured peak of each scale row); the check fails only when the estimate exceeds the GPU's memory less the
allocator's margin (:func:`~turnrl.training.allocator.allocator_margin`: what a process holds outside torch's
allocator, and without expandable segments what the allocator holds but cannot hand out), and
``run.check_memory=false`` skips it.

A GPU run sets torch's allocator to expandable segments (``run.cuda_alloc_conf``) before CUDA starts, unless
``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) is set already:
:func:`~turnrl.training.allocator.set_allocator_settings`.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from turnrl.config import ConfigError
from turnrl.engine.cache import KVCache, pages_for
from turnrl.models.builtin import builtin_model_config
from turnrl.models.loading import VISION_TOWERS, check_checkpointed_layers, decoder_layers, load_model
from turnrl.training.allocator import CUDA_CONTEXT_BYTES, GIB, run_margin
from turnrl.training.kept_bytes import (
    ModelCounts,
    activation_bytes,
    kept_layer_cast_bytes,
    pass_bytes,
    scoring_activation_bytes,
    weight_cast_bytes,
)
from turnrl.training.train_config import TrainConfig

logger = logging.getLogger(__name__)

_STACKED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Projections the engine stacks into one buffer each (q/k/v, gate/up): a second copy under FSDP."""


ROLLOUT_ONLY = ("rollout weights", "key/value cache")
"""Parts that ``model.engine.free_during_update`` frees before the scores and the update."""
UPDATE_ONLY = ("gathered layers", "activations", "weight casts", "rollback copy")
"""Parts held only while scoring and updating."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes a GPU holds at the peak of a step, by part, and the GPU's memory."""

    parts: dict[str, float]
    device_bytes: float
    apart: bool = False
    """Whether the :data:`ROLLOUT_ONLY` parts are freed before the :data:`UPDATE_ONLY` ones and the gradients
    are held (``model.engine.free_during_update``): the peak holds the larger group only."""
    gradients: float = 0.0
    """The gradients within the actor's and critic's states: held only while updating."""
    margin: float = 0.0
    """Bytes of the GPU kept free of the estimate: the allocator's margin
    (:func:`~turnrl.training.allocator.allocator_margin`)."""

    def groups(self) -> tuple[float, float]:
        """The bytes held only while rolling out, and only while scoring and updating (the gradients too)."""
        rollout, update = (sum(self.parts.get(name, 0.0) for name in group) for group in (ROLLOUT_ONLY, UPDATE_ONLY))
        return rollout, update + self.gradients

    @property
    def total(self) -> float:
        if not self.apart:
            return sum(self.parts.values())
        rollout, update = self.groups()
        return sum(self.parts.values()) - rollout - update + max(rollout, update)

    def fits(self) -> bool:
        return self.total + self.margin <= self.device_bytes

    def table(self) -> str:
        """``actor 30.4 + critic 30.3 + ... = 92.1 GiB of 79.1 GiB``: the parts above 0.05 GiB; the groups that
        are never held together as ``max(..., ...)``."""
        def listed(names: list[str]) -> str:
            return " + ".join(f"{name} {self.parts[name] / GIB:.1f}" for name in names
                              if self.parts[name] >= 0.05 * GIB)

        if self.apart:
            rest = listed([name for name in self.parts if name not in ROLLOUT_ONLY + UPDATE_ONLY])
            rollout = listed([name for name in ROLLOUT_ONLY if name in self.parts]) or "0"
            update = listed([name for name in UPDATE_ONLY if name in self.parts])
            shown = (f"{rest} (gradients {self.gradients / GIB:.1f} of them while updating only) + "
                     f"max({rollout}; {update}{' + ' if update else ''}gradients {self.gradients / GIB:.1f})")
        else:
            shown = listed(list(self.parts))
        less = f" less a {self.margin / GIB:.1f} GiB allocator margin" if self.margin > 0 else ""
        return f"{shown} = {self.total / GIB:.1f} GiB of the GPU's {self.device_bytes / GIB:.1f} GiB{less}"


def _text_config(config: Any) -> Any:
    """The decoder's config of a causal LM or a VLM."""
    return config.text_config if getattr(config, "vision_config", None) is not None else config


def _lora_targets(target_modules: str) -> list[str] | None:
    """None for peft's ``all-linear``, else the listed module names."""
    return None if target_modules == "all-linear" else [name.strip() for name in target_modules.split(",")]


def count_model(path: Path | str, *, lora_rank: int = 0, lora_targets: str = "all-linear",
                train_vision: bool = False) -> ModelCounts:
    """Parameter counts of the model at ``path`` (a directory or hub id with a config), built on ``meta``.

    Args:
        lora_rank: above 0, the trained parameters are LoRA adapters of that rank on ``lora_targets`` (peft's
            ``all-linear``: every linear layer but the output head) of the decoder, and of the vision tower
            only when ``train_vision``.
    """
    model = load_model(path, device="meta")
    text = _text_config(model.config)
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    head = 0 if output is None or tied else output.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    tower = [p for name, m in model.named_modules() if name.split(".")[-1] in VISION_TOWERS for p in m.parameters()]
    frozen_tower = 0 if train_vision else sum(p.numel() for p in {id(p): p for p in tower}.values())
    stacked = 0
    key_width = 0
    adapters = 0
    targets = _lora_targets(lora_targets)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output:
            continue
        short = name.split(".")[-1]
        in_tower = any(part in VISION_TOWERS for part in name.split("."))
        if short in _STACKED and not in_tower:
            stacked += module.weight.numel()
        if short == "k_proj" and not in_tower:
            key_width += module.out_features
        if (targets is None or short in targets) and (train_vision or not in_tower):
            adapters += lora_rank * (module.in_features + module.out_features)
    trained = adapters if lora_rank > 0 else total - frozen_tower
    layers = decoder_layers(model)
    layer_params = sum(p.numel() for p in layers[0].parameters()) if layers else 0
    return ModelCounts(total=total, trained=trained, stacked=stacked, head=head, layers=text.num_hidden_layers,
                       hidden=text.hidden_size, intermediate=text.intermediate_size, vocab=text.vocab_size,
                       key_width=key_width, frozen_tower=frozen_tower, layer_params=layer_params,
                       **_tower_sizes(model.config) if tower else {})


def _tower_sizes(config: Any) -> dict[str, int]:
    """The :class:`ModelCounts` fields of a Qwen-VL vision tower, from the VLM's config."""
    vision = config.vision_config
    return {"tower_blocks": vision.depth, "tower_hidden": vision.hidden_size,
            "tower_intermediate": vision.intermediate_size,
            "patch_values": vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2,
            "patches_per_token": vision.spatial_merge_size ** 2}


def count_recipe_model(config: TrainConfig, path: Path | str | None = None) -> ModelCounts:
    """:func:`count_model` with the run's LoRA and tower settings, of the model at ``path``; without one, of
    ``model.path``, or of the built-in preset's config, made without building the model
    (:func:`~turnrl.models.builtin.builtin_model_config`)."""
    model = config.model

    def counted(source: Path | str) -> ModelCounts:
        return count_model(source, lora_rank=config.lora.r if config.lora.enabled else 0,
                           lora_targets=config.lora.target_modules, train_vision=model.train_vision)

    source = path if path is not None else model.path
    if source is not None:
        return counted(source)
    with tempfile.TemporaryDirectory() as folder:  # the preset's config, saved where count_model reads one
        builtin_model_config(model).save_pretrained(folder)
        return counted(folder)


def _training_states(trained: int, frozen: int, shards: int, offload: bool) -> float:
    """float32 weights, gradients and AdamW's two moments of the trained parameters; float32 frozen ones."""
    return 0.0 if offload else (16 * trained + 4 * frozen) / shards


def default_cache_bytes(parts: dict[str, float], device_bytes: float, apart: bool = False,
                        gradients: float = 0.0, margin: float = 0.0) -> float:
    """The key/value cache that ``model.engine.kv_cache_gb=0`` gets: the engine's own default (30% of the memory
    free when it starts: the weights are in place, the gradients and optimizer moments not yet), but no more
    than the update leaves free at its peak (95% of the GPU, or less the allocator's ``margin`` where that is
    more, less every other part), so that the optimizer's first step does not run out of memory where the
    cache took it; with ``apart`` (the cache freed during the update), no more than the rollout leaves free
    (the update's own parts and the ``gradients`` not counted)."""
    weights_only = {"actor": 0.25, "critic": 0.25}  # float32 weights: a quarter of the 16 bytes of states
    at_start = sum(value * weights_only.get(name, 1.0) for name, value in parts.items() if name not in UPDATE_ONLY)
    engine_default = 0.3 * max(0.0, device_bytes - at_start)
    held = sum(value for name, value in parts.items() if not (apart and name in UPDATE_ONLY)) - \
        (gradients if apart else 0.0)
    headroom = device_bytes - max(0.05 * device_bytes, margin) - held
    return max(0.0, min(engine_default, headroom))


def _pass_tokens(config: TrainConfig) -> int:
    """Tokens of one forward/backward pass of the update as the estimate counts them: the token budget, or
    ``micro_batch_size`` rows of ``model.engine.max_seq_len``."""
    algorithm = config.algorithm
    return algorithm.micro_batch_tokens or algorithm.micro_batch_size * config.model.engine.max_seq_len


def kept_layers(config: TrainConfig, counts: ModelCounts) -> int:
    """Decoder layers that keep their activations under checkpointing (``model.checkpointed_layers``): 0 when every
    layer is recomputed, or without checkpointing (where all keep them: :func:`activation_bytes` knows).

    Raises:
        ConfigError: ``model.checkpointed_layers`` exceeds the model's layers (as loading the model would).
    """
    checkpointed = config.model.checkpointed_layers
    if not config.model.gradient_checkpointing or checkpointed is None:
        return 0
    check_checkpointed_layers(checkpointed, counts.layers)
    return counts.layers - checkpointed


def _activations(config: TrainConfig, counts: ModelCounts, processes: int) -> float:
    """The activations part: one pass of the update, or one scoring pass of their own budget, the larger."""
    update = activation_bytes(counts, _pass_tokens(config), config.model.gradient_checkpointing, config.model.compile,
                              trains_head=not config.lora.enabled,
                              dtypes=pass_bytes(config, _sharded(config, processes)),
                              kept_layers=kept_layers(config, counts))
    return max(update, scoring_activation_bytes(counts, config.algorithm.score_micro_batch_tokens))


def _sharded(config: TrainConfig, processes: int) -> bool:
    """Whether the models are FSDP-sharded (several processes, or ``distributed.backend=fsdp`` on one)."""
    return processes > 1 or config.distributed.backend == "fsdp"


def estimate_memory(config: TrainConfig, counts: ModelCounts, processes: int, device_bytes: float,
                    margin: float = 0.0) -> MemoryEstimate:
    """Each GPU's estimated peak by part (see the module docs) for ``config`` on ``processes`` processes, against
    ``device_bytes`` less the allocator's ``margin``."""
    sharded = _sharded(config, processes)
    offload = sharded and config.distributed.cpu_offload
    lora = config.lora.enabled
    parts: dict[str, float] = {}
    tower = counts.frozen_tower if sharded else 0  # whole on each process, in bf16, even offloaded
    # LoRA's adapters come on top of the base, which is frozen whole; else only a frozen tower is.
    actor_frozen = counts.total if lora else counts.total - counts.trained
    parts["actor"] = _training_states(counts.trained, actor_frozen - tower, processes, offload) + 2 * tower
    trained = counts.trained
    critic_total = counts.total - counts.head + counts.hidden  # a value head in place of the LM head
    if config.algorithm.uses_critic:
        # The critic gets no adapters (the trainer adds them to the actor alone): all but a frozen tower trains.
        critic_trained = critic_total - counts.frozen_tower
        parts["critic"] = _training_states(critic_trained, critic_total - critic_trained - tower, processes,
                                           offload) + 2 * tower
        trained += critic_trained
    if config.algorithm.kl_coef > 0 and not lora:
        parts["reference"] = (0.0 if offload else 2 * (counts.total - tower) / processes) + 2 * tower
    engine = config.model.backend != "hf"
    dist = config.distributed
    rollout_thread = dist.async_rollout and dist.rollout_processes == 0
    # The rollout thread's copy holds bf16, or float32 under LoRA (the engine merges the adapters before its cast).
    copy_bytes = 4 if lora else 2
    if rollout_thread:
        parts["staging"] = copy_bytes * counts.trained  # the trained weights published for the rollout copy
        # The copy, its engine and their cache live on distributed.rollout_device when it is set.
        engine = engine and dist.rollout_device is None
    stacked = 2 * counts.stacked if engine and config.model.engine.fuse_projections else 0
    if sharded:
        parts["rollout weights"] = 2 * counts.total + stacked
        parts["gathered layers"] = 2 * 2 * counts.total / max(1, counts.layers)
    elif rollout_thread and dist.rollout_device is None:
        # The copy (bf16, read in place by the engine; under LoRA float32 beside the engine's merged bf16 buffers).
        parts["rollout weights"] = copy_bytes * counts.total + (2 * counts.total if lora else stacked)
    elif engine:
        parts["rollout weights"] = 2 * counts.total
    checkpointing = config.model.gradient_checkpointing
    parts["activations"] = _activations(config, counts, processes)
    if not sharded and config.model.dtype != "float32":
        if not checkpointing:
            # Actor and critic update one after the other: the larger model's casts (5.7 GiB at 3B).
            parts["weight casts"] = weight_cast_bytes(counts, critic_total if config.algorithm.uses_critic else 0)
        elif kept := kept_layers(config, counts):
            parts["weight casts"] = kept_layer_cast_bytes(counts, kept)
    if config.algorithm.rollback_kl is not None and not offload:
        parts["rollback copy"] = 12 * counts.trained / processes  # the trained weights (adapters under LoRA)
    # A pool's trainers sample only to validate: their rollout copy and engine are freed after each validation, as
    # free_during_update frees them before each update.
    apart = engine and (config.model.engine.free_during_update or dist.rollout_processes > 0)
    gradients = 0.0 if offload else 4 * trained / processes  # float32, divided as the states are
    if engine:
        kv_gb = config.model.engine.kv_cache_gb
        parts["key/value cache"] = kv_gb * GIB if kv_gb > 0 else default_cache_bytes(parts, device_bytes, apart,
                                                                                     gradients, margin)
    return MemoryEstimate(parts, device_bytes, apart, gradients, margin)


def full_length_sequences(config: TrainConfig, counts: ModelCounts, cache_bytes: float) -> int:
    """Sequences of ``model.engine.max_seq_len`` tokens that a key/value cache of ``cache_bytes`` holds at once
    (bf16 keys and values, in the engine's pages: :class:`~turnrl.engine.cache.KVCache`), at most
    ``model.engine.max_rows``; 0 when the model's key width is unknown. The fewest at once: a sequence takes the
    pages of its prompt and generation budget only, so shorter turns run more."""
    if counts.key_width == 0:
        return 0
    engine = config.model.engine
    pages = KVCache.pages_in(cache_bytes, KVCache.bytes_per_token(counts.key_width, torch.bfloat16))
    return max(1, min(engine.max_rows, (pages - 1) // pages_for(engine.max_seq_len)))


def rollout_in_waves(config: TrainConfig, counts: ModelCounts, estimate: MemoryEstimate,
                     processes: int) -> str | None:
    """A note when a process's episodes of a step do not fit the engine's key/value cache at once: the rollout
    then plays them in waves, each as long as a whole episode (a 3B recipe whose update left a 0.5 GiB cache
    played 32 episodes 3 at a time: its rollout took 10x its update). None when they fit, or off the engine."""
    cache = estimate.parts.get("key/value cache", 0.0)  # none on the hf backend
    at_once = full_length_sequences(config, counts, cache)
    episodes = math.ceil(config.groups.n_groups / processes) * config.groups.group_size
    wanted = min(episodes, config.model.engine.max_rows)
    if at_once == 0 or at_once >= wanted:
        return None
    more: list[str] = []
    if config.model.engine.kv_cache_gb > 0:
        more.append("a larger model.engine.kv_cache_gb")
    else:
        if not estimate.apart and not config.distributed.async_rollout:  # refused beside a rollout thread
            more.append("model.engine.free_during_update=true (the cache then need not fit beside the update)")
        if not config.model.gradient_checkpointing:
            more.append("model.gradient_checkpointing=true (smaller activations leave the cache more)")
    advice = f" For more at once: {'; or '.join(more)}" if more else ""
    return (f"the key/value cache ({cache / GIB:.1f} GiB) holds {at_once} sequence{'s' if at_once > 1 else ''} of "
            f"{config.model.engine.max_seq_len} tokens at once, and a process plays {episodes} episodes a step: "
            f"once the turns grow that long, the rollout plays them {at_once} at a time (shorter turns take fewer "
            f"pages, so more run at once).{advice}")


def cache_full_note(metrics: Mapping[str, float], kv_cache_gb: float) -> str | None:
    """A note when a step's rollout found the engine's key/value cache full: it dropped idle rows' cached
    conversations for their pages (``generation/page_evictions``: a conversation whose episode comes back for its
    next turn is prefilled again) or turns waited for running ones to free pages (``generation/page_waits``: the
    rollout then generates in waves, each adding decode steps). The VisGym ``vlm-3b`` step with an 8 GB cache:
    22-44 evictions a step, 4-5% more decode steps and 1.5-2x the tokens prefilled, 32.4 s against 30.1 s
    with 10 GB. None when neither happened (or off the engine, which counts neither)."""
    evicted, waited = int(metrics.get("generation/page_evictions", 0)), int(metrics.get("generation/page_waits", 0))
    if evicted == 0 and waited == 0:
        return None
    size = f"model.engine.kv_cache_gb={kv_cache_gb:g}" if kv_cache_gb > 0 else "its default size"
    larger = ("a larger model.engine.kv_cache_gb (or 0, the default: 30% of a GPU's memory free when the engine "
              "starts)" if kv_cache_gb > 0 else "a model.engine.kv_cache_gb larger than the default")
    happened = [f"dropped {evicted} idle conversation{'s' if evicted != 1 else ''} for "
                f"{'their' if evicted != 1 else 'its'} pages (an episode still playing is prefilled again at its next "
                "turn)"] if evicted else []
    if waited:
        happened.append(f"made {waited} turn{'s' if waited != 1 else ''} wait for pages (generated in waves)")
    return (f"the engine's key/value cache ({size}) was full: it {' and '.join(happened)}; {larger} holds more "
            "(generation/page_evictions and generation/page_waits in the metrics)")


def pairing_budget(longest: int) -> int:
    """The ``algorithm.micro_batch_tokens`` at which two sequences of ``longest`` tokens share a packed pass:
    twice the longest, rounded up to 128 tokens."""
    return -(-2 * longest // 128) * 128


def half_full_passes_note(metrics: Mapping[str, float], micro_batch_tokens: int) -> str | None:
    """A note when the update's packed passes ran little more than half full because no two sequences fit one:
    the longest is over half of ``algorithm.micro_batch_tokens`` (``batch/sequence_length_max``), and the passes'
    rows filled under 60% of their budget (``actor/pass_fill``). The VisGym ``vlm-3b`` step at 15 turns (4.1k-token
    sequences in 8,192-token passes) spent 25% longer in its update than with passes of 8,704 (docs/benchmarks.md).
    None otherwise (sequences that already pair, or a budget simply larger than a step's rows need)."""
    fill, longest = metrics.get("actor/pass_fill"), int(metrics.get("batch/sequence_length_max", 0))
    if micro_batch_tokens <= 0 or fill is None or fill >= 0.6 or not micro_batch_tokens < 2 * longest:
        return None
    pair = pairing_budget(longest)
    return (f"the update's passes ran {fill:.0%} full: sequences of up to {longest:,} tokens do not pair in "
            f"passes of algorithm.micro_batch_tokens={micro_batch_tokens}, so most passes held one; "
            f"algorithm.micro_batch_tokens={pair} lets two share a pass, in fewer and fuller passes, with more "
            "memory for each (`turnrl memory` estimates it)")


def rows_shorter_than_episodes(config: TrainConfig) -> str | None:
    """A note when an engine row holds less than the agent lets an episode grow to (a whole-history context):
    the rollout then ends episodes at the row's length (``context_budget``), short of the recipe's budget.
    None when the rows are long enough, a context window bounds the prompts, or off the engine."""
    rows, budget = config.model.engine.max_seq_len, config.agent.max_context_tokens
    if config.model.backend == "hf" or config.agent.max_context_window is not None or budget <= rows:
        return None
    return (f"episodes end at model.engine.max_seq_len={rows} tokens, short of agent.max_context_tokens={budget}: "
            f"set model.engine.max_seq_len={budget} to give them the agent's budget")


def _activations_saved(config: TrainConfig, counts: ModelCounts, changed: TrainConfig, processes: int) -> float:
    """What the activations part of ``config`` loses in ``changed``: 0 where the pass that stays the largest is
    another (a scoring pass of its own budget, or the update's)."""
    return _activations(config, counts, processes) - _activations(changed, counts, processes)


def _saving(estimate: MemoryEstimate, changed: TrainConfig, counts: ModelCounts, processes: int) -> float:
    """What ``estimate``'s peak loses when the run is ``changed`` so (of ``counts`` on ``processes``): estimated
    whole again, since a part that the peak does not hold (under ``model.engine.free_during_update``, one of the
    group that is not the larger) saves nothing. A default key/value cache keeps its size: it would grow into
    what the change frees."""
    after = estimate_memory(changed, counts, processes, estimate.device_bytes, estimate.margin)
    cache = estimate.parts.get("key/value cache")
    if cache is not None and "key/value cache" in after.parts and changed.model.engine.kv_cache_gb == 0:
        after = replace(after, parts={**after.parts, "key/value cache": cache})
    return estimate.total - after.total


def fit_advice(config: TrainConfig, counts: ModelCounts, estimate: MemoryEstimate, processes: int) -> list[str]:
    """What would make the run fit, the largest saving of the estimated peak first; a change that saves nothing
    (a smaller pass where another stays the largest, a part of the group that is not the larger) is left out."""
    model, algorithm, engine, dist = config.model, config.algorithm, config.model.engine, config.distributed

    def saving(changed: TrainConfig, changed_counts: ModelCounts = counts, changed_processes: int = processes) -> float:
        return _saving(estimate, changed, changed_counts, changed_processes)

    def with_model(**fields: Any) -> TrainConfig:
        return replace(config, model=replace(model, **fields))

    def with_algorithm(**fields: Any) -> TrainConfig:
        return replace(config, algorithm=replace(algorithm, **fields))

    options: list[tuple[float, str]] = []
    states = sum(estimate.parts.get(name, 0.0) for name in ("actor", "critic", "reference"))
    if states > 0:
        sharded = _sharded(config, processes)
        offload = "distributed.cpu_offload=true" if sharded else \
            "distributed.backend=fsdp distributed.cpu_offload=true (one process, FSDP's CPU offload)"
        offloaded = replace(config, distributed=replace(dist, cpu_offload=True,
                                                        backend=dist.backend if sharded else "fsdp"))
        options.append((saving(offloaded),
                        f"{offload} (moves {states / GIB:.0f} GiB of training states to host memory)"))
        options.append((saving(config, changed_processes=2 * processes),
                        f"distributed.nproc_per_node={2 * processes} (training states are divided among the GPUs)"))
    if not config.lora.enabled:
        # The adapters themselves, a percent or two of the weights, counted as none.
        trains = "the actor trains adapters only; the critic still trains all its weights" if algorithm.uses_critic \
            else "trains adapters only"
        options.append((saving(replace(config, lora=replace(config.lora, enabled=True)), replace(counts, trained=0)),
                        f"lora.enabled=true ({trains}; the reference is the base)"))
    kept = kept_layers(config, counts)
    fewest = fewest_checkpointed_layers(config, counts, processes, estimate.device_bytes, estimate.margin) \
        if kept or not model.gradient_checkpointing else None  # else every layer is recomputed already
    partial = f" model.checkpointed_layers={fewest} (the fewest recomputed layers that fit)" \
        if fewest is not None and fewest < counts.layers else ""
    if kept:
        options.append((saving(with_model(checkpointed_layers=fewest)), partial.strip())
                       if partial else (saving(with_model(checkpointed_layers=None)),
                                        "model.checkpointed_layers=null (every layer recomputed)"))
    if not model.gradient_checkpointing:
        options.append((saving(with_model(gradient_checkpointing=True)), f"model.gradient_checkpointing=true{partial}"))
        if not model.compile:
            compiled = with_model(compile=True)
            fewer = _activations_saved(config, counts, compiled, processes)
            options.append((saving(compiled), f"model.compile=true (its layers keep {fewer / GIB:.0f} GiB fewer "
                                              "activations)"))
    if algorithm.micro_batch_tokens == 0 and engine.max_seq_len > 512:
        options.append((saving(with_model(engine=replace(engine, max_seq_len=engine.max_seq_len // 2))),
                        f"a smaller model.engine.max_seq_len, the longest sample (the estimate counts "
                        f"{algorithm.micro_batch_size} samples of {engine.max_seq_len} tokens a micro-batch)"))
    if algorithm.micro_batch_tokens > 4096:
        half = algorithm.micro_batch_tokens // 2
        options.append((saving(with_algorithm(micro_batch_tokens=half)), f"algorithm.micro_batch_tokens={half}"))
    if algorithm.score_micro_batch_tokens > 4096:
        half = algorithm.score_micro_batch_tokens // 2
        options.append((saving(with_algorithm(score_micro_batch_tokens=half)),
                        f"algorithm.score_micro_batch_tokens={half} (the scoring passes' own budget)"))
    if model.backend != "hf" and not estimate.apart and not dist.async_rollout:  # refused beside a rollout thread
        rollout, _ = estimate.groups()
        options.append((saving(with_model(engine=replace(engine, free_during_update=True))),
                        f"model.engine.free_during_update=true (frees the rollout's {rollout / GIB:.0f} GiB while "
                        "the update runs)"))
    if engine.kv_cache_gb > 0:  # the default cache is sized to fit already
        options.append((saving(with_model(engine=replace(engine, kv_cache_gb=engine.kv_cache_gb / 2))),
                        "a smaller model.engine.kv_cache_gb"))
    options = [(saved, text) for saved, text in options if saved > 0]
    fragmentation = estimate.margin - CUDA_CONTEXT_BYTES
    if fragmentation > 0:
        # First where it alone makes the run fit: it costs nothing.
        alone = estimate.total + CUDA_CONTEXT_BYTES <= estimate.device_bytes
        options.append((math.inf if alone else fragmentation,
                        f"expandable segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the allocator margin "
                        f"then leaves {fragmentation / GIB:.1f} GiB more)"))
    return [text for _, text in sorted(options, key=lambda option: -option[0])] or [
        "a GPU with more memory (nothing else the estimate counts makes this run smaller)"]


def fewest_checkpointed_layers(config: TrainConfig, counts: ModelCounts, processes: int, device_bytes: float,
                               margin: float = 0.0) -> int | None:
    """The fewest decoder layers that checkpointing may recompute (``model.checkpointed_layers``) with the run's
    estimate still fitting ``device_bytes`` less ``margin``; None when it does not fit with every layer recomputed.
    A default key/value cache (``model.engine.kv_cache_gb=0``) must keep the size it has with every layer
    recomputed: it is sized into what the update leaves, and kept activations would shrink it."""
    every = replace(config, model=replace(config.model, gradient_checkpointing=True, checkpointed_layers=None))
    cache = estimate_memory(every, counts, processes, device_bytes, margin).parts.get("key/value cache", 0.0)
    for recomputed in range(counts.layers + 1):
        trial = estimate_memory(replace(every, model=replace(every.model, checkpointed_layers=recomputed)), counts,
                                processes, device_bytes, margin)
        if trial.fits() and trial.parts.get("key/value cache", 0.0) >= cache:
            return recomputed
    return None


def fewer_recomputed_note(config: TrainConfig, counts: ModelCounts, processes: int, device_bytes: float,
                          margin: float = 0.0) -> str | None:
    """Where a run recomputes every layer and would fit with fewer, the setting that recomputes the fewest (a
    faster update); else None."""
    if not config.model.gradient_checkpointing or config.model.checkpointed_layers is not None:
        return None
    fewest = fewest_checkpointed_layers(config, counts, processes, device_bytes, margin)
    if fewest is None or fewest >= counts.layers:
        return None
    return (f"model.checkpointed_layers={fewest} would fit too: the last {counts.layers - fewest} of the "
            f"{counts.layers} decoder layers keep their activations and skip their recomputation")


def _turn_on(config: TrainConfig, counts: ModelCounts, estimate: MemoryEstimate, processes: int) -> str:
    """The four largest savings of :func:`fit_advice`, as ``A; or B; or ...``."""
    return "; or ".join(fit_advice(config, counts, estimate, processes)[:4])


def _margin_note(estimate: MemoryEstimate) -> str:
    """What the allocator margin is for, said after the estimate's table where only the margin makes it a misfit;
    else nothing."""
    if estimate.margin == 0 or estimate.total > estimate.device_bytes:
        return ""
    fragmentation = " and what an allocator without expandable segments cannot reuse" \
        if estimate.margin > CUDA_CONTEXT_BYTES else ""
    return f", which keeps room for the CUDA context{fragmentation}"


def require_fit(config: TrainConfig, counts: ModelCounts, processes: int, device_bytes: float,
                margin: float = 0.0) -> MemoryEstimate:
    """The estimate of :func:`estimate_memory`, or a ConfigError with its parts and what to turn on when it
    exceeds ``device_bytes`` less the allocator's ``margin``."""
    estimate = estimate_memory(config, counts, processes, device_bytes, margin)
    if not estimate.fits():
        raise ConfigError(f"this run needs about {estimate.table()}{_margin_note(estimate)} (estimated per GPU, "
                          f"{processes} process{'es' if processes > 1 else ''}): turn on "
                          f"{_turn_on(config, counts, estimate, processes)}; or set run.check_memory=false to try "
                          "anyway")
    return estimate


def fit_report(config: TrainConfig, counts: ModelCounts, processes: int, device_bytes: float,
               margin: float = 0.0) -> tuple[bool, str]:
    """Whether ``config`` fits ``processes`` GPUs of ``device_bytes`` each, less the allocator's ``margin``, and a
    line that says so: the estimate by part, and when it does not fit what to turn on (what ``turnrl memory``
    prints for each GPU count)."""
    estimate = estimate_memory(config, counts, processes, device_bytes, margin)
    gpus = f"{processes} GPU{'s' if processes > 1 else ''}"
    if estimate.fits():
        waves = rollout_in_waves(config, counts, estimate, processes)
        fewer = fewer_recomputed_note(config, counts, processes, device_bytes, margin)
        return True, (f"{gpus}: fits ({estimate.table()})" + (f"; {fewer}" if fewer else "")
                      + (f"; but {waves}" if waves else ""))
    return False, (f"{gpus}: does not fit ({estimate.table()}{_margin_note(estimate)}); turn on "
                   f"{_turn_on(config, counts, estimate, processes)}")


def sft_estimate(config: TrainConfig, counts: ModelCounts, tokens: int, device_bytes: float,
                 margin: float = 0.0) -> MemoryEstimate:
    """The SFT stage's peak on its GPU, for micro-batches of ``tokens`` (rows padded to the longest): the model's
    float32 weights, gradients and AdamW moments (SFT trains the whole model but a frozen vision tower, LoRA
    or not, in one process on one GPU), one micro-batch forward and backward (:func:`activation_bytes`, an
    approximation), and in mixed precision autocast's bf16 copy of each weight that autograd keeps (every one
    without checkpointing, the kept layers' with ``model.checkpointed_layers``); against
    ``device_bytes`` less the allocator's ``margin``."""
    checkpointing = config.model.gradient_checkpointing
    kept = kept_layers(config, counts)
    parts = {"model": _training_states(counts.trained, counts.total - counts.trained, 1, False),
             "activations": activation_bytes(counts, tokens, checkpointing, config.model.compile,
                                             dtypes=pass_bytes(config, sharded=False), kept_layers=kept)}
    if config.model.dtype != "float32" and (not checkpointing or kept):
        parts["weight casts"] = kept_layer_cast_bytes(counts, kept) if checkpointing else weight_cast_bytes(counts)
    return MemoryEstimate(parts, device_bytes, margin=margin)


SFT_ELSEWHERE = ("use a GPU with more memory (SFT trains the whole model in one process), or start RL from an SFT "
                 "model made elsewhere: sft.enabled=false model.path=DIR")


def sft_fit_advice(config: TrainConfig, counts: ModelCounts, rows: int, longest: int,
                   device_bytes: float, margin: float = 0.0) -> list[str]:
    """What makes SFT's micro-batches of ``rows`` samples of up to ``longest`` tokens fit: the largest
    ``sft.micro_batch_size`` that does (the batch stays, as gradients add up), gradient checkpointing (with the
    largest micro-batch that fits then); else a larger GPU or an SFT model made elsewhere, as SFT runs in one
    process."""
    def largest_fitting(fitting: TrainConfig) -> int:
        return max((size for size in range(1, rows)
                    if sft_estimate(fitting, counts, size * longest, device_bytes, margin).fits()), default=0)

    advice = []
    size = largest_fitting(config)
    if size:
        advice.append(f"set sft.micro_batch_size={size} (sft.batch_size={config.sft.batch_size} stays: the "
                      "micro-batches' gradients add up)")
    if not config.model.gradient_checkpointing or kept_layers(config, counts):
        checkpointed = replace(config, model=replace(config.model, gradient_checkpointing=True,
                                                     checkpointed_layers=None))
        setting = "model.checkpointed_layers=null" if config.model.gradient_checkpointing else \
            "model.gradient_checkpointing=true"
        if sft_estimate(checkpointed, counts, rows * longest, device_bytes, margin).fits():
            advice.append(f"set {setting}")
        elif size := largest_fitting(checkpointed):
            advice.append(f"set {setting} sft.micro_batch_size={size}")
    return advice or [SFT_ELSEWHERE]


def check_sft_memory(config: TrainConfig, model_path: Path | str, longest: int, samples: int,
                     device: torch.device) -> MemoryEstimate | None:
    """Estimate the SFT stage's peak (:func:`sft_estimate`) for its data, ``samples`` samples of which the longest
    has ``longest`` tokens, and stop it before the model loads when it cannot fit ``run.gpu_share`` of the GPU.
    The activations are approximate, so a run the estimate lets through can still run out of memory; that
    error then says what to change (:func:`~turnrl.training.sft.sft_train`).

    Returns:
        The estimate on a GPU; None on a CPU, with ``run.check_memory=false`` or for a model that cannot be
        counted from its config.

    Raises:
        ConfigError: the estimate exceeds the GPU's share: the parts and what makes it fit.
    """
    if device.type != "cuda" or not config.run.check_memory:
        return None
    try:
        counts = count_model(model_path, train_vision=config.model.train_vision)
    except (OSError, ValueError, TypeError, AttributeError) as error:
        logger.warning("no SFT memory estimate for %s (%s); SFT starts without one", model_path, error)
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    share = config.run.gpu_share
    rows = min(config.sft.micro_batch_size, samples)
    margin = run_margin(config, share * total)
    estimate = sft_estimate(config, counts, rows * longest, share * total, margin)
    if estimate.fits():
        return estimate
    advice = sft_fit_advice(config, counts, rows, longest, share * total, margin)
    shared = f" (with run.gpu_share={share:g} of a {total / GIB:.1f} GiB GPU: or a larger share)" if share < 1 else ""
    raise ConfigError(f"SFT needs about {estimate.table()} for micro-batches of {rows} samples of up to {longest} "
                      f"tokens: {'; or '.join(advice)}{shared}; or set run.check_memory=false to try anyway")


@dataclass(frozen=True)
class MemoryCheck:
    """What :func:`check_memory` found before a run starts: the estimate, and a setting that would make the fitting
    run faster where there is one (:func:`fewer_recomputed_note`), printed beside the estimate."""

    estimate: MemoryEstimate
    faster: str | None = None


def check_memory(config: TrainConfig, model_path: Path | str, device: torch.device,
                 processes: int) -> MemoryCheck | None:
    """Estimate each GPU's peak and stop a run that cannot fit, before any model loads.

    The GPU's memory is ``run.gpu_share`` of its total (several runs sharing a card). A run of no RL steps (an
    SFT start, ``run.steps=0``) has no update to fit: its SFT stage checks its own micro-batches against its
    longest sample (:func:`check_sft_memory`) once the demos are made.

    Returns:
        The estimate on a GPU (logged with the run) and the fewest layers checkpointing must recompute where a
        run recomputes them all and would fit with fewer; None on a CPU, with ``run.check_memory=false`` or with
        no RL steps.

    Raises:
        ConfigError: the estimate exceeds the GPU's memory: the parts and what to turn on.
    """
    if device.type != "cuda" or not config.run.check_memory or config.run.steps == 0:
        return None
    try:
        counts = count_recipe_model(config, model_path)
    except (OSError, ValueError, TypeError, AttributeError) as error:
        # A model transformers cannot build from its config alone (remote code, say): the run goes on unchecked.
        logger.warning("no memory estimate for %s (%s); the run starts without one", model_path, error)
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    share = config.run.gpu_share
    try:
        estimate = require_fit(config, counts, processes, share * total, run_margin(config, share * total))
    except ConfigError as error:
        if share == 1:
            raise
        raise ConfigError(f"{error} (with run.gpu_share={share:g} of a {total / GIB:.1f} GiB GPU: run fewer "
                          "runs on the card, each with a larger share)") from error
    waves = rollout_in_waves(config, counts, estimate, processes)
    if waves is not None:
        logger.warning(waves)
    return MemoryCheck(estimate, fewer_recomputed_note(config, counts, processes, estimate.device_bytes,
                                                       estimate.margin))
