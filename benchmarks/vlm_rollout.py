"""VLM rollouts on image observations: the engine beside transformers' ``generate``, in one run.

A built-in Qwen2.5-VL preset (random weights: this measures speed, not play),
``--episodes`` episodes of an image-mode env (a new picture every turn),
``--turns`` turns with the whole history in every prompt (every earlier image
too), greedy responses of at most ``--new`` tokens. The same rollout (same
seeds, so the same trajectories: greedy tokens are equal on both backends) is
played with ``model.backend=hf`` and ``model.backend=engine``, each timed after
a warm-up rollout of other seeds. ``generate`` encodes every image of the
history and prefills the whole history at every turn; the engine prefills only
each turn's new tokens and runs only the new image through the vision tower.

With ``--memory`` (a GPU) it plays the engine's rollout alone and reports its working memory: the peak
allocated during the rollout above what the weights and the key/value cache hold at rest, and the
allocations live at that peak by the line of turnrl or transformers that made them (the allocator's trace,
saved at ``--snapshot`` for pytorch.org/memory_viz; :mod:`turnrl.training.memory_trace`). The memory estimate
of a training run (``turnrl memory``) counts the weights and the cache; this is what it leaves out.

With ``--profile`` it plays the engine's rollout alone and splits its wall time: the environments, the engine's
device work (prefill with the vision tower, decode steps, from CUDA events), and the host work between them
(the rest), with the decode step's milliseconds against the step's own device time, and each device phase's share
of the hardware's limit (its roofline): prefill's model FLOPs (the decoder's over the new tokens and their causal
attention, the vision tower's over the images it encoded) against the device's bf16 peak, and the bytes decode must
read (the weights once a step, every row's cached keys and values once a step) against its memory bandwidth
(``--peak-tflops`` and ``--peak-tbps`` for a device not in :mod:`turnrl.models.throughput`'s tables; n/a on a
CPU without them); with ``--top N``, the N host
functions that took the most time (cProfile, by cumulative time); with ``--kernels N``, each phase's N costliest
kernels by device time (a ``torch.profiler`` trace of the rollout: prefill's are the kernels launched within the
engine's ``engine.prefill`` ranges, decode's the rest, its CUDA-graph replays); with ``--gaps N``, where the
device waited on the host: a trace with Python stacks of the rollout (after a warm-up rollout of its size), its
idle time by the host's frames (:mod:`turnrl.training.device_idle`; the trace grows with the rollout:
``--turns 5`` traces 64 episodes in about half a gigabyte of JSON). ``--prefill-groups N`` plays it again with
each round's next requests handed to the engine in N parts, each prefilled while the next part's environments
step (``agent.prefill_groups``), then in rounds once more, and prints the ratio of the two warm rollouts.
``--float32-weights`` holds the model in float32 with the engine in bf16, as a training run's policy is held
(mixed precision), where the default loads it in bf16; ``--compile`` compiles its layer parts as
``model.compile=true`` does (the vision tower's norms and MLPs among them, which the engine's prefill runs), and
with ``--profile`` plays a full-size rollout before the timed one: the tower's parts compile again, dynamic, at
the second number of images they meet, which without it fell in the timed prefill (6.3 s of a 15-turn
``vlm-3b`` rollout's device time against the step's 2.8 s, on an H200). ``--baseline`` plays the same rollout
again with the requests' image digests left off, so that the engine hashes each prompt's pixel values as it did
before the digests came with them, and prints the ratio.

    python benchmarks/vlm_rollout.py                                   # CPU, vlm-tiny
    python benchmarks/vlm_rollout.py --device cuda --preset vlm-0.5b --episodes 64
    python benchmarks/vlm_rollout.py --profile --device cuda --preset vlm-3b --episodes 64 --turns 15 --new 128 \
        --context 4032 --baseline                                       # where a rollout's seconds go
    python benchmarks/vlm_rollout.py --profile --gaps 25 --device cuda --preset vlm-3b --episodes 64 --turns 5 \
        --new 128 --context 4032                                        # what the GPU waits for
    python benchmarks/vlm_rollout.py --memory --preset vlm-8b --episodes 64 --turns 15 --new 128 \
        --context 4032 --kv-cache-gb 12.5                               # VisGym's rollout, one GPU
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import platform
import pstats
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.agent.formats import get_format  # noqa: E402
from turnrl.config import AgentConfig, EngineConfig, ModelConfig, SamplingConfig  # noqa: E402
from turnrl.envs import make  # noqa: E402
from turnrl.models.builtin import builtin_model_path  # noqa: E402
from turnrl.models.loading import compile_layer_parts, load_processor  # noqa: E402
from turnrl.models.throughput import peak_bandwidth, peak_flops, roofline_share  # noqa: E402
from turnrl.models.vision import ImageEncoder, MessageImages  # noqa: E402
from turnrl.policy.engine import EnginePolicy  # noqa: E402
from turnrl.policy.hf import HFPolicy  # noqa: E402
from turnrl.rollout.runner import EpisodeSlot, Rollout, RolloutTimings, counters_grown  # noqa: E402
from turnrl.rollout.trajectory import Trajectory  # noqa: E402
from turnrl.training.device_idle import device_idle, read_trace  # noqa: E402
from turnrl.training.memory_trace import GIB, recorded  # noqa: E402


def rollout(policy, args: argparse.Namespace, first_seed: int, timings: RolloutTimings | None = None,
            prefill_groups: int = 1) -> tuple[list[Trajectory], float]:
    """Play ``args.episodes`` episodes from ``first_seed`` on, in rounds (each round's next requests prefilled in
    ``prefill_groups`` parts); returns them and the wall seconds (and fills ``timings`` with the runner's own,
    when given)."""
    agent = AgentConfig(format="no_think", max_turns=args.turns, max_actions_per_episode=4 * args.turns,
                        max_context_tokens=args.context, prefill_groups=prefill_groups)
    runner = Rollout(policy, get_format("no_think"), agent, args.env)
    slots = [EpisodeSlot(env=make(args.env, mode="image"), seed=first_seed + e, group=e) for e in range(args.episodes)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    trajectories = runner.run(slots, SamplingConfig(temperature=0, max_new_tokens=args.new))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if timings is not None:
        timings.__dict__.update(runner.timings.__dict__)
    return trajectories, time.perf_counter() - start


class EncoderWithoutDigests(ImageEncoder):
    """The image encoder less its images' digests: the engine hashes each prompt's pixel values at submission
    (what it did for every request before the digests came with them)."""

    def message_inputs(self, images):
        counts, inputs, _ = super().message_inputs(images)
        return MessageImages(counts, inputs, [])


@dataclass
class Split:
    """Where one rollout's seconds went."""

    seconds: float
    env_s: float
    generate_s: float
    prefill_s: float
    decode_s: float
    work: dict[str, float]
    responses: list[list[int]]
    """Every turn's response ids, episode by episode."""

    @property
    def host_s(self) -> float:
        return self.generate_s - self.prefill_s - self.decode_s

    def row(self, label: str) -> str:
        steps = max(self.work["decode_steps"], 1)
        return (f"{label:<34} {self.seconds:>8.1f} {self.env_s:>8.1f} {self.generate_s:>8.1f} {self.prefill_s:>8.1f} "
                f"{self.decode_s:>8.1f} {1000 * self.decode_s / steps:>8.2f} {self.host_s:>8.1f}")


