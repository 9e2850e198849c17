"""Typed configuration: dataclasses loaded from YAML with ``key=value`` overrides.

Every field has a one-line docstring; ``turnrl train --config X.yaml a.b=c``
merges the YAML and the overrides onto these dataclasses with OmegaConf, so an
unknown key or a value of the wrong type fails at load time, naming the key.
Choices (e.g. the advantage estimator) are checked in ``validate`` methods with
a message that lists what is allowed.
"""

from __future__ import annotations

import ast
import inspect
import math
import os
import re
import shutil
import sys
import textwrap
import typing
from collections.abc import Collection
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from turnrl.agent.prompts import PromptLayout
from turnrl.chat.templates import TEMPLATES
from turnrl.config_messages import (
    KeyShape,
    choice_problem,
    close_keys,
    container_mismatch,
    format_omegaconf_error,
    key_shapes,
    nested_mapping,
    shape_problem,
    unknown_key,
    unknown_key_problem,
    yaml_problem,
)
from turnrl.files import TOO_DEEP, parse_yaml
from turnrl.registry import Registry, RegistryError, close_names, is_module_attr

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which key and what is allowed."""


def turnrl_command(argv0: str | None = None) -> str:
    """``turnrl`` as the user can type it again, for the commands a message prints (``turnrl train resume=...``).

    A process started as a ``turnrl`` script that the shell would not find by that name (``.venv/bin/turnrl``
    while the virtualenv is not activated) gives that script's path, relative to the current folder when it is
    below it; anything else (``turnrl`` on the PATH, ``python -m turnrl.cli``, a test) gives ``turnrl``.
    ``argv0``: how the process was started (``sys.argv[0]``).
    """
    started = argv0 if argv0 is not None else sys.argv[0]
    if Path(started).name != "turnrl" or not Path(started).is_file():
        return "turnrl"
    found = shutil.which("turnrl")
    if found is not None and Path(found).resolve() == Path(started).resolve():
        return "turnrl"
    script = Path(os.path.abspath(started))
    try:
        relative = script.relative_to(Path.cwd())
    except ValueError:
        return str(script)
    return str(relative) if len(relative.parts) > 1 else f"./{relative}"


def check_choice(key: str, value: Any, allowed: list[Any] | tuple[Any, ...]) -> None:
    problem = choice_problem(key, value, allowed)
    if problem is not None:
        raise ConfigError(problem)


def check_registered(key: str, value: str, registry: Registry[T]) -> T:
    """The object ``value`` names in ``registry``: a registered name, or ``module:attr`` in the user's package.

    Raises:
        ConfigError: an unknown name (listing the registered ones, with the likely one of a typo), a module or
            attribute that cannot be imported, or an object of the wrong kind.
    """
    if value not in registry and not is_module_attr(value):
        near = close_names(value, registry.names())
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {list(registry.names())}; {hint}or name "
                          f"one of your own as module:attr (e.g. my_package.module:my_{key.rsplit('.', 1)[-1]})")
    try:
        return registry.get(value)
    except (RegistryError, TypeError) as error:
        raise ConfigError(f"{key}={value!r}: {error}") from error


def check_range(key: str, value: float, low: float | None = None, high: float | None = None) -> None:
    # NaN compares false with every bound, and inf is no setting any key means: both would pass the bounds.
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} must be a finite number")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ConfigError(f"{key}={value!r} is out of range; allowed: {bounds}")


def check_finite_fields(section: Any, prefix: str = "") -> None:
    """Every number typed ``float`` in a config and its sections is finite, for the keys that no ``validate``
    bounds (a loss weight, a clip range): NaN passes no bound and fails no ``<`` either, so it would reach the
    loss and turn every weight into NaN without an error."""
    for item in fields(section):
        value = getattr(section, item.name)
        if is_dataclass(value):
            check_finite_fields(value, f"{prefix}{item.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{item.name}={value!r} must be a finite number")


# --------------------------------------------------------------------------- sections
@dataclass
class EnvConfig:
    id: str = "FrozenLake"
    """A built-in env (``turnrl envs`` lists them), any registered Gymnasium id, ``module:Class``, or
    ``gym:<id>`` for a Gymnasium env with rgb_array frames (its images become the observations)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Constructor settings of the env, e.g. ``{size: 4, is_slippery: false}``."""
    val_settings: Optional[dict[str, Any]] = None
    """Settings for validation envs when they differ (e.g. a test split); None reuses ``settings``."""
    remote: list[str] = field(default_factory=list)
    """URLs of ``turnrl serve-env`` servers; when set, every env of the run lives on one of them (tried in
    order, failing over to the next) instead of in this process. Empty runs the envs here."""


@dataclass
class AgentConfig:
    format: str = "free_think"
    """Reasoning format of responses (``no_think``, ``free_think``, ``grounding_worldmodeling``, ``ragen``, ...),
    or ``my_package.module:my_format`` (a format builder, docs/extending.md)."""
    max_actions_per_turn: int = 1
    """Actions parsed from one response and stepped in order (RAGEN's paper: 5, its current configs: 2, VAGEN: 3)."""
    action_separator: Optional[str] = None
    """Separator of actions in the answer; None takes the format's default (``,`` or ``||``)."""
    strict_format: bool = False
    """Take actions only from well-formed responses, as VAGEN's parsers do (a malformed response steps
    nothing); false takes them from the last complete answer tag of any response."""
    max_turns: int = 5
    """Model responses per episode; reaching it truncates the episode."""
    max_actions_per_episode: int = 10
    """Action budget per episode (RAGEN's max_actions_per_traj); exhausting it truncates."""
    max_context_window: Optional[int] = None
    """Turns kept in the prompt, the current one included; None keeps all."""
    max_images: Optional[int] = None
    """Images kept in the prompt (the latest ones); older observations lose their image and keep their text.
    None keeps every image in the window. Dropping images changes earlier prompts, so training then needs
    ``algorithm.sample_mode=turn``; the trajectory keeps every image the model saw."""
    max_context_tokens: int = 4096
    """Token budget of one episode's context; an episode that would exceed it is truncated."""
    format_reward: float = 0.0
    """Reward added to a turn whose response is well formed (VAGEN: 0.5)."""
    no_action_penalty: float = -0.1
    """Reward added to a turn with no valid action (RAGEN: -0.1)."""
    feedback_on_invalid: bool = True
    """Tell the model in the next observation when its response had no valid action."""
    turn_info: bool = True
    """Frame each observation with the turn number, the last reward and the actions left (what RAGEN's turns
    say, in turnrl's words: docs/fidelity.md); false sends the state alone, which saves a small model's context
    for what it needs."""
    prompt_layout: PromptLayout = "turnrl"
    """The conversation's words: ``turnrl``'s (the keys around this one shape them), or ``ragen``: RAGEN's system
    message (its role line, the env's instructions, its action lines) and user messages (the last reward, turn,
    state, actions left, the format and length line), which ``system_prompt``, ``format_instructions`` and
    ``turn_info`` leave as they are; ``env_instructions`` and ``feedback_on_invalid`` (RAGEN's warning after a turn
    without a valid action) apply to both. ``vagen``: VAGEN's Sokoban and FrozenLake texts (its guide and the
    format's description, example and limits in the system message; each turn the actions stepped, the image or
    the env's text, and the format again), for the formats VAGEN and turnrl share; none of the keys above or
    below shape them (docs/fidelity.md)."""
    response_length_hint: int = 100
    """The N of the ``ragen`` layout's "Max response length: N words (tokens)." (RAGEN's env ``max_tokens``: 100
    for Sokoban, FrozenLake, Bandit, Countdown; 120 CoordSokoban, CoordFrozenLake); it limits nothing
    (sampling.max_new_tokens does)."""
    system_prompt: Optional[str] = None
    """Replaces the default system prompt text before the env instructions."""
    env_instructions: bool = True
    """Put the env's task description in the system prompt (a model trained from scratch cannot read it)."""
    task_instructions: Optional[str] = None
    """The task description in these words instead of the env's own ``instructions()``, as written (spaces and
    newlines kept): RAGEN's recipes give RAGEN's ``env_instruction`` from its ``envs.yaml`` here. None asks the env.
    ``env_instructions=false`` leaves out either; VAGEN's layout has words of its own and uses neither."""
    format_instructions: bool = True
    """Put the response format's description in the system prompt."""
    wait_for_turns: bool = True
    """Play turns in rounds: every episode's turn is generated together, then every env steps. False (with
    the engine backend) hands an episode's next turn to the engine as soon as its env step returns, and
    env steps (in ``groups.env_workers`` threads) run while the engine decodes: the choice for slow envs.
    In RAGEN's Sokoban recipe (env steps well under a millisecond) rounds were faster; in a synthetic benchmark
    of responses of spread lengths, not waiting was (docs/benchmarks.md). Reward functions then score one turn
    a call."""
    prefill_groups: int = 1
    """In rounds (``agent.wait_for_turns``, with the engine backend), after a round's generation, step the
    environments and hand the next turn's requests to the engine in this many parts, each part's prefill running
    on the device while the host steps the next part's environments and builds its requests; the round's decode
    starts once every part is in, so its batches stay whole. 1: every environment steps, then the whole round is
    prefilled, with the device idle meanwhile. Reward functions score one part a call. Rounds whose weights may
    change at a turn boundary (partial rollouts) take their parts together. In the VisGym ``vlm-3b`` step on an
    H200, 4 parts made the rollout a second slower than 1 (docs/benchmarks.md, "VLM steps")."""

    def validate(self) -> None:
        from turnrl.agent.formats import FORMATS, get_format

        check_registered("agent.format", self.format, FORMATS)
        check_choice("agent.prompt_layout", self.prompt_layout, ["turnrl", "ragen", "vagen"])
        for key in ("max_actions_per_turn", "max_turns", "max_actions_per_episode", "max_context_tokens",
                    "response_length_hint"):
            check_range(f"agent.{key}", getattr(self, key), 1)
        check_range("agent.prefill_groups", self.prefill_groups, 1)
        if self.prefill_groups > 1 and not self.wait_for_turns:
            raise ConfigError("agent.prefill_groups splits rounds of turns, and agent.wait_for_turns=false has none "
                              "(each episode's turn is prefilled as it comes): leave agent.prefill_groups at 1")
        if self.max_context_window is not None and self.max_context_window < 1:
            raise ConfigError(f"agent.max_context_window={self.max_context_window!r} is out of range; allowed: "
                              "[1, inf], or null to keep every turn (RAGEN's -1)")
        if self.max_images is not None:
            check_range("agent.max_images", self.max_images, 0)
        try:  # a user's format builds here, so that a broken one fails at load time, naming the key
            get_format(self.format, action_separator=self.action_separator,
                       max_actions_per_turn=self.max_actions_per_turn, strict=self.strict_format)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"agent.format={self.format!r}: {error}") from error

    def validate_for_env(self, env_id: str) -> None:
        """The checks that need the run's env: VAGEN's layout has texts for a few envs and formats only."""
        if self.prompt_layout != "vagen":
            return
        from turnrl.agent.vagen_texts import vagen_texts

        try:
            vagen_texts(env_id, self.format)
        except ValueError as error:
            raise ConfigError(f"agent.prompt_layout=vagen: {error}; use agent.prompt_layout=turnrl for another env "
                              "or format") from None


