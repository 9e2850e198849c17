"""One-line messages for a config that cannot load: what is wrong, at which key, and what to write instead.

Pure functions of what the user wrote (a YAML file's mapping, or an override's as nested mappings), the
declared types of the config dataclasses, and the errors of PyYAML and OmegaConf, whose own texts name
OmegaConf's classes (``ListConfig``, ``Dict[str, Any]``) or a list index the user never wrote.
:mod:`turnrl.config` raises them as ``ConfigError``.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import yaml
from omegaconf.errors import OmegaConfBaseException

from turnrl.registry import close_names

PLACEHOLDERS = {"section": "{KEY: VALUE}", "mapping": "{KEY: VALUE}", "list": "[a, b]", "value": "VALUE"}
"""What a message writes for a value of each kind of key, in its examples."""


@dataclass(frozen=True)
class KeyShape:
    """What one config key takes, read from its declared type."""

    kind: str
    """``section`` (a dataclass of keys), ``mapping`` (a dict), ``list``, or ``value`` (a number, text, ...)."""
    nullable: bool
    """Whether null is allowed (``Optional[...]``)."""
    is_text: bool = False
    """Whether it takes a text (``str``)."""
    choices: tuple[Any, ...] = ()
    """The values a ``Literal`` type allows; empty for any of its type."""


def key_shapes(cls: type, prefix: str = "") -> dict[str, KeyShape]:
    """The shape of every key of dataclass ``cls`` and of the dataclasses in it, by dotted key (sections too)."""
    shapes = {}
    hints = typing.get_type_hints(cls)
    for item in fields(cls):
        hint, key = hints[item.name], f"{prefix}{item.name}"
        nullable = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
        if nullable:
            hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        origin = typing.get_origin(hint) or hint
        if is_dataclass(hint):
            shapes[key] = KeyShape("section", nullable)
            shapes.update(key_shapes(hint, f"{key}."))  # type: ignore[arg-type]
        else:
            kind = "mapping" if origin is dict else "list" if origin is list else "value"
            choices = typing.get_args(hint) if origin is typing.Literal else ()
            shapes[key] = KeyShape(kind, nullable, hint is str, choices)
    return shapes


def nested(key: str, text: str) -> str:
    """``a.b.c`` set to ``text`` as a YAML file writes it: ``a: {b: {c: text}}``."""
    first, *rest = key.split(".")
    for part in reversed(rest):
        text = f"{{{part}: {text}}}"
    return f"{first}: {text}"


def nested_mapping(key: str, value: Any) -> dict[str, Any]:
    """``a.b.c`` set to ``value`` as a mapping: ``{"a": {"b": {"c": value}}}``."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def flow(value: Any) -> str:
    """``value`` as YAML on one line (``{steps: 2}``, ``[1, 2]``, ``Sokoban``)."""
    return str(yaml.safe_dump(value, default_flow_style=True, width=10**9)).strip().removesuffix("...").strip()