def profiled_rollout(engine: EnginePolicy, args: argparse.Namespace, profiler: cProfile.Profile | None,
                     prefill_groups: int = 1) -> Split:
    """Play the rollout with the engine's device timer on (and ``profiler`` running, if given), from a cache
    without rows (as after a training update): a rollout played again reuses none of the one before."""
    engine.engine.scheduler.drop_idle_rows()
    timer = engine.engine.timer
    timer.enabled = True
    timer.reset()
    before = engine.counters()
    timings = RolloutTimings()
    if profiler is not None:
        profiler.enable()
    trajectories, seconds = rollout(engine, args, first_seed=0, timings=timings, prefill_groups=prefill_groups)
    if profiler is not None:
        profiler.disable()
    timer.collect()
    timer.enabled = False
    responses = [turn.response_ids for t in trajectories for turn in t.turns]
    return Split(seconds, timings.env_s, timings.generate_s, timer.seconds["prefill"], timer.seconds["decode"],
                 counters_grown(before, engine.counters()), responses)


@dataclass
class DeviceWork:
    """What a rollout asked of the device at the least: prefill's model FLOPs and the bytes decode must read."""

    decoder_flops: float
    """The decoder's over the prefilled tokens (their causal attention in)."""
    vision_flops: float
    """The vision tower's forward passes over the images it encoded."""
    weight_bytes: int
    """The weights a decode step reads."""
    decode_bytes: float
    """What the decode steps read: the weights once a step, each row's cached keys and values once a step."""

    def cache_bytes(self, steps: int) -> float:
        """The keys and values read over ``steps`` decode steps."""
        return self.decode_bytes - float(self.weight_bytes) * steps


