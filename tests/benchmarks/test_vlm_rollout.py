"""The VLM rollout benchmark's reading of an allocator trace: the peak above where it began, what was live."""

from __future__ import annotations

from benchmarks.vlm_rollout import live_at_peak, made_at


def event(action: str, addr: int, size: int, where: str = "turnrl/engine/engine.py") -> dict:
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": "/usr/lib/python3/torch/functional.py", "line": 1, "name": "f"},
                       {"filename": f"/site/{where}", "line": 7, "name": "g"}]}


def test_the_peak_and_its_live_allocations_come_from_replaying_the_trace():
    events = [
        event("alloc", 1, 100), event("alloc", 2, 50, "transformers/models/x.py"),
        event("segment_alloc", 9, 4096),  # the allocator's own reservations are not allocations
        event("free_requested", 1, 100), event("free_completed", 1, 100),
        event("alloc", 3, 120),  # 170: the peak, with 2 and 3 live
        event("free_completed", 77, 500),  # a block allocated before the trace began, freed: below the start
        event("alloc", 4, 400),  # 170 - 500 + 400 = 70: below the peak
    ]
    peak, live = live_at_peak(events)
    assert peak == 170
    assert [e["addr"] for e in live] == [3, 2]  # largest first
    assert made_at(live[1]) == "transformers/models/x.py:7 g"
    assert made_at({"frames": [{"filename": "/torch/a.py", "line": 1, "name": "h"}]}).startswith("(outside")
