"""What a test of a given level asserts: refused, naming why, where it cannot be won; else won by the expert."""

from __future__ import annotations

from typing import Any

import pytest

from turnrl.envs.contract import TurnEnv


def refused_or_won(env: TurnEnv, level: Any, winnable: bool, refusal: str) -> None:
    """``env.reset(options={"level": level})`` raises a ValueError matching ``refusal`` unless ``winnable`` (as a
    plain reference search says); a level it accepts is won by following ``env.solve()``."""
    if not winnable:
        with pytest.raises(ValueError, match=refusal):
            env.reset(options={"level": level})
        return
    env.reset(options={"level": level})
    plan = env.solve()
    assert plan is not None
    for action in plan:
        env.step(action)
    assert env.success()