def device_work(split: Split, engine: EnginePolicy) -> DeviceWork:
    """The FLOPs and bytes of the engine's work in ``split``, from its counters
    (:meth:`~turnrl.engine.llm_engine.Engine.device_work`)."""
    work = split.work
    return DeviceWork(work["prefill_flops"] - work["vision_flops"], work["vision_flops"],
                      engine.engine.weights.decode_bytes(), work["decode_bytes"])


def share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def scaled(value: float, unit: str) -> str:
    """``value`` with a metric prefix: 1.23 TFLOP, 6.17 GB."""
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def roofline_lines(split: Split, work: DeviceWork, flops_peak: float | None, bandwidth: float | None) -> list[str]:
    """The device phases' seconds beside their share of the hardware's limit."""
    steps = max(int(split.work["decode_steps"]), 1)
    flops = work.decoder_flops + work.vision_flops
    read = work.decode_bytes
    floor = f"{1000 * read / bandwidth / steps:.2f} ms" if bandwidth else "n/a"
    return [
        f"prefill {split.prefill_s:.1f} s (device), {share(roofline_share(flops, split.prefill_s, flops_peak))} of the "
        f"bf16 peak: {scaled(flops, 'FLOP')} (the decoder {scaled(work.decoder_flops, 'FLOP')}, the vision tower "
        f"{scaled(work.vision_flops, 'FLOP')} over {split.work['images_encoded']:,.0f} images)",
        f"decode {split.decode_s:.1f} s over {steps:,.0f} steps, {1000 * split.decode_s / steps:.2f} ms a step, "
        f"{share(roofline_share(read, split.decode_s, bandwidth))} of the bandwidth floor ({floor}: "
        f"{scaled(work.weight_bytes, 'B')} of weights and {scaled(work.cache_bytes(steps) / steps, 'B')} of keys "
        f"and values a step on average)",
    ]


def phase_kernels(events) -> dict[str, Counter[str]]:
    """Each engine phase's kernels in a profiler trace: device microseconds by kernel name.

    Prefill's are the kernels launched by the operators within its ``engine.prefill`` ranges
    (:class:`~turnrl.engine.timing.DeviceTimer`). A CUDA graph's replay links its kernels to no operator, so
    decode's (graph replays) are every kernel of the trace less prefill's: decode's ranges hold all the rest of the
    rollout's device work.
    """
    prefill: Counter[str] = Counter()
    every: Counter[str] = Counter()
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("engine."):
            every[event.name] += event.time_range.elapsed_us()  # the ranges show on the GPU's timeline too
        if event.name != "engine.prefill":
            continue
        stack = [event]
        while stack:
            inner = stack.pop()
            for kernel in inner.kernels:
                prefill[kernel.name] += kernel.duration
            stack.extend(inner.cpu_children)
    return {"prefill": prefill, "decode": every - prefill}


def kernel_lines(phases: dict[str, Counter[str]], seconds: dict[str, float], top: int) -> list[str]:
    """The ``top`` costliest kernels of each phase, with their share of the phase's device seconds (its span, gaps
    between kernels included: what the kernels leave of it is time the device waited)."""
    lines = []
    for phase, kernels in phases.items():
        busy = sum(kernels.values()) / 1e6
        span = seconds.get(phase, 0.0)
        lines.append(f"{phase}: kernels {busy:.2f} s of its {span:.2f} s on the device "
                     f"({busy / span:.0%} busy)" if span else f"{phase}: kernels {busy:.2f} s")
        for name, microseconds in kernels.most_common(top):
            lines.append(f"  {microseconds / 1e6:>7.3f} s {microseconds / 1e6 / max(span, 1e-9):>5.1%}  {name[:110]}")
    return lines


