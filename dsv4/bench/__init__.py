"""`dsv4 bench step` (one decode/prefill step at real width) and `dsv4 bench ops` (kernel timings)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("step", "ops"):
        print("usage: dsv4 bench {step,ops} [--help]", file=sys.stderr)
        return 2
    if argv[0] == "step":
        from dsv4.bench.step import main as step_main

        return step_main(argv[1:])
    from dsv4.bench.ops import main as ops_main

    return ops_main(argv[1:])
