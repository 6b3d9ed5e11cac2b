"""What rank 0's per-step message to the other tensor-parallel ranks costs on the host (gloo over
loopback): `parallel.send` of a plain step (one broadcast of two integers), of a step carrying an
add (then its pickled bytes, a second broadcast), and the form every step used before (one
`broadcast_object_list`: three broadcasts), side by side in one run. Medians of ROUNDS rounds of N messages.
`python3 bench/probe_control.py [N]`."""

from __future__ import annotations

import statistics
import sys
import time

from dsv4 import parallel

ROUNDS = 5
ADD = ([("add", "req-1", list(range(64)), None)], ())


def _pickled(obj: object) -> None:
    import torch.distributed

    torch.distributed.broadcast_object_list([obj], src=0, group=parallel._CONTROL)


def _forms(rank: int) -> dict:
    lead = rank == 0
    return {
        "plain step (two integers)": (
            (lambda: parallel.send("step")) if lead else parallel.receive
        ),
        "step with an add (+ bytes)": (
            (lambda: parallel.send("step", ADD)) if lead else parallel.receive
        ),
        "pickled every step (before)": (lambda: _pickled(([], "step", ()))),
    }


def _probe(n: int) -> None:
    par = parallel.from_env()
    parallel.init(par, "cpu")
    for name, fn in _forms(par.rank).items():
        for _ in range(50):
            fn()
        times = []
        for _ in range(ROUNDS):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t) / n)
        if par.rank == 0:
            lo, med, hi = min(times), statistics.median(times), max(times)
            print(f"{name:<30}{med * 1e6:>8.1f} us  ({lo * 1e6:.1f} .. {hi * 1e6:.1f})")


if __name__ == "__main__":
    parallel.spawn(2, _probe, int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