@dataclass
class RewardSpec:
    """One added reward (see :mod:`turnrl.rewards`)."""

    name: str = "???"
    """Its name in trajectories and metrics."""
    fn: str = "???"
    """A built-in reward (``overlong``) or ``module:attribute``: a function of a batch of finished turns, or a
    class whose instances are."""
    weight: float = 1.0
    """Its weight in the turn reward."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments: of the class, or of every call of the function."""


@dataclass
class RewardsConfig:
    """A turn's reward is the weighted sum of its named rewards: ``env``, ``format`` and every added one."""

    env_weight: float = 1.0
    """Weight of the env's reward (VisGym's recipe: 0.8)."""
    format_weight: float = 1.0
    """Weight of the format reward and the no-valid-action penalty (``agent.format_reward``,
    ``agent.no_action_penalty``; VisGym's recipe: 0.2)."""
    extra: list[RewardSpec] = field(default_factory=list)
    """Added rewards, e.g.
    ``[{name: overlong, fn: overlong, weight: 1.0, settings: {max_tokens: 256, buffer: 64}}]``."""
    on_error: float = 0.0
    """Score of a turn whose reward function failed (the failure is recorded and counted)."""
    timeout_s: Optional[float] = None
    """Time one call of a reward function may take before its turns score ``on_error``; None waits."""

    def validate(self) -> None:
        for key in ("env_weight", "format_weight", "on_error"):
            if not math.isfinite(getattr(self, key)):
                raise ConfigError(f"rewards.{key}={getattr(self, key)!r} must be a finite number")
        for spec in self.extra:
            if not math.isfinite(spec.weight):
                raise ConfigError(f"rewards.extra {spec.name!r}: weight={spec.weight!r} must be a finite number")
        if self.timeout_s is not None:
            check_range("rewards.timeout_s", self.timeout_s, 1e-3)


GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily and score their tokens at temperature 1, as 0 does (vLLM's
``_SAMPLING_EPS``): the limit of sampling as the temperature goes to 0 is the argmax, and dividing logits by a
tinier temperature overflows float32 (``1e-40`` made every logit infinite)."""


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` samples greedily (below :data:`GREEDY_BELOW_TEMPERATURE`, 0 included)."""
    return temperature < GREEDY_BELOW_TEMPERATURE


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature; 0 (or below 1e-5) means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling; 0 disables."""
    max_new_tokens: int = 128
    """Tokens generated per response at most."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings besides the end-of-turn token."""

    def validate(self, prefix: str = "sampling") -> None:
        check_range(f"{prefix}.temperature", self.temperature, 0.0)
        check_range(f"{prefix}.top_p", self.top_p, 0.0, 1.0)
        check_range(f"{prefix}.top_k", self.top_k, 0)
        check_range(f"{prefix}.max_new_tokens", self.max_new_tokens, 1)
        if any(not isinstance(stop, str) or not stop for stop in self.stop):
            # The empty string is in every text: each response would end after its first token.
            raise ConfigError(f"{prefix}.stop={list(self.stop)!r} holds an empty stop string, which every text "
                              "holds (each response would end after one token): drop it")


@dataclass
class EngineConfig:
    """The rollout engine's cache and batching (``model.backend=engine``)."""

    kv_cache_gb: float = 0.0
    """Memory for cached keys and values, in pages of 128 positions: a sequence takes the pages of its prompt and
    generation budget when it starts, so the budget bounds the tokens run at once; 0 takes 30% of the GPU memory
    free when the engine starts, or 4 GiB on a CPU."""
    max_rows: int = 256
    """Sequences cached at once at most, whatever the memory allows."""
    max_seq_len: int = 4096
    """Tokens a sequence holds at most (prompt and response); a longer prompt is an error for that request."""
    prefill_chunk_tokens: int = 16384
    """Padded prompt tokens prefilled in one forward pass at most."""
    cuda_graphs: bool = True
    """Capture decode steps, and prefill calls of at most 8,192 padded tokens (with the Triton kernels), in CUDA
    graphs on a GPU (ignored on a CPU)."""
    compile: str = "auto"
    """Compile the decode step's layers and the sampler with torch.compile: ``auto`` (on a GPU), ``true``, ``false``;
    a compilation that fails falls back to eager decoding with a warning."""
    fuse_projections: bool = True
    """Stack the q/k/v and gate/up weights into one buffer each (one GEMM per group; costs a copy of them)."""
    free_during_update: bool = False
    """Free the key/value cache, the engine's computed weights (stacked projections, bf16 casts) and, with several
    processes, the rollout copy of the actor while the trainer scores and updates, and build them again before the
    next rollout: the update's peak holds none of them (a 7B actor and critic on 80 GB cards), at the cost of
    capturing the CUDA graphs and gathering the whole actor again each step. Their contents are stale after an
    update anyway."""
    families: list[str] = field(default_factory=list)
    """Model families the engine may run beside its own (``turnrl/engine/families.py``), each a registered name
    or ``my_package.module:MY_FAMILY`` naming a ``Family`` record (docs/extending.md)."""
    triton: str = "auto"
    """Triton kernels for attention (one kernel for prefill and decode, reading each cached row only up to its own
    length), the rotary turn and cache write, and sampling (by the inverse CDF): ``true``, ``false`` (torch:
    batched matmuls or SDPA up to the longest sequence of the batch, a compiled torch sampler), ``auto`` (on a GPU
    when Triton is installed)."""

    def validate(self) -> None:
        check_range("model.engine.kv_cache_gb", self.kv_cache_gb, 0.0)
        check_choice("model.engine.compile", str(self.compile).lower(), ["auto", "true", "false"])
        check_choice("model.engine.triton", str(self.triton).lower(), ["auto", "true", "false"])
        for key in ("max_rows", "max_seq_len", "prefill_chunk_tokens"):
            check_range(f"model.engine.{key}", getattr(self, key), 1)


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """A transformers model directory or hub id; None builds the built-in small model."""
    builtin_preset: str = "small"
    """The built-in model when ``path`` is None: ``tiny``, ``small``, ``base``, ``0.5b`` (Qwen2), or a VLM
    ``vlm-tiny``, ``vlm-small``, ``vlm-0.5b`` (Qwen2.5-VL); with the released models' full shapes and random
    weights (to measure speed and memory): ``1.5b``, ``3b``, ``7b``, ``vlm-3b``, ``vlm-7b`` (Qwen2.5-VL) and
    ``vlm-8b`` (Qwen3-VL)."""
    builtin_template: str = "chatml"
    """Chat template of the built-in model (``chatml``, ``qwen3``, ``qwen3_thinking``, ``llama3``)."""
    builtin_dir: Optional[str] = None
    """Where the built-in model is built and cached; None uses ``~/.cache/turnrl/models``."""
    expects_pretrained: bool = False
    """The recipe is made for a pretrained model given as ``path``: without one, a run says at start that it
    trains the built-in model from random weights (a smoke run: success stays near 0)."""
    dtype: str = "auto"
    """``auto`` (bf16 on GPU, fp32 on CPU), ``float32``, ``bfloat16`` or ``float16``."""
    device: str = "auto"
    """``auto`` (cuda if available), ``cpu``, ``cuda`` or ``cuda:N``."""
    gradient_checkpointing: bool = False
    """Trade compute for memory in training: each decoder layer (and a trained vision tower's blocks) keeps only
    its input from the forward pass and recomputes the rest in the backward."""
    checkpointed_layers: Optional[int] = None
    """With ``gradient_checkpointing``, how many of the decoder's layers recompute their activations, the first
    N (as Megatron's ``recompute_num_layers``); the others keep theirs, which costs memory and saves their
    recomputation, about a quarter of their share of the update. None: every layer. ``turnrl memory`` says how
    few fit the GPU."""
    compile: bool = False
    """``torch.compile`` each decoder layer's norms and MLP (and a VLM's vision blocks'), and the rotary embedding
    its attention calls with the cast to bf16 that follows it under autocast (and a VLM's vision tower's rotary
    embedding), and the scoring head's arithmetic on each chunk of logits
    (:func:`turnrl.training.head.chosen_logprobs`), for the training and scoring passes (SFT and RL) and the
    tower's encoding in the rollout: their elementwise kernels fuse (see
    :func:`turnrl.models.loading.compile_layer_parts`); the first passes compile."""
    attention: str = "sdpa"
    """The attention of the trainer's forward passes: ``sdpa`` (PyTorch's; packed rows of
    ``algorithm.micro_batch_tokens`` attend sequence by sequence, see :mod:`turnrl.training.packed_attention`) or
    ``eager`` (transformers' plain implementation; no packed rows)."""
    packed_attention: str = "auto"
    """The kernel packed rows attend each sequence with (``model.attention=sdpa``): ``flash`` (SDPA's flash
    kernel), ``cudnn`` (cuDNN's, each sequence at its length rounded up to 128 tokens, so that a run plans few
    shapes; 1.5-1.7x flash's speed on an H200 at a VLM step's shapes) or ``auto`` (``cudnn`` on a Hopper GPU,
    else ``flash``). See :mod:`turnrl.training.packed_attention`."""
    train_vision: bool = False
    """VLMs: train the vision encoder too (full weights or LoRA); by default it is frozen."""
    encode_images_once: bool = True
    """VLMs with a frozen vision encoder: encode each image of an RL step once and give its features to every
    pass of the step (logprob check, reference, values, PPO epochs; see turnrl/training/image_features.py);
    false encodes them again in every pass. A trained encoder always encodes in every pass. Under FSDP each
    process holds a frozen encoder whole and keeps its own rows' features."""
    rollout_image_features: bool = True
    """With ``encode_images_once``: the step's passes start from the features the engine computed for the
    rollout's images, so no pass encodes an image again (one process rolling out with the engine, the local
    backend; other backends roll out elsewhere and encode in the step's first pass). The engine keeps a host
    copy of each image's features, 2 bytes x hidden size per image token in bf16 (four times that with
    Qwen3-VL's deepstack levels), for one step. false: the step's first pass encodes them."""
    min_pixels: Optional[int] = None
    """VLMs: the fewest pixels an image is resized to (Qwen-VL: multiples of 28 x 28); None keeps the model's."""
    max_pixels: Optional[int] = None
    """VLMs: the most pixels an image is resized to, which bounds its visual tokens; None keeps the model's."""
    backend: str = "auto"
    """How the policy generates: ``engine`` (KV cache kept across turns, continuous batching, CUDA graphs;
    Llama-family text models), ``hf`` (transformers' ``generate``; any model, VLMs included), ``auto``
    (the engine on a GPU where it can run the model, else hf), or ``my_package.module:my_backend``
    (turnrl/policy/factory.py, docs/extending.md)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine's settings."""

    def validate(self) -> None:
        check_choice("model.dtype", self.dtype, ["auto", "float32", "bfloat16", "float16"])
        check_choice("model.device", re.sub(r"^cuda:\d+$", "cuda:N", self.device), ["auto", "cpu", "cuda", "cuda:N"])
        for key in ("min_pixels", "max_pixels"):
            if getattr(self, key) is not None:
                check_range(f"model.{key}", getattr(self, key), 1)
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ConfigError(f"model.min_pixels={self.min_pixels} exceeds model.max_pixels={self.max_pixels}")
        check_choice("model.builtin_template", self.builtin_template, sorted(TEMPLATES))
        # model.backend and model.engine.families name objects of upper layers' registries: checked where a run
        # builds its policy (turnrl.policy.factory.check_model_choices), and by TrainConfig.validate at load time.
        if self.checkpointed_layers is not None:
            check_range("model.checkpointed_layers", self.checkpointed_layers, 0)
            if not self.gradient_checkpointing:
                raise ConfigError(f"model.checkpointed_layers={self.checkpointed_layers} chooses the layers that "
                                  "gradient checkpointing recomputes: set model.gradient_checkpointing=true too (or "
                                  "leave model.checkpointed_layers unset)")
        check_choice("model.attention", self.attention, ["sdpa", "eager"])
        check_choice("model.packed_attention", self.packed_attention, ["auto", "flash", "cudnn"])
        self.engine.validate()


