"""The all-reduce a tensor-parallel decode step pays, per call, on two GPUs (NCCL inside a CUDA
graph, as the decode graphs run it): [T, 4096] activations in bf16, in fp32, and the fp32 form
with its casts (`Parallel.all_reduce` on bf16 input). `python3 bench/probe_allreduce.py [OUT]`."""

from __future__ import annotations

import json
import sys

import torch

from dsv4 import parallel

N = 50  # all-reduces per graph


def _rank(out: str) -> None:
    par = parallel.from_env()
    dev = parallel.init(par, "cuda")
    rows = []
    for T in (1, 16, 64):
        for name in ("bf16", "fp32", "bf16 via fp32 (+casts)"):
            dtype = torch.float32 if name == "fp32" else torch.bfloat16
            x = torch.randn(T, 4096, device=dev, dtype=dtype)
            if name.startswith("bf16 via"):

                def op(x=x):  # noqa: ANN202
                    return par.all_reduce(x)
            else:

                def op(x=x):  # noqa: ANN202
                    torch.distributed.all_reduce(x)
                    return x

            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    op()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(N):
                    op()
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.distributed.barrier()
                a.record()
                g.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / N)
            times.sort()
            rows.append(
                {
                    "T": T,
                    "form": name,
                    "us_median": times[2],
                    "us_min": times[0],
                    "us_max": times[-1],
                }
            )
    if par.rank == 0:
        for r in rows:
            print(
                f"T={r['T']:3d} {r['form']:24s} {r['us_median']:7.2f} us (min {r['us_min']:.2f}, max {r['us_max']:.2f})"
            )
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    parallel.spawn(2, _rank, sys.argv[1] if len(sys.argv) > 1 else "allreduce.json")
