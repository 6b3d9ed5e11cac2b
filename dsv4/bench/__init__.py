"""`dsv4 bench step` (one decode/prefill step at real width), `dsv4 bench ops` (kernel timings) and
`dsv4 bench serve` (load on a running server: throughput, TTFT, TPOT)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("step", "ops", "serve"):
        print("usage: dsv4 bench {step,ops,serve} [--help]", file=sys.stderr)
        return 2
    if argv[0] == "step":
        from dsv4.bench.step import main as step_main

        return step_main(argv[1:])
    if argv[0] == "serve":
        from dsv4.bench.serve import main as serve_main

        return serve_main(argv[1:])
    from dsv4.bench.ops import main as ops_main

    return ops_main(argv[1:])
