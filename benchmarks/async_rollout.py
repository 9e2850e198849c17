"""The asynchronous mode against the synchronous trainer at equal wall time: steps, tokens/s and success.

Both rows start from the same SFT model with the same config and seed, and train for ``--seconds`` of wall
time each (validation before and after is not counted):

- ``sync``: :class:`~turnrl.training.trainer.Trainer`, rollout and update in turn on ``model.device``;
- ``async``: the same trainer with the asynchronous backend (:mod:`turnrl.training.backends.asynchronous`),
  the rollout on ``--rollout-device`` one batch ahead (``distributed.max_staleness``), truncated importance
  weights correcting the lag.

Both use recomputed old log-probs and ``algorithm.tis_cap`` so that only the overlap differs. Printed per
row: steps done, seconds a step and of each phase, generated tokens/s, the mean training success of the last
five steps, validation success after (and every ``--validate-every`` seconds of training: the learning curves,
validation success against training time; an asynchronous row's rollout thread finishes the batch it is playing
while a validation waits for it, off the clock, so each validation gives that row up to one batch of rollout for
free: keep them few, and time the steps-an-hour rows without them), and the steps ratio over ``sync`` measured in the same run (seconds a step of
``sync`` over the row's, so that rows of different lengths compare).

    python benchmarks/async_rollout.py --config configs/sokoban_quickstart.yaml --seconds 150 \\
        --rollout-device cuda:1                                     # two GPUs: trainer cuda:0, rollout cuda:1
    python benchmarks/async_rollout.py --quick                       # CPU, the tiny model
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from turnrl.config import load_config  # noqa: E402
from turnrl.training.train_config import TrainConfig  # noqa: E402
from turnrl.training.run_dir import start_run  # noqa: E402
from turnrl.training.sft import sft_stage  # noqa: E402
from turnrl.training.trainer import Trainer  # noqa: E402

QUICK = ["model.builtin_preset=tiny", "model.device=cpu", "model.dtype=float32", "env.id=FrozenLake",
         "agent.max_turns=2", "sampling.max_new_tokens=8", "groups.n_groups=2", "groups.group_size=2",
         "validation.episodes=4", "sft.episodes=32", "run.threads=1"]
COMMON = ["run.tensorboard=false", "run.trajectories_every=0", "run.steps=100000", "run.overwrite=true",
          "algorithm.old_logprobs=recompute", "algorithm.tis_cap=2.0"]


def train_for(trainer: Trainer, seconds: float, warmup_steps: int = 0, validate_every_s: float = 0.0
              ) -> dict[str, Any]:
    """``warmup_steps`` untimed steps (compilation, the allocator's first growth), then RL steps until ``seconds``
    of training have passed; validation every ``validate_every_s`` seconds of training (0: only after), its own
    time not counted (an asynchronous rollout waits for it: :meth:`RolloutBackend.exclusive`)."""
    for step in range(warmup_steps):
        trainer.step(step)
    rows = []
    curve: list[tuple[float, float]] = []
    """(seconds of training, validation success) after the step that passed each ``validate_every_s``."""
    wall = 0.0
    step = warmup_steps
    while wall < seconds:
        start = time.time()
        rows.append(trainer.step(step).metrics)
        wall += time.time() - start
        step += 1
        if validate_every_s > 0 and wall < seconds and wall >= (len(curve) + 1) * validate_every_s:
            curve.append((wall, trainer.validate().metrics["val/success"]))
    trainer.close()  # an async trainer drops the batch it rolled out ahead
    after = trainer.validate().metrics["val/success"]
    curve.append((wall, after))
    generated = sum(r["rollout/response_tokens_mean"] * r["rollout/turns_mean"] * r["rollout/episodes"] for r in rows)
    last = rows[-5:]
    timed = len(rows)
    phases = {key: sum(r.get(f"timing/{key}_s", 0.0) for r in rows) / timed
              for key in ("rollout", "old_logprobs", "reference", "update")}
    return {"steps": timed, "wall_s": wall, "step_s": wall / timed,
            **{f"{key}_s": value for key, value in phases.items()},
            "publish_s": sum(r.get("async/publish_s", 0.0) for r in rows) / timed,
            "wait_rollout_s": sum(r.get("async/wait_rollout_s", 0.0) for r in rows) / timed, "generated_per_s": generated / wall,
            "train_success_last5": sum(r["rollout/success"] for r in last) / len(last), "val_success_after": after,
            "staleness_mean": sum(r.get("async/staleness", 0.0) for r in rows) / len(rows),
            "tis_weight_mean": sum(r.get("actor/tis_weight_mean", 1.0) for r in rows) / len(rows),
            "curve": [(round(t, 1), round(success, 4)) for t, success in curve]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--rollout-device", default=None, help="the async row's rollout device (e.g. cuda:1)")
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="steps of each row before its clock starts (a compiled model's first step)")
    parser.add_argument("--validate-every", type=float, default=0.0,
                        help="seconds of training between validations (the learning curve); 0: after only")
    parser.add_argument("--only", choices=["sync", "async"], default=None, help="one row alone")
    parser.add_argument("--quick", action="store_true", help="the tiny model on CPU, 20 s a row")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    seconds = 20.0 if args.quick else args.seconds
    overrides = (QUICK if args.quick else []) + COMMON + args.overrides
    with tempfile.TemporaryDirectory() as tmp:
        base = load_config(TrainConfig, args.config, [*overrides, f"run.output_dir={tmp}", "run.name=sft"])
        sft_model = sft_stage(base, start_run(base, stage="sft")).model_path if base.sft.enabled else None
        rows: dict[str, dict[str, Any]] = {}
        modes = {"sync": [], "async": ["distributed.async_rollout=true", f"distributed.max_staleness={args.staleness}",
                                       *([f"distributed.rollout_device={args.rollout_device}"]
                                         if args.rollout_device else [])]}
        before = None
        for name, extra in modes.items():
            if args.only is not None and name != args.only:
                continue
            config = load_config(TrainConfig, args.config, [*overrides, *extra, f"run.output_dir={tmp}",
                                                             f"run.name={name}", "sft.enabled=false"])
            trainer = Trainer(config, start_model=sft_model)  # the config picks the backend
            if before is None:
                before = trainer.validate().metrics["val/success"]
            rows[name] = train_for(trainer, seconds, args.warmup_steps, args.validate_every)
            print(name, json.dumps({k: v if k == "curve" else round(v, 4) for k, v in rows[name].items()}), flush=True)
            del trainer
            gc.collect()  # the next row's models on the same devices
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print(f"\nvalidation success before RL: {before:.3f}; {seconds:.0f} s of training each\n")
    print("| mode | steps | s a step | rollout | old log-probs | reference | update | publish | waiting for the rollout "
          "| generated tokens/s | training success (last 5) | validation success after | staleness | TIS weight "
          "| speed / sync |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, row in rows.items():
        ratio = f"{rows['sync']['step_s'] / row['step_s']:.2f}x" if "sync" in rows else "-"
        print(f"| {name} | {row['steps']} | {row['step_s']:.2f} | {row['rollout_s']:.2f} | {row['old_logprobs_s']:.2f} | "
              f"{row['reference_s']:.2f} | {row['update_s']:.2f} | {row['publish_s']:.2f} | {row['wait_rollout_s']:.2f} | "
              f"{row['generated_per_s']:,.0f} | {row['train_success_last5']:.3f} | {row['val_success_after']:.3f} | "
              f"{row['staleness_mean']:.2f} | {row['tis_weight_mean']:.3f} | {ratio} |")
    print("\nvalidation success against seconds of training (the learning curves):")
    for name, row in rows.items():
        points = ", ".join(f"{t:.0f} s: {success:.3f}" for t, success in [(0.0, before), *row["curve"]])
        print(f"- {name}: {points}")


if __name__ == "__main__":
    main()
