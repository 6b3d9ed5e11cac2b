"""`dsv4 bench step` (one decode/prefill step at real width), `dsv4 bench ops` (kernel timings),
`dsv4 bench serve` (load on a running server: throughput, TTFT, TPOT) and `dsv4 bench one-batch`
(SGLang's bench_one_batch: one static batch through the engine)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("step", "ops", "serve", "one-batch", "one_batch"):
        print("usage: dsv4 bench {step,ops,serve,one-batch} [--help]", file=sys.stderr)
        return 2
    if argv[0] in ("one-batch", "one_batch"):
        from dsv4.bench.one_batch import main as one_batch_main

        return one_batch_main(argv[1:])
    if argv[0] == "step":
        from dsv4.bench.step import main as step_main

        return step_main(argv[1:])
    if argv[0] == "serve":
        from dsv4.bench.serve import main as serve_main

        return serve_main(argv[1:])
    from dsv4.bench.ops import main as ops_main

    return ops_main(argv[1:])
