"""Where does an eager step's host time go? A Flash-width decode step (and a prefill chunk) run
eagerly, as the engine runs every step that carries a prefill chunk: host milliseconds per step
(launches issued, no sync inside), device milliseconds, then a cProfile of the steps grouped by
where the time is spent (Triton's launch path, torch, dsv4's own Python) and the top functions.

Then (--piecewise) the same steps through `dsv4.piecewise` (pieces replayed as CUDA graphs, the
attention eager between them) against the eager forward, side by side: prefill chunks of
several lengths and a mixed step (16 decodes at --context beside a 256-token chunk).

Usage: python3 bench/host_step.py [--layers sliding,csa,hca] [--batch 1] [--context 4096]
       [--chunk 512] [--steps 10] [--piecewise 16,64,256,512,1024,2048] [--json FILE]"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch

from dsv4.bench.step import Bench, decode_stepper, parse_args, prefill_stepper
from dsv4.bench.weights import fill_state_
from dsv4.piecewise import PiecewiseGraphs
from dsv4.state import Batch, DecodeState

GROUPS = (  # (name, path fragment) in order: the first that matches a function's file
    ("triton launch", "/triton/"),
    ("torch", "/torch/"),
    ("dsv4 ops", "/dsv4/ops/"),
    ("dsv4 model/state", "/dsv4/"),
)


def host_and_device(step, n: int) -> tuple[list[float], list[float]]:  # noqa: ANN001
    host, total = [], []
    for j in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(j)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        total.append((time.perf_counter() - t0) * 1e3)
    return host, total


def grouped(stats: pstats.Stats) -> dict[str, float]:
    # tottime (s) by group: the function's own time, attributed to the file it lives in
    out: dict[str, float] = {}
    for (path, _line, _name), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        group = next((g for g, frag in GROUPS if frag in path), "other")
        out[group] = out.get(group, 0.0) + tt
    return out


def profile(name: str, step, n: int, report: dict) -> None:  # noqa: ANN001
    host, total = host_and_device(step, n)
    host.sort()
    total.sort()
    print(f"{name}: host {host[n // 2]:.2f} ms (min {host[0]:.2f}), step {total[n // 2]:.2f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for j in range(n):
        step(j)
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    groups = {g: t / n * 1e3 for g, t in grouped(stats).items()}
    print(
        f"  cProfile, ms a step by where the time is spent (profiled: {stats.total_tt / n * 1e3:.1f})"
    )
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"    {g:<20}{t:8.2f}")
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)
    report[name] = {"host_ms": host[n // 2], "step_ms": total[n // 2], "profile_ms": groups}


def _wall_ms(fn, n: int) -> float:  # noqa: ANN001
    # median wall time of fn() to the GPU's end (host launches and device work)
    return sorted(host_and_device(lambda j: fn(), n)[1])[n // 2]


def piecewise_ab(bench: Bench, lengths: list[int], context: int, n: int, report: dict) -> None:
    model, args, dev = bench.model, bench.args, bench.device
    decodes = 16
    state = DecodeState(args, decodes + 1, context + 2048 + 8, bench.dtype, dev)
    fill_state_(state, 1)
    pieces = PiecewiseGraphs(model, state, max(lengths + [decodes + 256]))  # (the mixed steps)
    cases = [(f"prefill {T}", [decodes], [0], [T]) for T in lengths]
    for chunk in (240, 256):  # 256 tokens: no padding (the same kernels); 272: padded to 384
        cases.append(
            (f"{decodes} decodes + {chunk} prefill", list(range(decodes + 1)),
             [context] * decodes + [0], [1] * decodes + [chunk])
        )  # fmt: skip
    rows = []
    print(f"{'step':<28}{'eager ms':>10}{'pieces ms':>11}{'x':>7}{'max rel diff':>14}")
    for name, slots, starts, lens in cases:
        T = sum(lens)
        ids = torch.randint(0, args.vocab_size, (T,), device=dev)

        def eager() -> torch.Tensor:
            return model(ids, Batch.build(slots, starts, lens, state), state)  # noqa: B023

        def piece() -> torch.Tensor:
            return pieces.run(ids, Batch.build(slots, starts, lens, state))  # noqa: B023

        want = eager().float()
        got = piece()  # (captures its bucket)
        if got is None:
            print(f"{name}: not served by the pieces")
            continue
        err = (got.float() - want).abs().flatten(1).amax(1) / want.abs().max()
        diff = err.max().item()
        if diff > 1e-3:  # which rows: a routing flip moves a few rows a lot
            q = torch.quantile(err, torch.tensor([0.5, 0.9, 0.99], device=err.device)).tolist()
            print(f"  {name}: {int((err > 1e-3).sum())} of {T} rows differ by > 1e-3; "
                  f"row quantiles 50/90/99% {q[0]:.1e} / {q[1]:.1e} / {q[2]:.1e}")  # fmt: skip
            # the same padded pieces run eagerly (no graphs): equal to the replay when the
            # graphs are right, so what is left is the padded kernels' numerics, not capture
            loose = PiecewiseGraphs(model, state, pieces.max_tokens, capture=False)
            same = loose.run(ids, Batch.build(slots, starts, lens, state))
            print(f"  {name}: replay vs the same pieces uncaptured: max |diff| "
                  f"{(same.float() - got.float()).abs().max().item():.2e}")  # fmt: skip
        e1, p1, e2, p2 = (_wall_ms(f, n) for f in (eager, piece, eager, piece))
        e, p = min(e1, e2), min(p1, p2)
        print(
            f"{name:<28}{e:>10.2f}{p:>11.2f}{e / p:>7.2f}{diff:>14.2e}   ({e1:.2f}/{e2:.2f}, {p1:.2f}/{p2:.2f})"
        )
        rows.append({"step": name, "tokens": T, "eager_ms": [e1, e2], "pieces_ms": [p1, p2],
                     "max_rel_diff": diff})  # fmt: skip
    report["piecewise"] = rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="sliding,csa,hca")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--piecewise", default="")
    p.add_argument("--skip-profile", action="store_true")
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    a = parse_args(
        ["--preset", "flash", "--ops", "triton", "--layers", ns.layers, "--batch", str(ns.batch),
         "--context", str(ns.context), "--prefill", "0"]
    )  # fmt: skip
    bench = Bench(a)
    model, args, dev = bench.model, bench.args, bench.device
    bench.clock.paused = True  # no per-layer CUDA events
    report: dict = {}
    with torch.inference_mode():
        state = DecodeState(args, ns.batch, ns.context + 4 * ns.steps, bench.dtype, dev)
        fill_state_(state, 0)
        ids = torch.randint(0, args.vocab_size, (ns.batch,), device=dev)
        step = decode_stepper(model, state, ns.batch, ns.context, ids, bench.clock)
        for j in range(3):
            step(j)
        pstate = DecodeState(args, 1, ns.chunk + 1, bench.dtype, dev)
        pids = torch.randint(0, args.vocab_size, (ns.chunk,), device=dev)
        pstep = prefill_stepper(model, pstate, pids, ns.chunk, bench.clock)
        for j in range(2):
            pstep(j)
        if not ns.skip_profile:
            profile(f"decode batch {ns.batch}, eager", step, ns.steps, report)
            profile(f"prefill chunk {ns.chunk}, eager", pstep, ns.steps, report)
        if ns.piecewise:
            lengths = [int(t) for t in ns.piecewise.split(",")]
            piecewise_ab(bench, lengths, ns.context, ns.steps, report)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
