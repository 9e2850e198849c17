"""A VLM's vision tower over a batch of rollout images: transformers' attention chunk by chunk (``sdpa``)
against the chunked attention the loader gives every VLM (one SDPA call a layer); seconds a pass and the ratio.

A built-in VLM preset's vision tower (random weights, bf16 on a GPU, float32 on a CPU) encodes ``--images``
images of ``--size`` x ``--size`` pixels, as a training update's forward pass or a rollout's prefill does:
Qwen2.5-VL's windows of 8 x 8 patches in most layers and whole images in the others.

With ``--new-counts N`` (a GPU) it also times N forward passes over a new number of images each (``--images``,
one fewer, ...: a rollout's prefill meets a new count at most calls) with SDPA free to choose cuDNN's attention
against the kernels the tower's attention keeps to (:data:`~turnrl.models.vision_attention.TOWER_BACKENDS`):
cuDNN plans every new shape on the host.

With ``--rotary`` it also times the tower as a training run's rollout runs it with ``model.compile`` (float32 weights
under bf16 autocast on a GPU, its blocks' norms and MLPs compiled) with its rotary embedding eager, then compiled
(:class:`~turnrl.models.loading.CompiledVisionRotary`, what ``model.compile`` gives it), and prints the largest
difference of their features (bf16 rounding at most).

With ``--layout`` it also times the chunked forward with the tower's layout made on the host and kept by the
images' grids (:mod:`turnrl.models.vision_layout`, what the engine's prefill does) against the tower making it
from grids on the device (a loop over the images, with reads to the host that drain the device), passes run back
to back as a rollout's prefills run, and prints the largest difference of their features (none expected).

With ``--mlp`` it also times the tower as a training run holds and compiles it (``model.compile``: float32 weights
under bf16 autocast on a GPU, its blocks' parts compiled, the layout made on the host) over ``--new-counts`` passes
of a new image count each (``--images``, one fewer, ...: the compiled graphs are dynamic, as a rollout's prefills
meet them), its MLPs running their own class's forward against the aligned one loading gives an MLP of an
unaligned width (:mod:`turnrl.models.vision_mlp`; inductor may pad the own forward's products itself), and prints
the largest difference of their features; ``--new-counts`` then counts these passes, and the cuDNN rows are not
run. ``--vision-mlp-width`` builds the tower at another MLP width (an unaligned one for a CPU's small presets,
whose widths are aligned).

    python benchmarks/vision_attention.py --preset vlm-3b --images 128 --size 224
    python benchmarks/vision_attention.py --preset vlm-3b --images 64 --size 224 --new-counts 12
    python benchmarks/vision_attention.py --preset vlm-3b --images 64 --size 224 --layout --repeats 20
    python benchmarks/vision_attention.py --preset vlm-3b --images 64 --size 224 --rotary --repeats 10
    python benchmarks/vision_attention.py --preset vlm-3b --images 64 --size 224 --mlp --new-counts 12
    python benchmarks/vision_attention.py --preset vlm-tiny --device cpu --images 16 --size 224   # a smoke run
    python benchmarks/vision_attention.py --preset vlm-tiny --device cpu --images 12 --size 112 --mlp \
        --new-counts 3 --vision-mlp-width 120   # the MLP rows' smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.nn.attention import SDPBackend  # noqa: E402
from transformers import AutoModelForImageTextToText  # noqa: E402

from turnrl.models import build_tokenizer, vision_attention, vlm_config  # noqa: E402
from turnrl.models.loading import VISION_ATTENTION_PART, VISION_ROTARY_FUNCTION, compile_layer_parts  # noqa: E402
from turnrl.models.vision_attention import VISION_ATTENTION  # noqa: E402
from turnrl.models.vision_layout import TowerLayouts  # noqa: E402
from turnrl.models.vision_mlp import AlignedQwen2_5_VLMLP, align_vision_mlps  # noqa: E402


def body_of(preset: str, device: torch.device, dtype: torch.dtype, mlp_width: int | None = None) -> torch.nn.Module:
    """The preset's model body (its vision tower is what is timed), random weights; ``mlp_width``: the tower's
    MLP width instead of the preset's."""
    tokenizer = build_tokenizer(["an image"], template="chatml")
    config = vlm_config(preset, tokenizer)
    if mlp_width is not None:
        config.vision_config.intermediate_size = mlp_width
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    return model.model.eval()


def images(body: torch.nn.Module, count: int, size: int, device: torch.device, dtype: torch.dtype):
    """Patches of ``count`` images of ``size`` pixels a side and their (t, h, w) grids."""
    config = body.visual.config
    side = size // config.patch_size // config.spatial_merge_size * config.spatial_merge_size
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    grids = torch.tensor([[1, side, side]] * count, device=device)
    return torch.randn(count * side * side, width, device=device, dtype=dtype), grids


def one_pass(body, pixels, grids, backward: bool) -> None:
    """The tower's forward pass (a rollout's prefill), or forward and backward (a training update's)."""
    if not backward:
        with torch.no_grad():
            body.get_image_features(pixels, grids, return_dict=True)
        return
    features = body.get_image_features(pixels, grids, return_dict=True).pooler_output
    # transformers 5.17 returns one tensor of every image's merged features, later 5.x one tensor an image.
    features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
    features.float().square().mean().backward()
    body.zero_grad(set_to_none=True)


