"""Parse time of every agent format on megabyte adversarial responses (linear-time parsing).

The inputs are those of ``tests/agent/test_formats.py`` (a million ``<``, 150,000 unclosed ``<think>``,
330,000 comma-separated actions, ...), at their full size. Parsing is linear in the response's length: the
72 parses take about 5 s on one slow core, where quadratic work would take hours. The tests check the
results and count the work at small sizes; this times it, apart from the test run, where a busy machine
would make any time limit flaky.

    python benchmarks/format_parse.py [--fraction 1.0] [--limit-s 60]

Prints each format's time; exits 1 if the whole run took longer than ``--limit-s``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.agent.test_formats import ADVERSARIAL, ALL_FORMATS, adversarial, names_for  # noqa: E402
from turnrl.agent import get_format  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fraction", type=float, default=1.0, help="input size as a fraction of a megabyte")
    parser.add_argument("--limit-s", type=float, default=60.0, help="fail when all parses take longer")
    args = parser.parse_args()
    total = 0.0
    for name in ALL_FORMATS:
        fmt = get_format(name, max_actions_per_turn=3)
        start = time.perf_counter()
        for index in range(len(ADVERSARIAL)):
            fmt.parse(adversarial(index, args.fraction), names_for(name) if index % 2 else None)
        took = time.perf_counter() - start
        total += took
        print(f"{name:<26} {took:6.2f} s")
    print(f"{'all':<26} {total:6.2f} s ({len(ALL_FORMATS) * len(ADVERSARIAL)} parses)")
    return 0 if total <= args.limit_s else 1


if __name__ == "__main__":
    sys.exit(main())