@dataclass
class GroupsConfig:
    n_groups: int = 8
    """Groups of episodes per rollout; a group shares one seed."""
    group_size: int = 8
    """Episodes per group."""
    env_workers: int = 0
    """Threads stepping envs; 0 steps them in the calling thread."""

    def validate(self) -> None:
        check_range("groups.n_groups", self.n_groups, 1)
        check_range("groups.group_size", self.group_size, 1)
        check_range("groups.env_workers", self.env_workers, 0)


LEVELS_PER_SEED = 10_000_000
"""Training levels a seed has to itself with ``seeds.levels_follow_seed``: a step takes ``groups.n_groups`` (times
the rounds of dynamic sampling), so 10 million last 100,000 steps of 100 groups."""


@dataclass
class SeedConfig:
    seed: int = 0
    """Seed of torch, numpy and Python's random (model init, sampling, shuffling). By default the envs' levels
    do not depend on it: runs that differ only in ``seed`` train on the same levels, step for step, and differ
    in what they sample (``levels_follow_seed`` draws each seed's own levels)."""
    train_start: int = 10_000
    """First env seed of training; each step takes fresh seeds."""
    val_start: int = 0
    """First env seed of validation; validation seeds are fixed."""
    val_size: int = 10_000
    """Seeds reserved for validation; they never overlap training seeds."""
    levels_follow_seed: bool = False
    """Train seed ``s`` on levels from ``train_start + s * LEVELS_PER_SEED`` on: runs of different seeds are then
    independent replicates, levels and all (validation keeps its levels, so their numbers compare). Off: every
    seed trains on the same levels step for step, a paired design (two rows of one seed see the same levels)."""

    def first_train_seed(self) -> int:
        """The env seed of the first training level."""
        return self.train_start + (self.seed * LEVELS_PER_SEED if self.levels_follow_seed else 0)

    def validate(self) -> None:
        # The rule of turnrl.envs.seeds.SeedSplits, checked here to name the keys.
        check_range("seeds.val_size", self.val_size, 1)
        check_range("seeds.val_start", self.val_start, 0)  # Gymnasium's reset takes non-negative seeds
        if self.levels_follow_seed:
            check_range("seeds.seed", self.seed, 0)  # a negative seed would draw validation levels
        val_end = self.val_start + self.val_size
        if self.train_start < val_end:
            raise ConfigError(f"seeds.train_start={self.train_start} would overlap the validation seeds "
                              f"[{self.val_start}, {val_end}) (training seeds run upwards without end); put "
                              f"seeds.train_start at or above {val_end}")


