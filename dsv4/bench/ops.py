"""Kernel microbenchmarks: each Triton op against its torch reference and the copy bandwidth
measured in the same run.

A case module (`dsv4/bench/cases_<op>.py`) exports `cases(device, quick) -> list[Case]`. On a GPU
every case is timed with triton.testing.do_bench (L2 cleared before each call; median of
`--repeat` medians); on the CPU (Triton interpreter) each case runs once and is checked against
its reference, which is how CI exercises the harness.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

CASE_MODULES = ("sparse_attn", "indexer", "mhc", "rope", "moe", "linear")


@dataclass
class Case:
    """One shape of one op: the kernel call, the reference call, the bytes it must move."""

    op: str
    shape: str  # e.g. "B=64 K=640"
    run: Callable[[], object]
    ref: Callable[[], object]
    bytes: int  # the fewest bytes the op must read + write
    target_us: float | None = None  # the issue's latency target, if any
    target_bw: float | None = None  # the issue's fraction-of-copy-bandwidth target, if any
    canon: Callable[[object], object] | None = None  # both results' form for the comparison


def _close(a: object, b: object) -> float:
    """Largest relative error over the tensors of two results (fp32 norms)."""
    xs = a if isinstance(a, (tuple, list)) else (a,)
    ys = b if isinstance(b, (tuple, list)) else (b,)
    err = 0.0
    for x, y in zip(xs, ys):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            d = (x.float() - y.float()).norm() / y.float().norm().clamp(min=1e-30)
            err = max(err, float(d))
        elif isinstance(x, torch.Tensor):
            err = max(err, float((x != y).float().mean()))
    return err


def _time_us(fn: Callable[[], object], repeat: int) -> list[float]:
    # the issue's measure: do_bench medians. do_bench clears L2 (a 256 MB memset) before every
    # timed call; the call's host time counts where it exceeds the memset's device time
    from triton.testing import do_bench

    return [do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(repeat)]


@functools.cache
def _l2_flush_buffer() -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # > the 60 MB L2


def replay_ms(g: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    """Milliseconds per replay of a captured graph, after one replay not timed."""
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / replays


def _graph_us(
    fn: Callable[[], object], repeat: int, n: int = 20, cold: bool = True, clean: bool = False
) -> list[float] | None:
    """Device time without host launch cost, L2 still cleared: a CUDA graph of n x (memset 256 MB,
    fn) minus a graph of n x memset, per call (None when fn cannot be captured). cold=False: a
    graph of n back-to-back calls, L2 warm. clean: the 256 MB are read instead of written, so L2
    is left holding clean lines (a memset, as `triton.testing.do_bench` clears L2, leaves dirty
    lines, and fn's first reads then also pay their write-back)."""
    flush = _l2_flush_buffer()
    flush_words = flush.view(torch.int32)

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                if cold and clean:
                    flush_words.amax()
                elif cold:
                    flush.zero_()
                if with_fn:
                    fn()
        return g

    try:
        for _ in range(3):
            fn()  # compile / autotune outside the capture
        torch.cuda.synchronize()
        g1, g0 = capture(True), capture(False)
    except Exception:  # noqa: BLE001  (not capturable: host syncs inside)
        torch.cuda.synchronize()
        return None

    out = []
    for _ in range(repeat):
        t1 = statistics.median(replay_ms(g1) for _ in range(3))
        t0 = statistics.median(replay_ms(g0) for _ in range(3)) if cold else 0.0
        out.append(max(t1 - t0, 0.0) * 1e3 / n)
    return out


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """Device-to-device copy bandwidth in B/s, counting bytes read + written (after a warm-up that
    takes the clocks out of idle)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(50):
        dst.copy_(src)
    t = min(statistics.median(_time_us(lambda: dst.copy_(src), 1)) for _ in range(repeat))
    return 2 * nbytes / (t * 1e-6)


def run_cases(cases: list[Case], device: str, repeat: int) -> tuple[float | None, list[dict]]:
    timed = device.startswith("cuda")
    bw = copy_bandwidth(device) if timed else None
    rows = []
    for c in cases:
        got, want = c.run(), c.ref()
        if c.canon is not None:
            got, want = c.canon(got), c.canon(want)
        row = {"op": c.op, "shape": c.shape, "bytes": c.bytes, "rel_err": _close(got, want)}
        if timed:
            ts, tr = _time_us(c.run, repeat), _time_us(c.ref, repeat)
            t = statistics.median(ts)
            tg = _graph_us(c.run, repeat)
            # the reference's device time too (a few calls: some references take milliseconds),
            # so "faster than the reference" is also read without host launch cost
            tgr = _graph_us(c.ref, 1, n=5)
            row.update(
                graph_us=None if tg is None else statistics.median(tg),
                ref_graph_us=None if tgr is None else tgr[0],
                graph_speedup=None if not (tg and tgr) else tgr[0] / statistics.median(tg),
                graph_pct_copy_bw=None
                if not tg
                else 100 * c.bytes / (statistics.median(tg) * 1e-6) / bw,
            )
            row.update(
                us=t,
                us_spread=(min(ts), max(ts)),
                ref_us=statistics.median(tr),
                speedup=statistics.median(tr) / t,
                gbps=c.bytes / (t * 1e-6) / 1e9,
                pct_copy_bw=100 * c.bytes / (t * 1e-6) / bw,
                target_us=c.target_us,
                target_pct_bw=None if c.target_bw is None else 100 * c.target_bw,
            )
        rows.append(row)
    return bw, rows


def _print(bw: float | None, rows: list[dict]) -> None:
    if bw is not None:
        print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    print("us: do_bench median (L2 cleared, host launch cost included where it shows);")
    print("graph: CUDA-graph replay minus the L2-clearing memset (device time only; x ref: the")
    print("reference's graph time over it)")
    print(
        f"{'op':<14}{'shape':<30}{'us':>9}{'ref us':>10}{'x ref':>7}{'GB/s':>8}{'%bw':>6}"
        f"{'graph us':>9}{'%bw':>6}{'x ref':>7}{'err':>9}"
    )
    for r in rows:
        if "us" in r:
            g, x = r["graph_us"], r["graph_speedup"]
            gs = f"{g:>9.2f}{r['graph_pct_copy_bw']:>6.0f}" if g else f"{'-':>9}{'-':>6}"
            gs += f"{x:>7.1f}" if x else f"{'-':>7}"
            print(
                f"{r['op']:<14}{r['shape']:<30}{r['us']:>9.2f}{r['ref_us']:>10.2f}"
                f"{r['speedup']:>7.1f}{r['gbps']:>8.0f}{r['pct_copy_bw']:>6.0f}{gs}"
                f"{r['rel_err']:>9.1e}"
            )
        else:
            print(
                f"{r['op']:<14}{r['shape']:<30}{'-':>9}{'-':>10}{'-':>7}{'-':>8}{'-':>6}{r['rel_err']:>9.1e}"
            )
    # the issue's "faster than the reference at every shape", on device time
    ratios = [
        (r["graph_speedup"], f"{r['op']} {r['shape']}") for r in rows if r.get("graph_speedup")
    ]
    if ratios:
        slow = [name for x, name in ratios if x <= 1.0]
        least = min(ratios)
        print(
            f"device time vs reference: {len(ratios) - len(slow)} of {len(ratios)} cases faster "
            f"(least x{least[0]:.1f}: {least[1]})"
            + (f"; not faster: {', '.join(slow)}" if slow else "")
        )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dsv4 bench ops", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", action="append", choices=CASE_MODULES, help="op family (repeatable)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the CPU/CI mode)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per case (median reported)")
    p.add_argument("--json", default=None, help="write the rows here")
    ns = p.parse_args(argv)
    quick = ns.quick or not ns.device.startswith("cuda")
    cases: list[Case] = []
    for name in ns.only or CASE_MODULES:
        mod = importlib.import_module(f"dsv4.bench.cases_{name}")
        cases += mod.cases(ns.device, quick)
    bw, rows = run_cases(cases, ns.device, ns.repeat)
    _print(bw, rows)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"device": ns.device, "copy_bw": bw, "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["rel_err"] <= 2e-2]
    if bad:
        print(f"error: {len(bad)} case(s) disagree with their reference", file=sys.stderr)
        return 1
    return 0