def choice_problem(key: str, value: Any, allowed: tuple[Any, ...] | list[Any]) -> str | None:
    """Why ``value`` is not one of the ``allowed`` values of ``key``, with the likely one of a typo; None if it is."""
    if value in allowed:
        return None
    near = close_names(str(value), [str(choice) for choice in allowed], n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    return f"{key}={value!r} is not allowed; choose one of {list(allowed)}{hint}"


def shape_problem(written: Any, shapes: Mapping[str, KeyShape], override: str | None = None,
                  file: str = "") -> str | None:
    """The first key in ``written`` whose value its type does not take, said with what to write instead: a list or
    a value for a section or a mapping, a mapping or a value for a list, a list or a mapping for a value, null
    for a key that needs a value, a value outside a ``Literal``'s choices, or (in a file) a dotted key. None if
    every key takes its value or is unknown (OmegaConf names unknown keys, with the close ones).

    ``override``: the ``key=value`` that ``written`` was read from; None for the config file named ``file``.
    """

    def walk(node: Any, prefix: str) -> str | None:
        for name, value in node.items() if isinstance(node, dict) else ():
            key = f"{prefix}{name}"
            if override is None and "." in str(name):
                return (f"config file {file!r} writes the dotted key {str(name)!r}; a file nests its keys, as "
                        f"{nested(key, flow(value))} (dotted keys are for overrides: {key}={flow(value)})")
            shape = shapes.get(key)
            problem = None if shape is None else _value_problem(key, shape, value, override, file)
            if problem is None and shape is not None and shape.kind == "section":
                problem = walk(value, f"{key}.")
            if problem is not None:
                return problem
        return None

    return walk(written, "")


def _value_problem(key: str, shape: KeyShape, value: Any, override: str | None, file: str) -> str | None:
    def example(text: str) -> str:
        return f"{key}={text}" if override is not None else nested(key, text)

    if value is None and override is not None and not override.split("=", 1)[1].strip():
        return f"override {override!r} gives no value; write {key}=VALUE (`turnrl config show` lists every key)"
    if shape.kind == "section" and not isinstance(value, dict):
        if override is not None:
            return (f"override {override!r} gives a value to the section {key}; set its keys, e.g. {key}.KEY=VALUE "
                    "(`turnrl config show` lists them)")
        return (f"config file {file!r} gives a value to the section {key} ({nested(key, flow(value))}); a section "
                f"takes a mapping of its keys, e.g. {example('{KEY: VALUE}')} (`turnrl config show` lists them)")
    if value is None:
        if shape.nullable:
            return None
        if shape.is_text:
            return (f"config key {key!r} takes a text, not null; write {example('TEXT')}, or "
                    f"{example(repr('null'))} for the word itself")
        return f"config key {key!r} needs a value, not null; write {example(PLACEHOLDERS[shape.kind])}"
    if shape.kind == "mapping" and not isinstance(value, dict):
        return f"config key {key!r} takes a mapping, e.g. {example('{KEY: VALUE}')}"
    if shape.kind == "list" and not isinstance(value, list):
        if isinstance(value, dict) and all(str(index).isdigit() for index in value):
            return None  # an override of a list's item by its index (`sampling.stop.0=x`): load_config says so
        none = "" if isinstance(value, dict) else f" ({example('[]')} for none)"
        return f"config key {key!r} takes a list, e.g. {example('[a, b]')}{none}"
    if shape.kind == "value" and isinstance(value, (dict, list)):
        given = "mapping" if isinstance(value, dict) else "list"
        return f"config key {key!r} takes one value, not a {given}; write {example('VALUE')}"
    return choice_problem(key, value, shape.choices) if shape.choices else None


def container_mismatch(default: Any, given: Any, key: str = "") -> str | None:
    """The fix where ``given`` has a list for a mapping of ``default`` or the reverse (merge's TypeError names none)."""
    if isinstance(default, dict) and isinstance(given, dict):
        found = (container_mismatch(default.get(name), given[name], f"{key}.{name}".lstrip(".")) for name in given)
        return next(filter(None, found), None)
    wanted: dict[type, str] = {dict: f"a mapping, e.g. {key}={{KEY: VALUE}}", list: f"a list, e.g. {key}=[a, b]"}
    return f"config key {key!r} takes {wanted[type(default)]}" if {type(default), type(given)} == {dict, list} else None


def yaml_problem(error: yaml.YAMLError, where: bool = True) -> str:
    """PyYAML's error on one line: what is wrong, and (``where``) the line and column of the file where it is
    (its own text takes four lines, two of them the context's place)."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem is None:
        return " ".join(str(error).split())
    mark = error.problem_mark
    return f"{error.problem} at line {mark.line + 1}, column {mark.column + 1}" if where and mark else error.problem


def format_omegaconf_error(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None)
    message = str(error).splitlines()[0]
    return f"config key {key!r}: {message}" if key else message


def close_keys(key: str, allowed: list[str], n: int = 3) -> list[str]:
    """The allowed keys closest to a mistyped ``key``: by the whole dotted name, then by its last part
    (``max_turn`` finds ``agent.max_turns``; ``sampling.temprature`` finds ``sampling.temperature``); a
    mistyped section (``samplng``) finds its section."""
    sections = sorted({name.rsplit(".", 1)[0] for name in allowed if "." in name})
    allowed = [*allowed, *sections]
    matches = difflib.get_close_matches(key, allowed, n=n, cutoff=0.75)
    leaf = key.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for name in allowed:
        by_leaf.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    for near in difflib.get_close_matches(leaf, list(by_leaf), n=n, cutoff=0.75):
        matches.extend(name for name in by_leaf[near] if name not in matches)
    return matches[:n]


# --------------------------------------------------------------------------- the sources' names for turnrl's keys
@dataclass(frozen=True)
class SourceSetting:
    """A setting of a source system under the name its users type, and what turnrl writes for it."""

    source: str
    """Whose name it is: ``RAGEN``, ``VAGEN``, ``verl`` (RAGEN and VAGEN train with verl, so its names are
    theirs too) or ``SkyRL``."""
    name: str
    """Its dotted path in the source's config (``actor_rollout_ref.actor.use_kl_loss``)."""
    turnrl: str
    """The turnrl key, or ``key=value``, that does its work."""
    note: str = ""
    """Where the meaning or the values differ, in a few words. It and ``turnrl`` name turnrl's keys only (a test
    loads every dotted name in them)."""
    short: tuple[str, ...] = ()
    """Shorter forms people type: the bare leaf (``use_kl_loss``), or the leaf under turnrl's section."""


SOURCE_SETTINGS: tuple[SourceSetting, ...] = (
    # RAGEN's own keys (config/base.yaml, config/envs.yaml of mll-lab-nu/RAGEN)
    SourceSetting("RAGEN", "agent_proxy.max_turn", "agent.max_turns"),
    SourceSetting("RAGEN", "custom_envs.ENV.max_actions_per_traj", "agent.max_actions_per_episode",
                  short=("max_actions_per_traj",)),
    SourceSetting("RAGEN", "agent_proxy.max_actions_per_turn", "agent.max_actions_per_turn"),
    SourceSetting("RAGEN", "custom_envs.ENV.max_tokens", "agent.response_length_hint",
                  "only the agent.prompt_layout=ragen prompt's \"Max response length\" line; "
                  "sampling.max_new_tokens stops responses"),
    SourceSetting("RAGEN", "custom_envs.ENV.env_instruction", "agent.task_instructions",
                  "the text as RAGEN's env list holds it, spaces and newlines kept, with the symbol line RAGEN "
                  "appends for a grid observation; the layout writes the action lines", short=("env_instruction",)),
    SourceSetting("RAGEN", "agent_proxy.action_sep", "agent.action_separator", short=("action_sep",)),
    SourceSetting("RAGEN", "agent_proxy.max_context_window", "agent.max_context_window",
                  "RAGEN's -1, the full history, is null"),
    SourceSetting("RAGEN", "agent_proxy.enable_think", "agent.format",
                  "true is agent.format=ragen, false agent.format=ragen_no_think", short=("enable_think",)),
    SourceSetting("RAGEN", "agent_proxy.use_turn_scores", "algorithm.reward_placement",
                  "true is algorithm.reward_placement=per_turn, false, the sum at the last token, "
                  "algorithm.reward_placement=episode_end", short=("use_turn_scores",)),
    SourceSetting("RAGEN", "es_manager.format_penalty", "agent.no_action_penalty", short=("format_penalty",)),
    SourceSetting("RAGEN", "es_manager.train.env_groups", "groups.n_groups"),
    SourceSetting("RAGEN", "es_manager.train.group_size", "groups.group_size"),
    SourceSetting("RAGEN", "es_manager.val.env_groups", "validation.episodes"),
    SourceSetting("RAGEN", "es_manager.val.group_size", "validation.samples_per_seed"),
    SourceSetting("RAGEN", "seed.train", "seeds.train_start"),
    SourceSetting("RAGEN", "seed.val", "seeds.val_start"),
    SourceSetting("RAGEN", "model_path", "model.path"),
    SourceSetting("RAGEN", "micro_batch_size_per_gpu", "algorithm.micro_batch_size",
                  "or algorithm.micro_batch_tokens for passes packed by tokens"),
    SourceSetting("RAGEN", "lora.rank", "lora.r", "RAGEN's 0, no LoRA, is lora.enabled=false"),
    SourceSetting("RAGEN", "actor_rollout_ref.rollout.rollout_filter_strategy", "algorithm.filter.method",
                  "top_k_abs is top_k with algorithm.filter.value above 1, a count of groups",
                  short=("rollout_filter_strategy", "filter.strategy")),
    SourceSetting("RAGEN", "actor_rollout_ref.rollout.rollout_filter_value", "algorithm.filter.value",
                  short=("rollout_filter_value",)),
    SourceSetting("RAGEN", "actor_rollout_ref.rollout.rollout_filter_metric", "algorithm.filter.metric",
                  "reward_variance, a group's reward std, is reward_std; reward is reward_mean, length length_mean",
                  short=("rollout_filter_metric",)),
    SourceSetting("RAGEN", "actor_rollout_ref.rollout.rollout_filter_top_p_prob_mode", "algorithm.filter.weighting",
                  short=("rollout_filter_top_p_prob_mode",)),
    SourceSetting("RAGEN", "actor_rollout_ref.rollout.rollout_filter_include_zero",
                  "algorithm.filter.drop_zero_variance",
                  "the reverse: false is algorithm.filter.drop_zero_variance=true",
                  short=("rollout_filter_include_zero",)),
    SourceSetting("RAGEN", "actor_rollout_ref.rollout.rollout_filter_empty_stop_steps",
                  "collapse.stop_after_empty_steps", short=("rollout_filter_empty_stop_steps",)),
    SourceSetting("RAGEN", "algorithm.bi_level_gae", "algorithm.advantage=gae",
                  "RAGEN's, with its reward at the last token, is plain GAE over the episode's tokens; VAGEN's "
                  "turn-level GAE of per-turn rewards is algorithm.advantage=bilevel_gae",
                  short=("bi_level_gae",)),
    SourceSetting("RAGEN", "algorithm.high_level_gamma", "algorithm.gamma_turn", "VAGEN's too",
                  short=("high_level_gamma",)),
    # VAGEN's own keys (its scripts' rollout_manager and data settings, and each env's env_config)
    SourceSetting("VAGEN", "rollout_manager.max_turns", "agent.max_turns"),
    SourceSetting("VAGEN", "rollout_manager.n_trajectory", "groups.group_size", short=("n_trajectory",)),
    SourceSetting("VAGEN", "rollout_manager.window_size", "agent.max_context_window",
                  "VAGEN counts the turns before the current one: its N is agent.max_context_window of N + 1"),
    SourceSetting("VAGEN", "rollout_manager.use_multi_turn_reward", "algorithm.reward_placement",
                  "true is algorithm.reward_placement=per_turn, false, the sum at the last token, "
                  "algorithm.reward_placement=episode_end", short=("use_multi_turn_reward",)),
    SourceSetting("VAGEN", "data.max_trajectory_length", "agent.max_context_tokens",
                  "an episode whose next turn would not fit ends; VAGEN cuts the sequence it trains",
                  short=("max_trajectory_length",)),
    SourceSetting("VAGEN", "ENV.env_config.prompt_format", "agent.format", short=("prompt_format",)),
    SourceSetting("VAGEN", "ENV.env_config.max_actions_per_step", "agent.max_actions_per_turn",
                  short=("max_actions_per_step",)),
    SourceSetting("VAGEN", "ENV.env_config.format_reward", "agent.format_reward"),
    SourceSetting("VAGEN", "ENV.env_config.use_state_reward", "rewards.extra",
                  "true adds the grounding and worldmodel reward functions, as the VAGEN-Full recipes list them",
                  short=("use_state_reward",)),
    # verl's keys, which RAGEN and VAGEN recipes set (verl/trainer/config/ppo_trainer.yaml)
    SourceSetting("verl", "algorithm.adv_estimator", "algorithm.advantage",
                  "the same names, but reinforce_plus_plus is reinforce_pp", short=("adv_estimator",)),
    SourceSetting("verl", "algorithm.norm_adv_by_std_in_grpo", "algorithm.advantage=drgrpo",
                  "false; true is algorithm.advantage=grpo", short=("norm_adv_by_std_in_grpo",)),
    SourceSetting("verl", "algorithm.gamma", "algorithm.gamma_token",
                  "and algorithm.gamma_turn, the discount from a turn's last token to the next turn"),
    SourceSetting("verl", "algorithm.lam", "algorithm.lambda_token",
                  "and algorithm.lambda_turn, from a turn's last token to the next turn"),
    SourceSetting("verl", "algorithm.use_kl_in_reward", "algorithm.kl_in_reward", short=("use_kl_in_reward",)),
    SourceSetting("verl", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef",
                  "the KL's weight in the rewards with algorithm.kl_in_reward=true"),
    SourceSetting("verl", "algorithm.kl_penalty", "algorithm.kl_kind", "kl is k1, mse k2, low_var_kl k3"),
    SourceSetting("verl", "actor_rollout_ref.actor.use_kl_loss", "algorithm.kl_coef",
                  "false is algorithm.kl_coef=0; algorithm.kl_in_reward=true puts the KL in the rewards instead "
                  "of the loss", short=("use_kl_loss",)),
    SourceSetting("verl", "actor_rollout_ref.actor.kl_loss_coef", "algorithm.kl_coef", short=("kl_loss_coef",)),
    SourceSetting("verl", "actor_rollout_ref.actor.kl_loss_type", "algorithm.kl_kind",
                  "kl is k1, mse k2, low_var_kl k3", short=("kl_loss_type",)),
    SourceSetting("verl", "actor_rollout_ref.actor.entropy_coeff", "algorithm.entropy_coef",
                  short=("entropy_coeff",)),
    SourceSetting("verl", "actor_rollout_ref.actor.clip_ratio_low", "algorithm.clip_low", short=("clip_ratio_low",)),
    SourceSetting("verl", "actor_rollout_ref.actor.clip_ratio_high", "algorithm.clip_high",
                  short=("clip_ratio_high",)),
    SourceSetting("verl", "actor_rollout_ref.actor.clip_ratio_c", "algorithm.dual_clip", short=("clip_ratio_c",)),
    SourceSetting("verl", "actor_rollout_ref.actor.loss_agg_mode", "algorithm.loss_aggregation",
                  short=("loss_agg_mode",)),
    SourceSetting("verl", "actor_rollout_ref.actor.ppo_epochs", "algorithm.ppo_epochs"),
    SourceSetting("verl", "actor_rollout_ref.actor.ppo_mini_batch_size", "algorithm.mini_batch_size",
                  "verl counts prompts times rollout n, turnrl samples", short=("ppo_mini_batch_size",)),
    SourceSetting("verl", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "algorithm.micro_batch_size",
                  "or algorithm.micro_batch_tokens for passes packed by tokens"),
    SourceSetting("verl", "actor_rollout_ref.actor.optim.lr", "optim.actor_lr"),
    SourceSetting("verl", "actor_rollout_ref.actor.optim.lr_warmup_steps", "optim.warmup_steps"),
    SourceSetting("verl", "actor_rollout_ref.actor.optim.weight_decay", "optim.weight_decay"),
    SourceSetting("verl", "actor_rollout_ref.actor.optim.betas", "optim.adam_beta1",
                  "and optim.adam_beta2, one key each"),
    SourceSetting("verl", "actor_rollout_ref.actor.grad_clip", "optim.grad_clip"),
    SourceSetting("verl", "critic.optim.lr", "optim.critic_lr"),
    SourceSetting("verl", "critic.cliprange_value", "algorithm.value_clip", short=("cliprange_value",)),
    SourceSetting("verl", "actor_rollout_ref.model.path", "model.path"),
    SourceSetting("verl", "actor_rollout_ref.model.lora_rank", "lora.r", "0, no LoRA, is lora.enabled=false",
                  short=("lora_rank",)),
    SourceSetting("verl", "actor_rollout_ref.model.enable_gradient_checkpointing", "model.gradient_checkpointing",
                  short=("enable_gradient_checkpointing",)),
    SourceSetting("verl", "actor_rollout_ref.rollout.max_model_len", "model.engine.max_seq_len",
                  "the tokens of one sequence, prompt and response; agent.max_context_tokens bounds an episode's "
                  "context", short=("max_model_len",)),
    SourceSetting("verl", "actor_rollout_ref.rollout.response_length", "sampling.max_new_tokens",
                  short=("response_length",)),
    SourceSetting("verl", "data.max_response_length", "sampling.max_new_tokens"),
    SourceSetting("verl", "actor_rollout_ref.rollout.temperature", "sampling.temperature"),
    SourceSetting("verl", "actor_rollout_ref.rollout.top_p", "sampling.top_p"),
    SourceSetting("verl", "actor_rollout_ref.rollout.top_k", "sampling.top_k", "verl's -1, off, is 0"),
    SourceSetting("verl", "actor_rollout_ref.rollout.val_kwargs.temperature", "validation.temperature"),
    SourceSetting("verl", "actor_rollout_ref.rollout.n", "groups.group_size",
                  "a group's episodes share a seed as rollout n samples share a prompt"),
    SourceSetting("verl", "data.train_batch_size", "groups.n_groups",
                  "prompts per step: each group plays one seed groups.group_size times", short=("train_batch_size",)),
    SourceSetting("verl", "trainer.total_training_steps", "run.steps", short=("total_training_steps",)),
    SourceSetting("verl", "trainer.experiment_name", "run.name", short=("experiment_name",)),
    SourceSetting("verl", "trainer.project_name", "run.wandb_project"),
    SourceSetting("verl", "trainer.save_freq", "run.save_every", "verl's -1, never, is 0: at the end only",
                  short=("save_freq",)),
    SourceSetting("verl", "trainer.test_freq", "validation.every",
                  "verl's -1, never, is 0: before and after training only", short=("test_freq",)),
    SourceSetting("verl", "trainer.max_actor_ckpt_to_keep", "run.keep_checkpoints", "null, keep all, is 0"),
    SourceSetting("verl", "trainer.critic_warmup", "algorithm.critic_warmup_steps"),
    SourceSetting("verl", "trainer.n_gpus_per_node", "distributed.nproc_per_node"),
    # SkyRL's keys (skyrl/train/config/ppo_base_config.yaml; the VisGym recipe's scripts)
    SourceSetting("SkyRL", "generator.max_turns", "agent.max_turns"),
    SourceSetting("SkyRL", "generator.n_samples_per_prompt", "groups.group_size", short=("n_samples_per_prompt",)),
    SourceSetting("SkyRL", "generator.sampling_params.temperature", "sampling.temperature"),
    SourceSetting("SkyRL", "generator.sampling_params.top_p", "sampling.top_p"),
    SourceSetting("SkyRL", "generator.sampling_params.top_k", "sampling.top_k", "SkyRL's -1, off, is 0"),
    SourceSetting("SkyRL", "generator.sampling_params.max_generate_length", "sampling.max_new_tokens",
                  short=("max_generate_length",)),
    SourceSetting("SkyRL", "trainer.policy.model.path", "model.path"),
    SourceSetting("SkyRL", "trainer.policy.optimizer_config.lr", "optim.actor_lr"),
    SourceSetting("SkyRL", "trainer.critic.optimizer_config.lr", "optim.critic_lr"),
    SourceSetting("SkyRL", "trainer.policy.optimizer_config.max_grad_norm", "optim.grad_clip",
                  short=("max_grad_norm",)),
    SourceSetting("SkyRL", "trainer.algorithm.advantage_estimator", "algorithm.advantage",
                  "the same names, but reinforce++ is reinforce_pp", short=("advantage_estimator",)),
    SourceSetting("SkyRL", "trainer.algorithm.use_kl_loss", "algorithm.kl_coef",
                  "false is algorithm.kl_coef=0; algorithm.kl_in_reward=true puts the KL in the rewards instead "
                  "of the loss"),
    SourceSetting("SkyRL", "trainer.algorithm.kl_loss_coef", "algorithm.kl_coef"),
    SourceSetting("SkyRL", "trainer.algorithm.kl_estimator_type", "algorithm.kl_kind", "k1, k2, k3 alike",
                  short=("kl_estimator_type",)),
    SourceSetting("SkyRL", "trainer.algorithm.grpo_norm_by_std", "algorithm.advantage=drgrpo",
                  "false; true is algorithm.advantage=grpo", short=("grpo_norm_by_std",)),
    SourceSetting("SkyRL", "trainer.algorithm.lambd", "algorithm.lambda_token",
                  "and algorithm.lambda_turn, from a turn's last token to the next turn", short=("lambd",)),
    SourceSetting("SkyRL", "trainer.algorithm.gamma", "algorithm.gamma_token",
                  "and algorithm.gamma_turn, the discount from a turn's last token to the next turn"),
    SourceSetting("SkyRL", "trainer.algorithm.eps_clip_low", "algorithm.clip_low", short=("eps_clip_low",)),
    SourceSetting("SkyRL", "trainer.algorithm.eps_clip_high", "algorithm.clip_high", short=("eps_clip_high",)),
    SourceSetting("SkyRL", "trainer.algorithm.clip_ratio_c", "algorithm.dual_clip"),
    SourceSetting("SkyRL", "trainer.train_batch_size", "groups.n_groups",
                  "prompts per step: each group plays one seed groups.group_size times"),
    SourceSetting("SkyRL", "trainer.policy_mini_batch_size", "algorithm.mini_batch_size",
                  "SkyRL counts prompts times n_samples_per_prompt, turnrl samples",
                  short=("policy_mini_batch_size",)),
    SourceSetting("SkyRL", "trainer.update_epochs_per_batch", "algorithm.ppo_epochs",
                  short=("update_epochs_per_batch",)),
    SourceSetting("SkyRL", "trainer.eval_interval", "validation.every", short=("eval_interval",)),
    SourceSetting("SkyRL", "trainer.ckpt_interval", "run.save_every", short=("ckpt_interval",)),
    SourceSetting("SkyRL", "trainer.max_ckpts_to_keep", "run.keep_checkpoints", "SkyRL's -1, keep all, is 0",
                  short=("max_ckpts_to_keep",)),
    SourceSetting("SkyRL", "trainer.run_name", "run.name"),
    SourceSetting("SkyRL", "trainer.seed", "seeds.seed"),
    SourceSetting("SkyRL", "trainer.gradient_checkpointing", "model.gradient_checkpointing"),
)
"""The sources' settings by the names their users type, each with the turnrl key that does its work; an unknown
key that names one gets its hint (docs/fidelity.md, "Source settings by name", renders the same table)."""

TURNRL_SETTING = re.compile(r"\b([a-z_]+(?:\.[a-z_0-9]+)+)(?:=([\w\-]+))?")
"""A turnrl key in a setting's text, with the value it is given there if any (``algorithm.kl_coef=0``)."""


def setting_keys(setting: SourceSetting) -> list[tuple[str, str | None]]:
    """The turnrl keys that ``setting``'s texts name, each with the value written for it (None for none)."""
    return [(key, value or None) for key, value in TURNRL_SETTING.findall(f"{setting.turnrl} {setting.note}")]


def source_settings_named(key: str) -> list[SourceSetting]:
    """The source settings that ``key`` names: one's dotted path or a shorter form of it, whole or at the end of
    ``key`` after a dot (``trainer.algorithm.use_kl_loss``, ``algorithm.use_kl_loss``, ``max_actions_per_traj``).
    Those that ``key`` names by their whole path (``generator.max_turns``) win over those named by a short form.
    ``ENV`` in a path stands for any one env tag (``custom_envs.CoordSokoban.max_tokens``)."""
    def ends_with(form: str) -> bool:
        segments = (r"[^.]+" if segment == "ENV" else re.escape(segment) for segment in form.split("."))
        return re.fullmatch(r"(?:.+\.)?" + r"\.".join(segments), key) is not None

    by_path = [setting for setting in SOURCE_SETTINGS if ends_with(setting.name)]
    return by_path or [setting for setting in SOURCE_SETTINGS if any(map(ends_with, setting.short))]


def source_hint(key: str, allowed: Collection[str]) -> str | None:
    """What turnrl writes for the source setting that ``key`` names, said as "verl's X is turnrl's Y"; None when it
    names none, or one whose turnrl keys the config has not (``turnrl eval`` has no ``algorithm`` section)."""
    found = [setting for setting in source_settings_named(key)
             if all(name in allowed for name, _ in setting_keys(setting))]
    said: dict[tuple[str, str], list[str]] = {}  # one turnrl setting, named by several sources, is said once
    for setting in found:
        said.setdefault((setting.turnrl, setting.note), []).append(f"{setting.source}'s {setting.name}")
    parts = []
    for (turnrl, note), names in said.items():
        verb = "is" if len(names) == 1 else "are"
        parts.append(f"{' and '.join(names)} {verb} turnrl's {turnrl}{f' ({note})' if note else ''}")
    return "; ".join(parts) or None


def unknown_key(written: Any, shapes: Mapping[str, KeyShape]) -> str | None:
    """The first key in ``written`` that is no config key, whole as written: down to its first value inside an
    unknown section (``generator.max_turns``, not ``generator``), so that a hint can match its leaf. Keys inside a
    mapping or a list key are that key's own (env settings, a list's items) and never unknown here."""

    def first_value(node: Any, key: str) -> str:
        while isinstance(node, dict) and node:
            name, node = next(iter(node.items()))
            key = f"{key}.{name}"
        return key

    def walk(node: Any, prefix: str) -> str | None:
        for name, value in node.items() if isinstance(node, dict) else ():
            key = f"{prefix}{name}"
            shape = shapes.get(key)
            if shape is None:
                return first_value(value, key)
            found = walk(value, f"{key}.") if shape.kind == "section" else None
            if found is not None:
                return found
        return None

    return walk(written, "")


def unknown_key_problem(key: str, shapes: Mapping[str, KeyShape]) -> str:
    """The message for an unknown ``key``: what turnrl writes for the source setting it names, else the config
    keys closest to it, matched on the whole key (the leaf included)."""
    hint = source_hint(key, shapes)
    if hint is not None:
        return f"unknown config key {key!r}: {hint}; `turnrl config show` lists every key with its default"
    near = close_keys(key, [name for name, shape in shapes.items() if shape.kind != "section"])
    did_you_mean = f"did you mean {' or '.join(near)}? " if near else ""
    return f"unknown config key {key!r}; {did_you_mean}`turnrl config show` lists every key with its default"


def source_settings_table() -> str:
    """:data:`SOURCE_SETTINGS` as a Markdown table (docs/fidelity.md, "Source settings by name")."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| source | its setting (also typed as) | turnrl |", "| --- | --- | --- |"]
    for setting in SOURCE_SETTINGS:
        short = f" ({', '.join(f'`{form}`' for form in setting.short)})" if setting.short else ""
        note = f" ({cell(setting.note)})" if setting.note else ""
        rows.append(f"| {setting.source} | `{setting.name}`{short} | `{setting.turnrl}`{note} |")
    return "\n".join(rows)