# --------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class KeyDoc:
    """One settable key of a config: its dotted name, its default and its one-line documentation."""

    key: str
    default: Any
    doc: str


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (the string literal that follows it), by name.

    Dataclass fields keep no docstrings at run time, so they are read from the class's source; a class
    whose source cannot be read (built in a REPL) gives an empty mapping.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
                assert isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def config_keys(config: Any, prefix: str = "") -> list[KeyDoc]:
    """Every settable key of a config dataclass or instance (sections flattened to ``a.b``), its value
    (the default, for a class) and its doc. A section's defaults are its parent's (``EvalConfig``'s
    sampling temperature is 0.5, not ``SamplingConfig``'s 1.0)."""
    instance = config() if isinstance(config, type) else config
    docs = field_docs(type(instance))
    keys = []
    for f in fields(instance):
        value = getattr(instance, f.name)
        if is_dataclass(value):
            keys.extend(config_keys(value, f"{prefix}{f.name}."))
        else:
            keys.append(KeyDoc(f"{prefix}{f.name}", value, docs.get(f.name, "")))
    return keys


def _allowed_keys(cls: type) -> list[str]:
    return [item.key for item in config_keys(cls)]


def given_keys(path: str | Path | None = None, overrides: list[str] | None = None,
               skip_sections: Collection[str] = ()) -> set[str]:
    """The dotted keys that a YAML file and ``key=value`` overrides set (what a command was told, as
    opposed to defaults); sections count as set with every key inside them. Unreadable input gives what
    could be read: :func:`load_config` reports the problem."""
    keys: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                keys.add(f"{prefix}{name}")
                walk(value, f"{prefix}{name}.")

    if path is not None and Path(path).is_file():
        try:
            data = parse_yaml(Path(path).read_text())
        except (yaml.YAMLError, UnicodeDecodeError):
            data = None
        if isinstance(data, dict):
            walk({k: v for k, v in data.items() if k not in skip_sections}, "")
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        parts = key.split(".")
        keys.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return keys


