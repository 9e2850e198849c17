"""Spatial geometry: the exact integer bins against a plain floating-point reference."""

import math

import pytest

from turnrl.envs.games.spatial.geometry import (
    CLOCK,
    COMPASS,
    DISTANCE_BINS,
    EGO_BINS,
    bearing,
    distance_bin,
    ego,
    ego_bin,
    in_view,
    relative_facing,
    sector,
)

VECTORS = [(x, y) for x in range(-12, 13) for y in range(-12, 13) if (x, y) != (0, 0)]


def reference_angle(v, heading):
    """Degrees clockwise from the heading, in (-180, 180], by rotating the compass angle of v."""
    compass = math.degrees(math.atan2(v[0], v[1]))  # clockwise from north
    return (compass - 90 * heading + 180) % 360 - 180


@pytest.mark.parametrize("heading", range(4))
def test_field_of_view_and_bearing_bins(heading):
    for v in VECTORS:
        angle = reference_angle(v, heading)
        assert in_view(v, heading) == (abs(angle) <= 45 + 1e-9), (v, heading)
        if not in_view(v, heading):
            continue
        if abs(angle) < 1e-9:
            expected = "front"
        elif abs(angle) <= 22.5:
            expected = "front-slight-right" if angle > 0 else "front-slight-left"
        else:
            expected = "front-right" if angle > 0 else "front-left"
        assert EGO_BINS[ego_bin(v, heading)] == expected, (v, heading, angle)


def test_distance_bins():
    for v in VECTORS:
        d = math.hypot(*v)
        expected = next((label for label, top in zip(DISTANCE_BINS, (2, 4, 8, 16, 32)) if d <= top + 1e-12),
                        "extremely far")
        assert DISTANCE_BINS[distance_bin(v)] == expected, v
    assert DISTANCE_BINS[distance_bin((40, 0))] == "extremely far"


@pytest.mark.parametrize("heading", range(4))
def test_sectors(heading):
    for v in VECTORS:
        angle = reference_angle(v, heading) % 360
        assert sector(v, heading) == int(math.floor((angle + 22.5) / 45)) % 8, (v, heading)
        assert abs(bearing(v, heading) - angle) < 1e-9
    assert COMPASS[sector((1, 1))] == "north-east" and COMPASS[sector((-3, -1))] == "west"
    assert CLOCK[sector((0, 2), 1)] == "around 9 o'clock"  # north is on the left of one facing east


def test_ego_components_and_facings():
    assert ego((0, 3), 0) == (3, 0) and ego((0, 3), 1) == (0, -3) and ego((2, 1), 2) == (-1, -2)
    assert [relative_facing(h, 1) for h in range(4)] == [3, 0, 1, 2]  # north is on the left of one facing east
