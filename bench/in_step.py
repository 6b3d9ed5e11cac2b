"""Time one function as the model calls it: wrap it with CUDA events, run any `dsv4` command
(a `bench step`, say), and print each call shape's count and median device µs at exit.

  python3 -P bench/in_step.py --wrap dsv4.ops.indexer._scores [--set MODULE.NAME=VALUE ...] \\
      -- bench step --preset flash --ops triton --layers csa --prefill-context 1048576 --chunk 2048

A standalone probe times a kernel on its own inputs after an L2 clear; inside a step the same
kernel can run differently (the forty-eighth session's Gluon prefill score kernel: 10% faster
in its probe, 7% slower per call in the step; docs/PERF.md). Calls made while a CUDA graph is
captured (`bench step --graph`) get events recorded into the graph (`external=True`) and report
their last replay's device time: the way to time a decode step's kernels. An eager call's time
runs from the GPU reaching its start event to its end: that is device time only while the host
keeps ahead of the GPU (a long prefill); in an eager decode step it includes the host's launch
time. Only callers that look the name up in its module at call time see the wrapper (calls inside
that module do, and `dsv4.ops.select` builds the model's ops after it). The first call of a shape
includes its compile: the median leaves it out once a shape is called three times.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib
import statistics
import sys
import time
from collections import defaultdict

import torch


def _shape(args: tuple) -> tuple:
    return tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wrap", required=True, help="MODULE.FUNCTION to time")
    p.add_argument("--set", action="append", default=[], help="MODULE.NAME=VALUE (a literal)")
    ns = p.parse_args(argv[:cut])
    for item in ns.set:
        target, value = item.split("=", 1)
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(module), name, ast.literal_eval(value))
    module, name = ns.wrap.rsplit(".", 1)
    mod = importlib.import_module(module)
    fn = getattr(mod, name)
    cuda = torch.cuda.is_available()  # (no GPU: host wall time, to try the tool on a CPU)
    # per call shape: eager calls, and calls captured into CUDA graphs
    calls: dict[tuple, list] = defaultdict(list)
    graphed: dict[tuple, list] = defaultdict(list)

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not cuda:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            calls[_shape(args)].append((time.perf_counter() - t0) * 1e6)
            return out
        capturing = torch.cuda.is_current_stream_capturing()
        start, end = (torch.cuda.Event(enable_timing=True, external=capturing) for _ in range(2))
        start.record()
        out = fn(*args, **kwargs)
        end.record()
        (graphed if capturing else calls)[_shape(args)].append((start, end))
        return out

    def report() -> None:
        if cuda:
            torch.cuda.synchronize()
        what = "device" if cuda else "host (no GPU)"
        for title, table in (("eager calls", calls), ("in CUDA graphs, last replay", graphed)):
            if not table:
                continue
            print(f"{ns.wrap} {' '.join(ns.set)}: {what} us per call, {title}, by tensor shapes")
            for shape, evs in sorted(table.items(), key=lambda kv: -len(kv[1])):
                us = [s.elapsed_time(e) * 1e3 for s, e in evs] if cuda else evs
                print(f"  {len(us):5d} calls, median {statistics.median(us):10.1f} us: {shape}")

    setattr(mod, name, timed)
    atexit.register(report)
    from dsv4.cli import main as cli

    sys.exit(cli(argv[cut + 1 :]))


if __name__ == "__main__":
    main()
