"""The token context of a step's episodes: every head and observation rendered by the chat template against
rendered once and remembered (``ChatTemplateDeltas``' memo of text-only messages); seconds and the ratio,
measured in the same run.

A recipe's groups of episodes (``--groups`` levels, ``--group-size`` episodes each, as a GRPO step plays
them; the expert with ``--random-share`` of its moves random stands in for a policy) are played once; then
their token contexts are built as the rollout builds them (the first message, each response, each
observation and the prompt of every turn), ``--steps`` times over new levels and the same validation
levels, each way. Only the context's own work is timed: no model, no env.

    python benchmarks/episode_tokens.py --config configs/sokoban_quickstart.yaml model.builtin_preset=base
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.agent.formats import get_format  # noqa: E402
from turnrl.config import SamplingConfig, load_config  # noqa: E402
from turnrl.envservice.placement import env_factory  # noqa: E402
from turnrl.models.loading import base_model_path, load_tokenizer  # noqa: E402
from turnrl.chat.template_deltas import ChatTemplateDeltas  # noqa: E402
from turnrl.policy.scripted import ExpertPolicy  # noqa: E402
from turnrl.rollout.context import EpisodeTokens  # noqa: E402
from turnrl.rollout.runner import EpisodeSlot, Rollout  # noqa: E402
from turnrl.rollout.trajectory import Trajectory  # noqa: E402
from turnrl.training.train_config import TrainConfig  # noqa: E402


def play(config: TrainConfig, levels: list[int], group_size: int, random_share: float) -> list[Trajectory]:
    """Episodes of the expert on each level, ``group_size`` a level (text only: no tokens yet)."""
    agent = config.agent
    fmt = get_format(agent.format, action_separator=agent.action_separator,
                     max_actions_per_turn=agent.max_actions_per_turn)
    rollout = Rollout(ExpertPolicy(fmt, agent.max_actions_per_turn, seed=0, random_action_share=random_share),
                      fmt, agent, env_id=config.env.id)
    make_env = env_factory(config.env.id, dict(config.env.settings), config.env.remote)
    slots = [EpisodeSlot(env=make_env(), seed=level, group=group) for group, level in enumerate(levels)
             for _ in range(group_size)]
    return rollout.run(slots, SamplingConfig())


def build_contexts(trajectories: list[Trajectory], tokenizer, deltas: ChatTemplateDeltas, window: int | None
                   ) -> int:
    """The rollout's context work for these episodes; returns the prompt tokens made."""
    made = 0
    for trajectory in trajectories:
        tokens = EpisodeTokens(deltas, max_context_window=window)
        turns = trajectory.turns
        tokens.start(trajectory.system_prompt, turns[0].observation)
        for index, turn in enumerate(turns):
            made += len(tokens.prompt())
            tokens.add_response(tokenizer.encode(turn.response, add_special_tokens=False) + [tokenizer.eos_token_id])
            if index + 1 < len(turns):
                tokens.add_observation(turns[index + 1].observation)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/sokoban_quickstart.yaml")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--validation", type=int, default=128, help="validation levels, one episode each")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--random-share", type=float, default=0.5)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = parser.parse_args()
    config = load_config(TrainConfig, args.config, args.overrides)
    tokenizer = load_tokenizer(base_model_path(config.model))
    window = config.agent.max_context_window
    steps = [play(config, list(range(1000 + step * args.groups, 1000 + (step + 1) * args.groups)),
                  args.group_size, args.random_share) for step in range(args.steps)]
    validation = play(config, list(range(args.validation)), 1, args.random_share)
    turns = sum(len(t.turns) for step in steps for t in step) + args.steps * sum(len(t.turns) for t in validation)
    seconds = {}
    for name, memo in (("rendered every time", False), ("remembered", True)):
        deltas = ChatTemplateDeltas(tokenizer, **({} if memo else {"memo_size": 0}))
        start = time.perf_counter()
        for step in steps:
            build_contexts(step, tokenizer, deltas, window)
            build_contexts(validation, tokenizer, deltas, window)  # validation replays its levels
        seconds[name] = time.perf_counter() - start
    print(f"{args.config}: {args.steps} steps of {args.groups} x {args.group_size} episodes and "
          f"{args.validation} validation episodes, {turns} turns")
    base = seconds["rendered every time"]
    for name, taken in seconds.items():
        print(f"  {name:<20} {taken:6.2f} s  {1000 * taken / turns:6.3f} ms a turn  {base / taken:5.2f}x")


if __name__ == "__main__":
    main()
