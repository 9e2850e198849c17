"""Drawing grid worlds as RGB images with Pillow.

Grid envs describe a frame as rows of symbols; ``draw_grid`` turns it into an
``HxWx3`` uint8 array with one ``cell_px`` square per cell. Each symbol maps to
a :class:`Tile`: a background colour plus an optional shape, so that the agent,
boxes, targets and goals stay distinct for a vision model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

RGB = tuple[int, int, int]


@dataclass(frozen=True)
class Tile:
    """How one cell is drawn."""

    background: RGB
    shape: str | None = None
    """``None``, ``"circle"``, ``"square"``, ``"diamond"``, ``"ring"`` or ``"cross"``."""
    color: RGB = (0, 0, 0)
    """Colour of the shape."""
    scale: float = 0.7
    """Shape size as a fraction of the cell."""


def _draw_shape(draw: ImageDraw.ImageDraw, tile: Tile, x0: int, y0: int, cell_px: int) -> None:
    margin = cell_px * (1 - tile.scale) / 2
    box = (x0 + margin, y0 + margin, x0 + cell_px - margin - 1, y0 + cell_px - margin - 1)
    width = max(1, cell_px // 8)
    if tile.shape == "circle":
        draw.ellipse(box, fill=tile.color)
    elif tile.shape == "square":
        draw.rectangle(box, fill=tile.color)
    elif tile.shape == "ring":
        draw.ellipse(box, outline=tile.color, width=width)
    elif tile.shape == "diamond":
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        draw.polygon([(cx, box[1]), (box[2], cy), (cx, box[3]), (box[0], cy)], fill=tile.color)
    elif tile.shape == "cross":
        draw.line((box[0], box[1], box[2], box[3]), fill=tile.color, width=width)
        draw.line((box[0], box[3], box[2], box[1]), fill=tile.color, width=width)
    elif tile.shape is not None:
        raise ValueError(f"unknown tile shape {tile.shape!r}")


@lru_cache(maxsize=256)
def _tile_image(tile: Tile, cell_px: int) -> np.ndarray:
    image = Image.new("RGB", (cell_px, cell_px), tile.background)
    _draw_shape(ImageDraw.Draw(image), tile, 0, 0, cell_px)
    return np.asarray(image, dtype=np.uint8)


def draw_grid(rows: list[list[str]] | list[str], tiles: dict[str, Tile], cell_px: int = 25) -> np.ndarray:
    """Render a grid of symbols.

    Args:
        rows: ``H`` rows of ``W`` symbols each (strings or lists of symbols).
        tiles: how each symbol is drawn; every symbol in ``rows`` must be a key.
        cell_px: side of one cell in pixels.

    Returns:
        Shape ``(H*cell_px, W*cell_px, 3)``, dtype uint8.
    """
    height, width = len(rows), len(rows[0])
    frame = np.empty((height * cell_px, width * cell_px, 3), dtype=np.uint8)
    for r, row in enumerate(rows):
        for c, symbol in enumerate(row):
            tile = _tile_image(tiles[symbol], cell_px)
            frame[r * cell_px : (r + 1) * cell_px, c * cell_px : (c + 1) * cell_px] = tile
    return frame


@lru_cache(maxsize=8)
def font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Pillow's built-in font at ``size`` pixels (no font files needed)."""
    return ImageFont.load_default(size=size)