def engine_profile(engine: EnginePolicy, processor, args: argparse.Namespace) -> None:
    """The engine's rollout alone, its wall time split into environments, device work and host work; with
    ``--baseline``, the same rollout again with its images hashed by the engine."""
    rollout(engine, argparse.Namespace(**{**vars(args), "episodes": min(args.episodes, 4), "turns": 2}), 1000)
    if args.gaps or args.compile:
        # What the timed rollout meets, compiled and captured before it: the waits left are steady ones, and the
        # compiled tower has met its second size (64 images a call after the warm-up's 4) and gone dynamic.
        rollout(engine, args, 2000)
    profiler = cProfile.Profile() if args.top else None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    traced = args.kernels or args.gaps
    with (torch.profiler.profile(activities=activities, with_stack=bool(args.gaps)) if traced
          else contextlib.nullcontext()) as trace:
        split = profiled_rollout(engine, args, profiler)
    work = split.work
    generated, steps = work["generated_tokens"], work["decode_steps"]
    print(f"{len(split.responses)} turns, {generated:,.0f} tokens generated in {steps:,.0f} decode steps "
          f"({generated / max(steps, 1):.1f} rows a step), "
          f"{work['prefill_tokens']:,.0f} tokens prefilled in {work['prefill_calls']:,.0f} calls, "
          f"{work['reused_tokens']:,.0f} read from the cache; seconds (a decode step in ms):")
    print(f"{'':<34} {'rollout':>8} {'envs':>8} {'generate':>8} {'prefill':>8} {'decode':>8} {'a step':>8} "
          f"{'host':>8}")
    print(split.row("digests from the encoder"))
    device = engine.engine.device
    for line in roofline_lines(split, device_work(split, engine), peak_flops(device, 1e12 * args.peak_tflops),
                               peak_bandwidth(device, 1e12 * args.peak_tbps)):
        print(line)
    if args.kernels:
        seconds = {"prefill": split.prefill_s, "decode": split.decode_s}
        for line in kernel_lines(phase_kernels(trace.events()), seconds, args.kernels):
            print(line)
    if args.gaps:
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "rollout_trace.json"
            trace.export_chrome_trace(str(path))
            print("\n".join(device_idle(read_trace(path)).lines(args.gaps)))
    if args.prefill_groups > 1:
        # The first full-size rollout above follows a short warm-up only, and took seconds longer than the next in a
        # GPU run (mostly in its envs); rounds are played again after the parts, so that the ratio compares two
        # rollouts that each follow a full-size one.
        parts = profiled_rollout(engine, args, None, prefill_groups=args.prefill_groups)
        rounds = profiled_rollout(engine, args, None)
        print(parts.row(f"rounds prefilled in {args.prefill_groups} parts"))
        print(rounds.row("rounds again, after the parts"))
        print(f"the rollout {rounds.seconds / parts.seconds:.2f}x faster in parts than in rounds played after "
              f"them, generation {rounds.generate_s / parts.generate_s:.2f}x (the same responses: "
              f"{'yes' if parts.responses == rounds.responses else 'no (bf16 near-ties break either way)'})")
    if args.baseline:
        encoder = engine.image_encoder
        engine.image_encoder = EncoderWithoutDigests(processor, engine.engine.dtype)
        hashed = profiled_rollout(engine, args, None)
        engine.image_encoder = encoder
        print(hashed.row("pixels hashed at each submission"))
        print(f"generation {hashed.generate_s / split.generate_s:.2f}x faster with the encoder's digests, "
              f"the rollout {hashed.seconds / split.seconds:.2f}x (the same responses: "
              f"{'yes' if hashed.responses == split.responses else 'no'})")
    if profiler is None:
        return
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(r"turnrl|transformers", args.top)
    print("host functions by cumulative time (cProfile; its overhead inflates Python-heavy functions):")
    print(text.getvalue().strip("\n"))


