"""Where a recipe's budgets end its episodes when every response runs to ``sampling.max_new_tokens``, as a
random-weights model's do (a speed benchmark's episodes): each episode's turns and tokens, played with responses
of random tokens through the recipe's env, tokenizer, chat template and image processor. No model runs.

The rollout ends an episode whose next turn would not fit the smallest of ``agent.max_context_tokens``, the
engine's row (``model.engine.max_seq_len``, which ``model.backend=auto`` takes on a GPU) and the model's context
window (left out here): a benchmark whose row is shorter than its episodes times fewer turns than its recipe
names. A trained sequence ends with the last response ("to its last response's end"); an episode cut before a
turn also holds that turn's observation.

    python benchmarks/episode_length.py --config configs/visgym_maze.yaml model.builtin_preset=vlm-0.5b
    python benchmarks/episode_length.py --config configs/visgym_maze.yaml model.builtin_preset=vlm-0.5b \\
        model.engine.max_seq_len=4096

``vlm-0.5b`` has ``vlm-3b``'s tokenizer and image size, so its episodes are ``vlm-3b``'s token for token, and its
files are small to build. The last line says how many of the longest sequences share one of the update's packed
passes (``algorithm.micro_batch_tokens``): one a pass runs it half empty.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.agent.formats import get_format  # noqa: E402
from turnrl.config import SamplingConfig, load_config  # noqa: E402
from turnrl.envservice.placement import env_factory  # noqa: E402
from turnrl.models.loading import base_model_path, load_processor, load_tokenizer  # noqa: E402
from turnrl.models.vision import ImageEncoder  # noqa: E402
from turnrl.policy.interface import Completion, GenerationRequest, Policy  # noqa: E402
from turnrl.rollout.runner import EpisodeSlot, Rollout  # noqa: E402
from turnrl.training.memory import pairing_budget  # noqa: E402
from turnrl.training.train_config import TrainConfig  # noqa: E402


class FullLengthResponses(Policy):
    """Writes ``max_new_tokens`` tokens drawn uniformly from the non-special vocabulary, every turn."""

    def __init__(self, tokenizer: object, image_encoder: ImageEncoder | None, max_sequence_tokens: int | None,
                 seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.image_encoder = image_encoder
        self.max_sequence_tokens = max_sequence_tokens
        special = set(tokenizer.all_special_ids)  # type: ignore[attr-defined]
        self.vocabulary = np.array([i for i in range(len(tokenizer)) if i not in special])  # type: ignore[arg-type]
        self.rng = np.random.default_rng(seed)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        completions = []
        for request in requests:
            ids = [int(i) for i in self.rng.choice(self.vocabulary, size=request.max_new_tokens or
                                                   sampling.max_new_tokens)]
            completions.append(Completion(text=self.tokenizer.decode(ids), token_ids=ids,  # type: ignore[attr-defined]
                                          logprobs=[0.0] * len(ids), finish_reason="length"))
        return completions


def passes_line(longest: int, micro_batch_tokens: int) -> str:
    """What the update's passes make of sequences of up to ``longest`` tokens: how many share a packed pass of
    ``algorithm.micro_batch_tokens`` (one a pass leaves it about half empty: ``actor/pass_fill``), and the budget
    that pairs two (:func:`~turnrl.training.memory.pairing_budget`)."""
    pair = pairing_budget(longest)
    if micro_batch_tokens <= 0:
        return f"the update's passes are padded rows (algorithm.micro_batch_tokens=0); packed, {pair} tokens hold two"
    fit = micro_batch_tokens // longest if longest else 0
    return (f"the update's packed passes of {micro_batch_tokens} tokens hold {fit} sequence{'s' if fit != 1 else ''} "
            f"of {longest}; {pair} tokens hold two")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a training recipe")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("overrides", nargs="*", help="key=value, as turnrl train takes them")
    args = parser.parse_args()
    config = load_config(TrainConfig, args.config, args.overrides)
    model = config.model
    path = base_model_path(model)
    processor = load_processor(path, model.min_pixels, model.max_pixels)
    row = model.engine.max_seq_len if model.backend in ("engine", "auto") else None  # auto: as on a GPU
    policy = FullLengthResponses(load_tokenizer(path), ImageEncoder(processor) if processor is not None else None,
                                 row)
    agent = config.agent
    fmt = get_format(agent.format, action_separator=agent.action_separator,
                     max_actions_per_turn=agent.max_actions_per_turn)
    make_env = env_factory(config.env.id, config.env.settings, [])
    slots = [EpisodeSlot(env=make_env(), seed=config.seeds.val_start + i, group=i) for i in range(args.episodes)]
    trajectories = Rollout(policy, fmt, agent, config.env.id).run(slots, config.sampling)
    print(f"{args.config}: responses of {config.sampling.max_new_tokens} tokens, agent.max_turns={agent.max_turns}, "
          f"agent.max_context_tokens={agent.max_context_tokens}, the engine's row {row or '-'} "
          f"(model.backend={model.backend})")
    ends = Counter(t.truncation_reason or t.status for t in trajectories)
    turns = Counter(len(t.turns) for t in trajectories)
    streams = [t.tokens.stream() for t in trajectories if t.tokens is not None]
    whole = [len(stream.input_ids) for stream in streams]
    answered = [stream.turn_end_positions[-1] + 1 for stream in streams]  # to the last response's last token
    print(f"episodes {len(trajectories)}: ended by {dict(ends)}; turns {dict(sorted(turns.items()))}; tokens an "
          f"episode {min(whole)}-{max(whole)}, to its last response's end {min(answered)}-{max(answered)}")
    print(passes_line(max(answered), config.algorithm.micro_batch_tokens))


if __name__ == "__main__":
    main()