def text_keys(cls: type, prefix: str = "") -> set[str]:
    """The dotted keys of dataclass ``cls`` (and of the dataclasses in it) whose field is typed ``str``,
    ``Optional[str]`` or ``list[str]``: there a value is the text as written, though YAML reads ``off`` as false,
    ``1e3`` as a float and ``007`` as 7 (which OmegaConf then writes back as ``'False'``, ``'1000.0'``, ``'7'``)."""
    keys = set()
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        hint = hints[f.name]
        if hint is str or hint == Optional[str] or hint == list[str]:
            keys.add(prefix + f.name)
        elif is_dataclass(hint):
            keys |= text_keys(hint, f"{prefix}{f.name}.")  # type: ignore[arg-type]
    return keys


def _as_written(layer: DictConfig, written: Any, keys: set[str]) -> None:
    """Put back, in ``layer``, the text as written (``written``: the same mapping with every scalar a string) at each
    of ``keys`` where YAML read a boolean or a number (a value, or an item of a list)."""
    for key in keys:
        value = OmegaConf.select(layer, key, default=None)
        text = written
        for part in key.split("."):
            text = text.get(part) if isinstance(text, dict) else None
        if isinstance(value, (bool, int, float)) and isinstance(text, str):
            OmegaConf.update(layer, key, text, merge=False)
        elif isinstance(value, ListConfig) and isinstance(text, list) and len(text) == len(value):
            items = [item if isinstance(item, str) or not isinstance(as_text, str) else as_text
                     for item, as_text in zip(list(value), text)]
            OmegaConf.update(layer, key, items, merge=False)


