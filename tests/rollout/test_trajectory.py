"""Trajectory records on disk: one JSON line per episode, the images shown and the final ones as PNG files."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from turnrl.rollout.trajectory import DONE, Trajectory, write_trajectories


def frame(value: int) -> np.ndarray:
    return np.full((4, 6, 3), value, dtype=np.uint8)


def test_the_final_observations_image_is_written_beside_the_images_shown(tmp_path):
    episodes = [
        Trajectory(env_id="Lake", seed=0, group=0, sample=0, status=DONE, images=[frame(1), frame(2)],
                   final_images=[frame(3)], final_observation="fell in"),
        Trajectory(env_id="Lake", seed=1, group=1, sample=0),  # text mode: no images at all
    ]
    path = write_trajectories(episodes, tmp_path, name="val.jsonl")
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["images"] == ["images/val_00000_000.png", "images/val_00000_001.png"]
    assert first["final_images"] == ["images/val_00000_final0.png"] and first["final_observation"] == "fell in"
    written = [np.asarray(Image.open(tmp_path / name)) for name in first["images"] + first["final_images"]]
    assert [int(image[0, 0, 0]) for image in written] == [1, 2, 3]
    assert second["images"] == [] and second["final_images"] == []
