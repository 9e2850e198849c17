"""The package's layout: each module name once, so that a name says which module is meant."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import turnrl

PACKAGE = Path(turnrl.__file__).parent


def test_no_module_name_appears_twice_in_the_package():
    places: dict[str, list[str]] = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            places[path.name].append(str(path.relative_to(PACKAGE)))
    assert len(places) > 100
    assert {name: where for name, where in places.items() if len(where) > 1} == {}
