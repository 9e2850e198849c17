"""The RL algorithm's section of a training recipe (``algorithm.*``): the advantage estimator and its settings,
the policy loss, the KL, the group filter. Apart from the rest of :class:`~turnrl.training.train_config.TrainConfig`
for its size: every estimator, loss and filter of ``turnrl.algorithms`` is chosen and checked here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from turnrl.algorithms.advantages import Placement
from turnrl.algorithms.estimators import (
    ESTIMATORS,
    EstimatorSpec,
    SharedSettings,
    estimator_names,
    get_estimator,
    param_names,
)
from turnrl.algorithms.filters import OnEmpty, Strategy, Weighting
from turnrl.algorithms.losses import POLICY_LOSSES, Aggregation, KLKind, PolicyLoss, PolicyLossSettings
from turnrl.config import (
    ConfigError,
    check_choice,
    check_range,
    check_registered,
    close_keys,
)


def default_estimator_params() -> dict[str, dict[str, Any]]:
    """The defaults of every registered estimator that has parameters, by name (what ``turnrl config show``
    lists and a run's config.yaml records)."""
    return {name: asdict(get_estimator(name).params()) for name in estimator_names()
            if param_names(get_estimator(name))}


def parse_estimator_params(spec: EstimatorSpec, given: Mapping[str, Any]) -> Any:
    """``spec.params`` built from ``algorithm.estimator_params.<name>``, each value checked (and converted)
    against its field's type as every other key is.

    Raises:
        ConfigError: a key the estimator does not take (naming those it takes), or a value it refuses.
    """
    key = f"algorithm.estimator_params.{spec.name}"
    allowed = param_names(spec)
    for name in given:
        if name not in allowed:
            near = close_keys(name, list(allowed))
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            takes = f"its parameters: {', '.join(allowed)}" if allowed else "it takes none"
            raise ConfigError(f"{key}.{name} is not a parameter of the {spec.name} estimator ({takes}){hint}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(spec.params), dict(given)))
    except OmegaConfBaseException as error:
        name = getattr(error, "full_key", None) or ""
        value = given.get(name, "") if name else ""
        raise ConfigError(f"{key}.{name}={value!r}: {str(error).splitlines()[0]}") from error
    except ValueError as error:  # the params' own check (__post_init__)
        raise ConfigError(f"{key}: {error}") from error


@dataclass
class FilterConfig:
    """StarPO-S: keep the groups whose rollouts disagree most."""

    method: Strategy = "none"
    """``none``, ``top_k``, ``top_p`` or ``min_p``."""
    value: float = 0.25
    """top_k: share of groups (<=1) or count (>1); top_p: cumulative mass; min_p: share of the best score."""
    metric: str = "reward_std"
    """Group score: ``reward_std``, ``reward_mean``, ``length_mean``, or ``random`` (a number drawn from the
    group's env seed: as many groups, chosen blind to their rewards, the control for ``reward_std``)."""
    weighting: Weighting = "linear"
    """top_p weighting of the scores: ``linear`` or ``softmax``."""
    drop_zero_variance: bool = False
    """Drop groups whose rewards are all equal (they carry no GRPO signal)."""
    on_empty: OnEmpty = "skip"
    """When nothing is kept: ``skip`` the step or ``keep_all``."""

    def validate(self) -> None:
        check_choice("algorithm.filter.method", self.method, ["none", "top_k", "top_p", "min_p"])
        check_choice("algorithm.filter.metric", self.metric, ["reward_std", "reward_mean", "length_mean", "random"])
        check_choice("algorithm.filter.weighting", self.weighting, ["linear", "softmax"])
        check_choice("algorithm.filter.on_empty", self.on_empty, ["skip", "keep_all"])
        check_range("algorithm.filter.value", self.value, 0.0)


@dataclass
class AlgorithmConfig:
    advantage: str = "gae"
    """Estimator, by its registered name (turnrl/algorithms/estimators.py): ``gae``, ``bilevel_gae``,
    ``turn_gae``, ``grpo``, ``drgrpo``, ``rloo``, ``reinforce_pp``, ``gigpo``, one registered by you, or
    ``my_package.module:my_estimator`` (docs/extending.md)."""
    estimator_params: dict[str, dict[str, Any]] = field(default_factory=default_estimator_params)
    """Each estimator's own settings, by estimator name, checked against its parameters (only the chosen
    estimator's are used): ``gigpo: {gamma: 0.95, step_weight: 1.0, norm_by_std: false}``, or
    ``algorithm.estimator_params.gigpo.gamma=0.9`` on the command line."""
    reward_placement: Placement = "per_turn"
    """``per_turn``: each turn's reward at its last token; ``episode_end``: the sum at the last token."""
    sample_mode: str = "trajectory"
    """``trajectory``: a whole episode is one sample (StarPO); ``turn``: one sample per turn."""
    gamma_token: float = 1.0
    """Discount from one token to the next inside a turn (gae, bilevel_gae, reinforce_pp). 1 (RAGEN) makes
    a response one action; below 1, a response's early tokens see less of its end reward (0.99 over 100
    tokens: 0.37)."""
    lambda_token: float = 1.0
    """GAE lambda from one token to the next inside a turn (gae, bilevel_gae)."""
    gamma_turn: float = 1.0
    """Discount from a turn to the next (gae, bilevel_gae, turn_gae, reinforce_pp), whatever the responses'
    lengths: the horizon is about 1 / (1 - gamma_turn) turns (0.95: 20 turns; RAGEN: 1, VAGEN: 0.95)."""
    lambda_turn: float = 1.0
    """GAE lambda from a turn to the next (gae, bilevel_gae, turn_gae)."""
    whiten_advantages: bool = True
    """Whiten critic-based advantages over the batch's loss tokens."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.28
    """PPO ratio clip above 1 (clip-higher)."""
    dual_clip: Optional[float] = 3.0
    """Dual-clip bound c for negative advantages; None disables."""
    value_clip: Optional[float] = 0.5
    """Value-loss clip range; None disables."""
    entropy_coef: float = 0.001
    """Weight of the entropy bonus."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference policy (RAGEN: 0; paper 0.001)."""
    kl_kind: KLKind = "k3"
    """KL estimator: ``k1``, ``k2`` or ``k3``."""
    kl_in_reward: bool = False
    """Subtract the KL from the token rewards instead of adding it to the loss."""
    policy_loss: str = "ppo"
    """The policy loss (turnrl/algorithms/losses.py): ``ppo`` (the clipped surrogate; GSPO with
    ``ratio_level=sequence``), or ``my_package.module:my_loss`` (docs/extending.md)."""
    loss_aggregation: Aggregation = "token-mean"
    """``token-mean``, ``seq-mean-token-mean`` or ``seq-mean-token-sum``."""
    old_logprobs: str = "sampler"
    """PPO's old log-probs: ``sampler`` (those sampled with) or ``recompute`` (a forward pass). Either way the
    step reports ``actor/logprob_mismatch``, how far training's forward drifts from the sampler's: with
    ``sampler`` from the update's first mini-batch (no pass of its own), with ``recompute`` over the batch."""
    ratio_level: str = "token"
    """``token``: PPO's per-token ratio; ``sequence``: GSPO's length-normalized sequence ratio (GSPO clips
    it tightly: clip_low 3e-4, clip_high 4e-4 in its paper)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling, instead of the StarPO-S filter: keep rolling out new groups until
    ``groups.n_groups`` groups have rewards that differ (groups whose episodes with outcomes all score alike are
    dropped; an errored episode is left out of its group, which keeps its other episodes), with at most
    ``dynamic_sampling_rounds`` extra rounds of ``n_groups`` groups."""
    dynamic_sampling_rounds: int = 3
    """Extra rollout rounds a step may take for dynamic sampling."""
    tis_cap: Optional[float] = None
    """Truncated importance weights between the trainer's recomputed log-probs and the sampler's, capped
    here (e.g. 2.0), multiply each token's policy loss; None disables. Needs ``old_logprobs=recompute``."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    target_kl: Optional[float] = None
    """Stop the actor's epochs for the step at the first mini-batch whose approximate KL to the sampling
    policy (``actor/approx_kl``) exceeds 1.5 x this, before its optimizer step (Stable-Baselines3's rule;
    e.g. 0.02); the critic trains on. Bounds how far the many optimizer steps of a step (mini-batches x
    epochs) move the policy. Costs a read of the device a mini-batch. None: every mini-batch steps."""
    rollback_kl: Optional[float] = None
    """Undo the actor's optimizer step after which a mini-batch's approximate KL to the sampling policy
    (``actor/approx_kl``, read by the next mini-batch's passes, or by a pass without a backward after the last
    step) exceeds this, and stop the actor for the step; logged as ``actor/rolled_back``. ``target_kl`` stops the
    steps after such a jump; this takes the jump back. A small policy can lose its answer format in a single
    optimizer step (approx KL from under 0.02 to above 1; docs/benchmarks.md, the quickstart), from which GRPO
    cannot return: every episode of every group then scores alike. Costs a copy of the actor's trained weights
    and their optimizer state before each optimizer step (memory: about three times those weights in float32
    again, with Adam) and that last pass. None: off."""
    mini_batch_size: int = 32
    """Samples per optimizer step."""
    micro_batch_size: int = 8
    """Samples per forward/backward (gradient accumulation up to the mini-batch), when
    ``micro_batch_tokens`` is 0."""
    micro_batch_tokens: int = 0
    """Above 0: forward/backward passes take as many samples as fit in this many tokens, laid end to end
    without padding (packed; each sample attends only to itself), each sample, longest first, put in the pass it
    fills best; a longer sample runs alone. 0: passes of ``micro_batch_size`` samples, padded to the longest."""
    score_micro_batch_tokens: int = 0
    """Above 0: the passes that only score (PPO's recomputed old log-probs, the reference's, the critic's values,
    the sampler check's rows) pack up to this many tokens each; 0: they are cut as the update's are. A pass
    without a backward holds one layer's working set at a time, not every layer's, so it can take several times
    the update's tokens (verl's separate log-prob micro-batches), in fewer and larger matrix products."""
    critic_warmup_steps: int = 0
    """Steps that train only the critic."""
    filter: FilterConfig = field(default_factory=FilterConfig)

    @property
    def estimator(self) -> EstimatorSpec:
        """The estimator that ``advantage`` names (registered, or ``module:attr``)."""
        return get_estimator(self.advantage)

    @property
    def policy_loss_fn(self) -> PolicyLoss:
        """The policy loss that ``policy_loss`` names (registered, or ``module:attr``)."""
        return POLICY_LOSSES.get(self.policy_loss)

    @property
    def policy_loss_settings(self) -> PolicyLossSettings:
        """The settings a policy loss reads."""
        return PolicyLossSettings(self.clip_low, self.clip_high, self.dual_clip, self.loss_aggregation,
                                  self.ratio_level)

    @property
    def uses_critic(self) -> bool:
        return self.estimator.critic

    @property
    def params(self) -> Any:
        """The chosen estimator's parameters (its params dataclass) from ``estimator_params``."""
        spec = self.estimator
        return parse_estimator_params(spec, self.estimator_params.get(spec.name, {}))

    @property
    def shared_settings(self) -> SharedSettings:
        """The settings that every estimator may read."""
        return SharedSettings(self.gamma_token, self.lambda_token, self.gamma_turn, self.lambda_turn,
                              self.whiten_advantages)

    def validate(self) -> None:
        check_registered("algorithm.advantage", self.advantage, ESTIMATORS)  # imports a module:attr's module
        check_registered("algorithm.policy_loss", self.policy_loss, POLICY_LOSSES)
        for name, given in self.estimator_params.items():
            if name not in estimator_names():
                raise ConfigError(f"algorithm.estimator_params.{name}: no estimator is registered as {name!r}; "
                                  f"choose one of {list(estimator_names())}")
            parse_estimator_params(get_estimator(name), given)
        check_choice("algorithm.reward_placement", self.reward_placement, ["per_turn", "episode_end"])
        check_choice("algorithm.sample_mode", self.sample_mode, ["trajectory", "turn"])
        check_choice("algorithm.kl_kind", self.kl_kind, ["k1", "k2", "k3"])
        check_choice(
            "algorithm.loss_aggregation",
            self.loss_aggregation,
            ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
        )
        check_choice("algorithm.old_logprobs", self.old_logprobs, ["sampler", "recompute"])
        check_choice("algorithm.ratio_level", self.ratio_level, ["token", "sequence"])
        check_range("algorithm.dynamic_sampling_rounds", self.dynamic_sampling_rounds, 0)
        if self.dynamic_sampling and self.filter.method != "none":
            raise ConfigError(
                "algorithm.dynamic_sampling replaces the StarPO-S filter: set algorithm.filter.method=none"
            )
        if self.tis_cap is not None:
            check_range("algorithm.tis_cap", self.tis_cap, 1e-6)
            if self.old_logprobs != "recompute":
                raise ConfigError(
                    "algorithm.tis_cap weighs the sampler's tokens by the trainer's recomputed log-probs: "
                    "set algorithm.old_logprobs=recompute (with sampler log-probs as old ones, every weight is 1)"
                )
        for key in ("gamma_turn", "lambda_turn", "gamma_token", "lambda_token"):
            check_range(f"algorithm.{key}", getattr(self, key), 0.0, 1.0)
        check_range("algorithm.ppo_epochs", self.ppo_epochs, 1)
        # A negative clip puts the ratio's lower bound above 1 (or the upper below it); a negative KL weight
        # pushes the policy away from the reference; a value clip of 0 or less stops the critic.
        check_range("algorithm.clip_low", self.clip_low, 0.0)
        check_range("algorithm.clip_high", self.clip_high, 0.0)
        check_range("algorithm.kl_coef", self.kl_coef, 0.0)
        if self.value_clip is not None:
            check_range("algorithm.value_clip", self.value_clip, 1e-9)
        check_range("algorithm.critic_warmup_steps", self.critic_warmup_steps, 0)
        if self.target_kl is not None:
            check_range("algorithm.target_kl", self.target_kl, 1e-9)
        if self.rollback_kl is not None:
            check_range("algorithm.rollback_kl", self.rollback_kl, 1e-9)
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(
                f"algorithm.dual_clip={self.dual_clip} must be above 1 (RAGEN: 3.0), or null to disable it"
            )
        check_range("algorithm.micro_batch_size", self.micro_batch_size, 1)
        check_range("algorithm.micro_batch_tokens", self.micro_batch_tokens, 0)
        check_range("algorithm.score_micro_batch_tokens", self.score_micro_batch_tokens, 0)
        check_range("algorithm.mini_batch_size", self.mini_batch_size, self.micro_batch_size)
        self.filter.validate()