def _check_shapes(problem: str | None) -> None:
    """Stop at a value of a shape its key does not take, before OmegaConf's merge, whose messages name its own
    classes (``Cannot assign int to Dict[str, Any]``) or fail in the reading of text keys (a section as a list)."""
    if problem is not None:
        raise ConfigError(problem)


def _check_known(written: Any, shapes: dict[str, KeyShape]) -> None:
    """Stop at a key that no config key is, named whole as written (OmegaConf names only its first unknown part,
    ``generator`` of ``generator.max_turns``), with the turnrl key for a source system's name or the close ones."""
    key = unknown_key(written, shapes)
    if key is not None:
        raise ConfigError(unknown_key_problem(key, shapes))


def _file_layer(path: Path, shapes: dict[str, KeyShape], keys_as_text: set[str],
                skip_sections: Collection[str]) -> DictConfig:
    """The layer that the YAML file ``path`` sets, less its ``skip_sections``."""
    try:
        layer = OmegaConf.load(path)
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {yaml_problem(error)}") from error
    except UnicodeDecodeError as error:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {error.start}): is it the YAML "
                          "file meant?") from error
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys (key: value), not a list or a "
                          "scalar")
    for section in skip_sections:
        layer.pop(section, None)
    container = OmegaConf.to_container(layer)
    _check_shapes(shape_problem(container, shapes, file=str(path)))
    _check_known(container, shapes)
    _as_written(layer, yaml.load(path.read_text(), Loader=yaml.BaseLoader), keys_as_text)
    return layer