def engine_memory(engine: EnginePolicy, args: argparse.Namespace, device: torch.device) -> None:
    """The engine's rollout alone: its peak above the weights and cache at rest, and what was live then."""
    rollout(engine, argparse.Namespace(**{**vars(args), "episodes": min(args.episodes, 4), "turns": 2}), 1000)
    torch.cuda.synchronize(device)
    at_rest = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    snapshot = Path(args.snapshot)
    with recorded(snapshot, device):
        _, seconds = rollout(engine, args, first_seed=0)
    print(f"rollout {seconds:.1f} s; at rest (weights, engine buffers, key/value cache) {at_rest / GIB:.2f} GiB; "
          f"peak {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB; the snapshot: {snapshot}")
    print(snapshot.with_suffix(".txt").read_text(), end="")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default=None, help="a built-in VLM preset (vlm-tiny on a CPU, vlm-0.5b on a GPU)")
    parser.add_argument("--env", default="Maze2D")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--context", type=int, default=8192, help="agent.max_context_tokens")
    parser.add_argument("--memory", action="store_true", help="the engine's working memory in its rollout (a GPU)")
    parser.add_argument("--profile", action="store_true", help="where the engine's rollout time goes")
    parser.add_argument("--baseline", action="store_true",
                        help="with --profile, play it again with the images hashed by the engine (the ratio)")
    parser.add_argument("--top", type=int, default=0,
                        help="with --profile, list this many host functions (cProfile, which slows the host work)")
    parser.add_argument("--kernels", type=int, default=0,
                        help="with --profile, each phase's N costliest kernels (torch.profiler; slows the rollout)")
    parser.add_argument("--prefill-groups", type=int, default=1,
                        help="with --profile, play the rollout again with each round's next requests prefilled in "
                             "N parts while the envs step (agent.prefill_groups), and print the ratio")
    parser.add_argument("--gaps", type=int, default=0,
                        help="with --profile, the N host frames the device waited on most, by phase (torch.profiler "
                             "with Python stacks, after a warm-up rollout of the same size; slows the rollout)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="with --profile, the device's dense bf16 TFLOP/s (0: known GPUs' by name)")
    parser.add_argument("--peak-tbps", type=float, default=0.0,
                        help="with --profile, the device's memory bandwidth in TB/s (0: known GPUs' by name)")
    parser.add_argument("--float32-weights", action="store_true",
                        help="hold the weights in float32 with the engine in bf16, as a training run's policy")
    parser.add_argument("--compile", action="store_true",
                        help="compile the model's layer parts as model.compile=true does (the vision tower's blocks "
                             "among them: a training run's prefill)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.0, help="the engine's cache (0: its default)")
    parser.add_argument("--snapshot", default="runs/vlm_rollout_memory.pickle",
                        help="with --memory, the allocator's snapshot (and its report, .txt)")
    args = parser.parse_args()
    device = torch.device(args.device)
    preset = args.preset or ("vlm-0.5b" if device.type == "cuda" else "vlm-tiny")
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = str(compute).removeprefix("torch.")
    path = str(builtin_model_path(ModelConfig(builtin_preset=preset)))
    weights = "float32" if args.float32_weights else dtype
    hf = HFPolicy.from_config(ModelConfig(device=args.device, dtype=weights), path, max_batch_size=args.episodes)
    processor = load_processor(path)
    if args.compile:
        compile_layer_parts(hf.model)
    engine = EnginePolicy(hf.model, hf.tokenizer, EngineConfig(max_rows=args.episodes, max_seq_len=args.context + 64,
                                                               kv_cache_gb=args.kv_cache_gb),
                          dtype=compute, processor=processor)
    if args.float32_weights and compute != torch.float32:
        dtype = f"{dtype} over float32 weights"
    if args.memory:
        if device.type != "cuda":
            raise SystemExit("--memory reads the GPU allocator's trace: run it with --device cuda")
        print(f"{preset} (random weights), {dtype}, {args.env} images, {args.episodes} episodes x {args.turns} "
              f"turns of at most {args.new} tokens, on {torch.cuda.get_device_name(device)} "
              f"(torch {torch.__version__})")
        engine_memory(engine, args, device)
        return
    if args.profile:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"{preset} (random weights), {dtype}, {args.env} images, {args.episodes} episodes x {args.turns} "
              f"turns of at most {args.new} tokens, on {name} (torch {torch.__version__})")
        engine_profile(engine, processor, args)
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    print(f"{preset} (random weights), {dtype}, {args.env} images, {args.episodes} episodes x {args.turns} turns, "
          f"greedy responses of at most {args.new} tokens, on {name} (torch {torch.__version__})")
    print(f"{'backend':<8} {'seconds':>8} {'turns':>6} {'prompt tokens':>14} {'generated':>10} {'tokens/s':>9} "
          f"{'prefilled':>10} {'reused':>8} {'speedup':>8}")
    played: dict[str, list[Trajectory]] = {}
    baseline = None
    for label, policy in (("hf", hf), ("engine", engine)):
        rollout(policy, args, first_seed=1000)  # warm-up: compilation, graphs, allocator
        before = engine.engine.stats.prefill_tokens, engine.engine.stats.reused_tokens
        trajectories, seconds = rollout(policy, args, first_seed=0)
        played[label] = trajectories
        turns = sum(len(t.turns) for t in trajectories)
        prompt = sum(len(sample.prompt_ids) for t in trajectories for sample in t.tokens.turn_samples())
        generated = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
        baseline = baseline or seconds
        prefilled, reused = ("-", "-") if label == "hf" else (
            f"{engine.engine.stats.prefill_tokens - before[0]:,}", f"{engine.engine.stats.reused_tokens - before[1]:,}")
        print(f"{label:<8} {seconds:>8.2f} {turns:>6} {prompt:>14,} {generated:>10,} {generated / seconds:>9,.0f} "
              f"{prefilled:>10} {reused:>8} {baseline / seconds:>7.2f}x", flush=True)
    same = all(a.tokens.stream().input_ids == b.tokens.stream().input_ids
               for a, b in zip(played["hf"], played["engine"]))
    print(f"same trajectories on both backends: {'yes' if same else 'no (bf16 near-ties break either way)'}")


if __name__ == "__main__":
    main()
