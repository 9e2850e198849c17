"""Making SFT data from expert demos: the chats tokenized in one process against ``--workers`` processes
(``sft.data_workers``); seconds and the ratio, measured in the same run, with the demos' own time beside.

The demos are a recipe's (its env, agent and SFT settings; ``--episodes`` of them), tokenized with the
built-in model's tokenizer as ``turnrl train`` does before SFT.

    python benchmarks/sft_data.py --config configs/sokoban_quickstart.yaml --episodes 20000 --workers 8
    python benchmarks/sft_data.py --episodes 2000 --workers 2       # the 2-core CI machine
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.agent.formats import get_format  # noqa: E402
from turnrl.config import load_config  # noqa: E402
from turnrl.envservice.placement import env_factory  # noqa: E402
from turnrl.models.loading import base_model_path, load_tokenizer  # noqa: E402
from turnrl.training.config import TrainConfig  # noqa: E402
from turnrl.training.sft import chat_samples, expert_demos, trajectory_messages  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/sokoban_quickstart.yaml")
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = parser.parse_args()
    config = load_config(TrainConfig, args.config, [*args.overrides, f"sft.episodes={args.episodes}"])
    tokenizer = load_tokenizer(base_model_path(config.model))
    agent = config.agent
    fmt = get_format(agent.format, action_separator=agent.action_separator,
                     max_actions_per_turn=agent.max_actions_per_turn)
    start = time.perf_counter()
    demos = expert_demos(env_factory(config.env.id, dict(config.env.settings), config.env.remote), fmt, agent,
                         config.sft, config.env.id)
    chats = [trajectory_messages(demo) for demo in demos]
    demo_seconds = time.perf_counter() - start
    seconds, counts = {}, {}
    for workers in (1, args.workers):
        start = time.perf_counter()
        samples = chat_samples(chats, tokenizer, agent.max_context_window, max_images=agent.max_images,
                               workers=workers)
        seconds[workers], counts[workers] = time.perf_counter() - start, len(samples)
    assert counts[1] == counts[args.workers], "both ways make the same samples"
    print(f"{args.config}: {len(chats)} demos played in {demo_seconds:.1f} s, {counts[1]} samples")
    for workers, taken in seconds.items():
        print(f"  {workers} process{'es' if workers > 1 else ''}: {taken:7.1f} s  {seconds[1] / taken:5.2f}x")


if __name__ == "__main__":
    main()