def seconds_a_pass(body, pixels, grids, repeats: int, backward: bool) -> float:
    one_pass(body, pixels, grids, backward)  # warm-up
    if pixels.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        one_pass(body, pixels, grids, backward)
    if pixels.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def seconds_over_new_counts(body, args, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds a forward pass over ``args.new_counts`` passes of ``args.images``, one fewer, ... images."""
    batches = [images(body, args.images - index, args.size, device, dtype) for index in range(args.new_counts)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for pixels, grids in batches:
        one_pass(body, pixels, grids, backward=False)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / len(batches)


def new_count_rows(body, args, device: torch.device, dtype: torch.dtype) -> list[tuple[str, float]]:
    """The tower's forward over new image counts, SDPA free to choose cuDNN against the tower's kernels. Each
    variant meets counts the other has not (cuDNN's plans are cached by shape for the process)."""
    body.visual.config._attn_implementation = VISION_ATTENTION
    kept = vision_attention.TOWER_BACKENDS
    rows = []
    for label, backends, first in (("cuDNN allowed (SDPA's choice)", [SDPBackend.CUDNN_ATTENTION, *kept], 0),
                                   ("the tower's kernels (no cuDNN)", kept, args.new_counts)):
        vision_attention.TOWER_BACKENDS = backends
        try:
            shifted = argparse.Namespace(**{**vars(args), "images": args.images - first})
            rows.append((f"{label}, a new image count each pass", seconds_over_new_counts(body, shifted, device,
                                                                                          dtype)))
        finally:
            vision_attention.TOWER_BACKENDS = kept
        print(f"{rows[-1][0]}: {rows[-1][1]:.4f} s a pass", flush=True)
    return rows


def seconds_back_to_back(encode, repeats: int, device: torch.device) -> float:
    """Seconds a call of ``encode`` over ``repeats`` calls back to back, as a rollout's prefills run."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        encode()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def layout_rows(body, args, device: torch.device, dtype: torch.dtype) -> list[tuple[str, float]]:
    """The chunked forward with the tower making its layout from grids on the device, against the layout made on
    the host and kept (:class:`~turnrl.models.vision_layout.TowerLayouts`); ``--repeats`` passes back to back."""
    body.visual.config._attn_implementation = VISION_ATTENTION
    pixels, grids = images(body, args.images, args.size, device, dtype)
    host_grids, layouts = grids.cpu(), TowerLayouts(body.visual)
    if not layouts.enabled:
        raise SystemExit("--layout: this tower has no layout made on the host (transformers without vision_utils?)")

    def own() -> torch.Tensor:
        return torch.cat(list(body.get_image_features(pixels, grids, return_dict=True).pooler_output))

    def hosted() -> torch.Tensor:
        layout = layouts.inputs(host_grids, device)
        return torch.cat(list(body.get_image_features(pixels, host_grids, return_dict=True, **layout).pooler_output))

    rows = []
    with torch.no_grad():
        difference = float((own().float() - hosted().float()).abs().max())
        for label, encode in (("the tower's own layout (grids on the device)", own),
                              ("the layout made on the host, kept", hosted)):
            encode()  # warm-up
            rows.append((f"chunked, forward, {label}", seconds_back_to_back(encode, args.repeats, device)))
            print(f"{rows[-1][0]}: {rows[-1][1]:.4f} s a pass", flush=True)
    print(f"largest difference of the features: {difference:.3g}")
    return rows


def rotary_rows(args, device: torch.device) -> list[tuple[str, float]]:
    """The forward as a training run's rollout runs the tower under ``model.compile`` (float32 weights, bf16
    autocast on a GPU, the blocks' parts compiled), its rotary embedding eager and then compiled; ``--repeats``
    passes back to back, the layout made on the host as the engine makes it."""
    body = body_of(args.preset, device, torch.float32)
    body.visual.config._attn_implementation = VISION_ATTENTION
    compile_layer_parts(body)
    block = next(m for m in body.visual.modules() if VISION_ATTENTION_PART in dict(m.named_children()))
    module = sys.modules[type(getattr(block, VISION_ATTENTION_PART)).__module__]
    compiled = vars(module)[VISION_ROTARY_FUNCTION]
    pixels, grids = images(body, args.images, args.size, device, torch.float32)
    host_grids, layouts = grids.cpu(), TowerLayouts(body.visual)

    def encode() -> torch.Tensor:
        layout = layouts.inputs(host_grids, device) if layouts.enabled else {}
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            output = body.get_image_features(pixels, host_grids if layout else grids, return_dict=True, **layout)
        return torch.cat(list(output.pooler_output))

    rows, features = [], []
    try:
        for label, function in (("its rotary eager", compiled.original), ("its rotary compiled", compiled)):
            setattr(module, VISION_ROTARY_FUNCTION, function)
            features.append(encode().float())  # warm-up (compiles)
            rows.append((f"chunked, forward, compiled blocks, {label}",
                         seconds_back_to_back(encode, args.repeats, device)))
            print(f"{rows[-1][0]}: {rows[-1][1]:.4f} s a pass", flush=True)
    finally:
        setattr(module, VISION_ROTARY_FUNCTION, compiled)
    print(f"largest difference of the features: {float((features[0] - features[1]).abs().max()):.3g}")
    return rows


def mlp_rows(args, device: torch.device) -> list[tuple[str, float]]:
    """The forward as a training run holds and compiles the tower (float32 weights, bf16 autocast on a GPU, the
    blocks' parts compiled, the layout made on the host), its MLPs' own forward against the aligned one, each
    timed over ``args.new_counts`` passes of a new image count after four passes of others (which compile the
    dynamic graphs); the two towers have the same weights."""
    first = body_of(args.preset, device, torch.float32, args.vision_mlp_width)
    second = body_of(args.preset, device, torch.float32, args.vision_mlp_width)
    second.load_state_dict(first.state_dict())
    if not align_vision_mlps(second.visual):  # before anything compiles: a refusal costs nothing
        raise SystemExit(f"--mlp: {args.preset}'s vision MLPs are {second.visual.config.intermediate_size} wide, "
                         "aligned already: nothing to compare (--vision-mlp-width sets another width)")
    counts = [args.images - index for index in range(4 + args.new_counts)]
    warm, timed = counts[:4], counts[4:]
    batches = {count: images(first, count, args.size, device, torch.float32) for count in counts}
    rows, features = [], []
    for label, body, aligned in (("its MLPs' own forward", first, False), ("its MLPs aligned", second, True)):
        body.visual.config._attn_implementation = VISION_ATTENTION
        assert aligned == any(isinstance(module, AlignedQwen2_5_VLMLP) for module in body.modules())
        compile_layer_parts(body)
        layouts = TowerLayouts(body.visual)

        def encode(count: int, body=body, layouts=layouts) -> torch.Tensor:
            pixels, grids = batches[count]
            host_grids = grids.cpu()
            layout = layouts.inputs(host_grids, device) if layouts.enabled else {}
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                output = body.get_image_features(pixels, host_grids if layout else grids, return_dict=True,
                                                 **layout)
            return torch.cat(list(output.pooler_output))

        for count in warm:
            encode(count)
        features.append(encode(timed[0]).float())
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for count in timed:
            encode(count)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append((f"chunked, forward, compiled blocks, a new image count each pass, {label}",
                     (time.perf_counter() - start) / len(timed)))
        print(f"{rows[-1][0]}: {rows[-1][1]:.4f} s a pass", flush=True)
    print(f"largest difference of the features: {float((features[0] - features[1]).abs().max()):.3g}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="vlm-3b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-counts", type=int, default=0,
                        help="a GPU: also N forward passes over a new image count each, with and without cuDNN")
    parser.add_argument("--layout", action="store_true",
                        help="also the forward with its layout made on the host against the tower's own")
    parser.add_argument("--rotary", action="store_true",
                        help="also the forward as training's rollout runs it, its rotary embedding eager and compiled")
    parser.add_argument("--mlp", action="store_true",
                        help="also the compiled forward over --new-counts new image counts, its MLPs' own forward "
                             "against the aligned one")
    parser.add_argument("--vision-mlp-width", type=int, default=None,
                        help="the tower's MLP width instead of the preset's (with --mlp on a small preset)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.mlp and not 0 < args.new_counts < args.images - 4:
        raise SystemExit("--mlp times --new-counts passes after four others: give 0 < --new-counts < --images - 4")
    if args.new_counts and not args.mlp and (device.type != "cuda" or 2 * args.new_counts >= args.images):
        raise SystemExit("--new-counts times cuDNN's attention: a GPU, and fewer than --images / 2 passes")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    body = body_of(args.preset, device, dtype, args.vision_mlp_width)
    pixels, grids = images(body, args.images, args.size, device, dtype)
    rows = []
    for backward in (False, True):
        for name, implementation in (("transformers, a call a chunk (sdpa)", "sdpa"),
                                     ("chunked, a call a layer", VISION_ATTENTION)):
            body.visual.config._attn_implementation = implementation
            label = f"{name}, {'forward + backward' if backward else 'forward'}"
            rows.append((label, seconds_a_pass(body, pixels, grids, args.repeats, backward)))
            print(f"{label}: {rows[-1][1]:.4f} s a pass", flush=True)
    if args.new_counts and not args.mlp:
        rows.extend(new_count_rows(body, args, device, dtype))
    if args.layout:
        rows.extend(layout_rows(body, args, device, dtype))
    if args.rotary:
        rows.extend(rotary_rows(args, device))
    if args.mlp:
        rows.extend(mlp_rows(args, device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{args.preset} vision tower, {args.images} images of {args.size} px, {name}, {dtype}")
    print("| attention | s a pass | speed-up |\n| --- | ---: | ---: |")
    for index, (label, seconds) in enumerate(rows):
        baseline = rows[index - index % 2][1]
        print(f"| {label} | {seconds:.4f} | {baseline / seconds:.2f}x |")


if __name__ == "__main__":
    main()
