"""The all-reduce a tensor-parallel decode step pays, per call, on two GPUs, inside a CUDA graph as
the decode graphs run it: [T, 4096] activations through NCCL in bf16, in fp32, and bf16 through
fp32 (`Parallel.all_reduce`); and PyTorch's symmetric-memory one-shot all-reduce (peer loads over
NVLink, no multicast), checked against NCCL's sum first. `python3 bench/probe_allreduce.py [OUT]`."""

from __future__ import annotations

import json
import sys

import torch

from dsv4 import parallel

N = 50  # all-reduces per graph
FORMS = ("bf16", "fp32", "bf16 via fp32 (+casts)", "symm one-shot bf16", "symm one-shot fp32")


def _nccl(x: torch.Tensor):  # noqa: ANN202
    def op() -> torch.Tensor:
        torch.distributed.all_reduce(x)
        return x

    return op


def _symm(x: torch.Tensor):  # noqa: ANN202
    import torch.distributed._symmetric_memory as symm_mem

    group = torch.distributed.group.WORLD.group_name
    buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, group)

    def op() -> torch.Tensor:
        buf.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)

    want = x.clone()
    torch.distributed.all_reduce(want)
    got = op()
    torch.cuda.synchronize()
    err = float((got.float() - want.float()).abs().max())
    assert err <= 1e-2 * float(want.float().abs().max()), f"symmetric-memory sum off by {err}"
    return op


def _time(op) -> list[float]:  # noqa: ANN001
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
    return sorted(times)


def _rank(out: str) -> None:
    par = parallel.from_env()
    dev = parallel.init(par, "cuda")
    rows = []
    for T in (1, 16, 64):
        for name in FORMS:
            fp32 = name.endswith("fp32") and "via" not in name
            x = torch.randn(T, 4096, device=dev, dtype=torch.float32 if fp32 else torch.bfloat16)
            row = {"T": T, "form": name}
            try:
                if name.startswith("symm"):
                    op = _symm(x)
                elif "via" in name:
                    op = lambda x=x: par.all_reduce(x)  # noqa: E731
                else:
                    op = _nccl(x)
                t = _time(op)
                row |= {"us_median": t[2], "us_min": t[0], "us_max": t[-1]}
            except Exception as e:  # noqa: BLE001  (symmetric memory missing or refused here)
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
    if par.rank == 0:
        for r in rows:
            what = r.get("error") or (
                f"{r['us_median']:7.2f} us (min {r['us_min']:.2f}, max {r['us_max']:.2f})"
            )
            print(f"T={r['T']:3d} {r['form']:24s} {what}")
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    parallel.spawn(2, _rank, sys.argv[1] if len(sys.argv) > 1 else "allreduce.json")