def _override_layer(item: str, shapes: dict[str, KeyShape], keys_as_text: set[str]) -> DictConfig:
    """The layer that the override ``item`` (``key=value``) sets, its value read as YAML; a text key whose value
    YAML cannot read takes it as written (RAGEN's action separator ``||`` starts a YAML block scalar)."""
    key, text = (part.strip() for part in item.split("=", 1))
    try:
        layer = OmegaConf.from_dotlist([item])
    except yaml.YAMLError as error:
        shape = shapes.get(key)
        if shape is not None and shape.kind == "value" and shape.is_text:
            return OmegaConf.create(nested_mapping(key, text))
        _check_known(nested_mapping(key, text), shapes)  # an unknown key first: quoting would not help it
        quote = '"' if "'" in text else "'"
        as_text = "" if shape is not None else f"; for the text as written, quote it: {key}={quote}{text}{quote}"
        problem = yaml_problem(error, where=False)
        raise ConfigError(f"override {item!r}: the value is not valid YAML: {problem}{as_text}") from error
    container = OmegaConf.to_container(layer)
    _check_shapes(shape_problem(container, shapes, override=item))
    _check_known(container, shapes)
    try:
        written: Any = yaml.load(text, Loader=yaml.BaseLoader)  # every scalar a string, as typed
    except yaml.YAMLError:  # OmegaConf's grammar reads what YAML does not (a tab, "0\t0"): as text, as written
        return layer
    _as_written(layer, nested_mapping(key, written), keys_as_text)
    return layer


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    skip_sections: Collection[str] = (),
) -> T:
    """Load ``cls`` from an optional YAML file plus ``key=value`` overrides.

    ``skip_sections`` names top-level sections of the YAML file that are
    dropped rather than rejected (e.g. the training sections of a recipe read
    for evaluation); overrides are never skipped.

    Raises:
        ConfigError: unknown key, wrong type, malformed override or invalid choice.
    """
    base = OmegaConf.structured(cls)
    shapes = key_shapes(cls)
    layers = []
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a folder; pass a YAML file")
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            layers.append(_file_layer(path, shapes, text_keys(cls), skip_sections))
        except RecursionError:  # OmegaConf and PyYAML build a node a level by recursion: some hundred levels
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {TOO_DEEP}") from None
        except OmegaConfBaseException as error:  # an interpolation that does not read or resolve: ${, ${nothing}
            raise ConfigError(f"config file {str(path)!r}: {format_omegaconf_error(error)}") from None
    for item in overrides or []:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            layers.append(_override_layer(item, shapes, text_keys(cls)))
        except RecursionError:
            raise ConfigError(f"override {item.split('=', 1)[0].strip()}=...: the value is {TOO_DEEP}") from None
        except IndexError:  # OmegaConf's splitting of a key such as [
            raise ConfigError(f"override {item[:200]!r}: its key is no dotted name; write key=value, e.g. "
                              "agent.max_turns=5") from None
        except OmegaConfBaseException as error:  # an interpolation that does not read or resolve: ${, ${nothing}
            raise ConfigError(f"override {item[:200]!r}: {format_omegaconf_error(error)}") from None
    try:
        merged = OmegaConf.merge(base, *layers)
        config = OmegaConf.to_object(merged)
    except TypeError as error:  # a list met a mapping: a key=value whose dotted key goes into a list, or a value
        indexed = [item for item in overrides or [] if re.search(r"\.\d+(\.|=)", item.split("=", 1)[0] + "=")]
        found = (container_mismatch(OmegaConf.to_container(base), OmegaConf.to_container(layer)) for layer in layers)
        mismatch = None if indexed else next(filter(None, found), None)
        named = f"override {indexed[0]!r} sets" if indexed else "an override sets"
        raise ConfigError(mismatch or f"{named} an item of a list by its index, which overrides cannot do ({error}); "
                          "set the whole list, e.g. variants=[{name: big, settings: {size: 8}}]") from error
    except OmegaConfBaseException as error:
        message = format_omegaconf_error(error)
        if "not in" in message:
            # A key inside a list's item (``variants``), which _check_known leaves to OmegaConf. One line, with the
            # likely key: ~110 keys on a line help nobody.
            message = message.split(". Did you mean", 1)[0].rstrip(".")
            key = getattr(error, "full_key", None) or ""
            near = close_keys(str(key), _allowed_keys(cls))
            hint = f"did you mean {' or '.join(near)}? " if near else ""
            message += f"; {hint}`turnrl config show` lists every key with its default"
        raise ConfigError(message) from error
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config  # type: ignore[return-value]


def to_yaml(config: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
