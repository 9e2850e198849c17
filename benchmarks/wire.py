"""A rollout's images between processes: ``turnrl.training.wire`` against plain pickle, in one run.

What a rollout process sends its trainer (the pool), and what FSDP2 ranks gather after each rollout, are
trajectories whose images travel twice: the frames (uint8 arrays) and their pixel values (bf16 tensors, 0.6 MB
a 224-pixel frame at Qwen2.5-VL's patching). This builds ``--images`` distinct Maze2D-sized frames encoded by
the ``--preset`` VLM's image processor (VisGym's step: 64 episodes x 15 turns, 960 images) and times a message's
round trip both ways: the sender's pickling into a byte tensor, the receiver's copy of it into a buffer of its
own (what the transport hands it) and its unpickling. Each way ``--repeats`` times, alternating; the medians.

    python benchmarks/wire.py                       # vlm-3b's processor, 960 images
    python benchmarks/wire.py --images 96 --repeats 3
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.config import ModelConfig  # noqa: E402
from turnrl.models.builtin import builtin_model_path  # noqa: E402
from turnrl.models.loading import load_processor  # noqa: E402
from turnrl.models.vision import ImageEncoder  # noqa: E402
from turnrl.training import wire  # noqa: E402


def pickle_dumps(value: object) -> torch.Tensor:
    """The way before: the pickle's bytes as a tensor (torch pickles each tensor's storage with torch.save)."""
    return torch.frombuffer(bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def pickle_loads(payload: torch.Tensor) -> object:
    return pickle.loads(payload.numpy().data)


def round_trip(value: object, dumps, loads) -> tuple[float, float, object]:
    """Seconds to pickle and to unpickle ``value``, the payload copied into a fresh buffer between (as received)."""
    start = time.perf_counter()
    payload = dumps(value)
    sent = time.perf_counter() - start
    received = torch.empty_like(payload)
    received.copy_(payload)
    start = time.perf_counter()
    back = loads(received)
    return sent, time.perf_counter() - start, back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="vlm-3b", help="the built-in VLM whose image processor encodes")
    parser.add_argument("--images", type=int, default=960)
    parser.add_argument("--size", type=int, default=225, help="frame side in pixels (Maze2D's 9 x 25)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    processor = load_processor(builtin_model_path(ModelConfig(builtin_preset=args.preset)), None, None)
    encoder = ImageEncoder(processor, torch.bfloat16)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8) for _ in range(args.images)]
    message = [(frame, encoder.message_inputs([frame])) for frame in frames]
    ways = {"pickle": (pickle_dumps, pickle_loads), "turnrl.training.wire": (wire.dumps, wire.loads)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, (dumps, loads) in ways.items():
            sent, read, back = round_trip(message, dumps, loads)
            times[name].append((sent, read))
            for index in (0, -1):  # the values came back
                assert torch.equal(back[index][1].model_inputs["pixel_values"],  # type: ignore[index]
                                   message[index][1].model_inputs["pixel_values"])
            del back
    size = wire.dumps(message).numel()
    print(f"{args.images} frames of {args.size} px and their {args.preset} pixel values, {size / 1e6:,.0f} MB a "
          f"message; medians of {args.repeats} (torch {torch.__version__}):")
    print(f"{'':<22} {'pickle s':>9} {'unpickle s':>11} {'both s':>8}")
    totals = {}
    for name, pairs in times.items():
        sent, read = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        totals[name] = sent + read
        print(f"{name:<22} {sent:>9.3f} {read:>11.3f} {sent + read:>8.3f}")
    print(f"turnrl.training.wire {totals['pickle'] / totals['turnrl.training.wire']:.1f}x faster than pickle")


if __name__ == "__main__":
    main()
