"""A vision tower's layout made on the host: the tower's features with it equal the features the tower makes from
its own layout (Qwen2-VL, Qwen2.5-VL with windows, Qwen3-VL with its resampled position table), images of several
sizes in one call; layouts are kept by their grids, a bounded number of them; the chunked attention answers from
the extremes noted with them; a tower without a known layout makes its own."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_vision_attention import images, models
from turnrl.engine.weights import decoder_weights
from turnrl.models.loading import prepare_vision_tower, vision_tower
from turnrl.models.vision_attention import chunk_extremes, note_extremes
from turnrl.models.vision_layout import LAYOUTS, TowerLayouts, host_layout

GRIDS = [[1, 16, 24], [1, 8, 8], [1, 12, 6], [1, 16, 24]]
"""Images of three sizes (the first and last alike), Qwen2.5-VL windows of 8 x 8 patches cut short at the edges."""


@pytest.fixture(scope="module")
def towers(tiny_tokenizer):
    made = models(tiny_tokenizer)
    for model in made.values():
        model.eval()
        prepare_vision_tower(model)
    return made


def test_every_family_of_the_engine_has_a_layout(towers):
    for name, model in towers.items():
        assert model.config.vision_config.model_type in LAYOUTS, name


@pytest.mark.parametrize("name", ["qwen2_5_vl (windows)", "qwen2_vl", "qwen3_vl"])
def test_features_from_the_host_layout_equal_the_towers_own(towers, name):
    model = towers[name]
    pixels, grids = images(model.config.vision_config, GRIDS)
    layout = TowerLayouts(vision_tower(model)).inputs(grids, pixels.device)
    assert layout["max_seqlen"] == 16 * 24
    with torch.no_grad():
        own = model.model.get_image_features(pixels, grids, return_dict=True)
        hosted = model.model.get_image_features(pixels, grids, return_dict=True, **layout)
    for mine, reference in zip(hosted.pooler_output, own.pooler_output, strict=True):
        assert torch.equal(mine, reference), name
    for mine, reference in zip(hosted.get("deepstack_features") or [], own.get("deepstack_features") or [],
                               strict=True):
        assert torch.equal(torch.as_tensor(mine) if isinstance(mine, torch.Tensor) else torch.cat(mine),
                           torch.as_tensor(reference) if isinstance(reference, torch.Tensor) else torch.cat(reference))


def test_the_engines_features_use_the_layout_and_equal_the_towers_own(towers):
    model = towers["qwen2_5_vl (windows)"]
    pixels, grids = images(model.config.vision_config, GRIDS)
    vision = decoder_weights(model, torch.float32).vision
    assert vision is not None
    with torch.no_grad():
        own = torch.cat(model.model.get_image_features(pixels, grids, return_dict=True).pooler_output)
        assert torch.equal(vision.features(pixels, grids).merged, own)
        assert torch.equal(vision.features(pixels, grids).merged, own)  # the kept layout, again


def test_layouts_are_kept_by_their_grids_and_bounded(towers):
    tower = vision_tower(towers["qwen2_5_vl (windows)"])
    layouts = TowerLayouts(tower, held=2)
    first = layouts.inputs(torch.tensor(GRIDS), torch.device("cpu"))
    again = layouts.inputs(torch.tensor(GRIDS, dtype=torch.int32), torch.device("cpu"))
    assert all(again[name] is value for name, value in first.items() if isinstance(value, torch.Tensor))
    layouts.inputs(torch.tensor(GRIDS[:1]), torch.device("cpu"))
    layouts.inputs(torch.tensor(GRIDS[1:2]), torch.device("cpu"))  # a third list of grids: the first is dropped
    made = layouts.inputs(torch.tensor(GRIDS), torch.device("cpu"))
    assert made["cu_seqlens"] is not first["cu_seqlens"]
    assert torch.equal(made["window_index"], first["window_index"])


def test_the_windows_bounds_and_their_extremes_are_the_towers(towers):
    tower = vision_tower(towers["qwen2_5_vl (windows)"])
    kind = LAYOUTS[tower.config.model_type]
    layout = host_layout(tower, kind, torch.tensor(GRIDS))
    lengths = (layout["cu_window_seqlens"][1:] - layout["cu_window_seqlens"][:-1]).tolist()
    # 8 x 8-patch windows: a whole one holds 64 patches; the 12 x 6 image's are cut to 32, 24 and 16 ... patches
    assert max(lengths) == 64 == layout["max_window_seqlen"] and min(lengths) < 64
    kept = TowerLayouts(tower).inputs(torch.tensor(GRIDS), torch.device("cpu"))
    assert chunk_extremes(kept["cu_window_seqlens"]) == (min(lengths), max(lengths))


def test_noted_extremes_are_answered_without_reading_the_bounds(monkeypatch):
    bounds = torch.tensor([0, 4, 8, 10], dtype=torch.int32)
    note_extremes(bounds, 2, 4)
    monkeypatch.setattr(torch, "aminmax", lambda lengths: pytest.fail("the bounds were read"))
    assert chunk_extremes(bounds) == (2, 4)


def test_a_tower_without_a_known_layout_makes_its_own(towers):
    tower = vision_tower(towers["qwen2_vl"])

    class Unknown:
        config = type("Config", (), {"model_type": "some_other_vision"})()

    assert not TowerLayouts(Unknown()).enabled and TowerLayouts(Unknown()).inputs(torch.tensor(GRIDS), "cpu") == {}
    assert not TowerLayouts(None).enabled
    assert TowerLayouts(tower).enabled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["qwen2_5_vl (windows)", "qwen2_vl", "qwen3_vl"])
def test_on_a_gpu_the_host_layout_gives_the_towers_features_and_reads_nothing_from_the_device(towers, name):
    """Grids on the host and the layout copied over: the tower's forward queues its work without a wait (CUDA's
    sync debug mode raises at any read of the device), and its features are those it makes from grids on the GPU
    (Qwen3-VL's interpolation weights computed on the host: equal to float32 rounding)."""
    model = towers[name].cuda()
    try:
        pixels, grids = images(model.config.vision_config, GRIDS)
        pixels = pixels.cuda()
        layouts = TowerLayouts(vision_tower(model))
        with torch.no_grad():
            device_grids = grids.cuda()
            own = torch.cat(list(model.model.get_image_features(pixels, device_grids, return_dict=True).pooler_output))
            layout = layouts.inputs(grids, pixels.device)  # made and copied once, then kept
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with pytest.raises(RuntimeError, match="synchroniz"):  # the tower's own layout reads the device
                    model.model.get_image_features(pixels, device_grids, return_dict=True)
                layout = layouts.inputs(grids, pixels.device)
                hosted = model.model.get_image_features(pixels, grids, return_dict=True, **layout).pooler_output
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(torch.cat(list(hosted)), own, rtol=1e-5, atol=1e-5)
    finally:
        towers[name].cpu()
