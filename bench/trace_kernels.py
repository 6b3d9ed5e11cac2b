"""GPU kernels of one traced decode step (`dsv4 bench step --trace FILE`), by device time.

Reads the chrome trace(s) torch.profiler wrote (FILE.bB.cL.json, optionally .gz) and prints, per
trace, the kernel count and device time, then the kernels by total time: name (shortened), calls,
total and mean µs. Kernels of one step of a 3-layer bench model: the launches a layer costs and
which of them to fuse first.
Usage: python3 bench/trace_kernels.py TRACE.json[.gz] ... [--top N] [--json OUT]"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict


def load(path: str) -> list[dict]:
    """The trace's kernels, each named after the torch op that launched it (aten::add ->
    elementwise_kernel), so the many elementwise kernels stay apart."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    ops = {
        e["args"]["External id"]: e["name"]
        for e in events
        if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
    }
    kernels = []
    for e in events:
        if e.get("cat") == "kernel" and e.get("ph") == "X":
            op = ops.get(e.get("args", {}).get("External id"))
            kernels.append(e | {"name": f"{op} -> {short(e['name'])}" if op else short(e["name"])})
    return kernels


def short(name: str) -> str:
    # template arguments and parameter lists say little here; keep the kernel's own name
    name = re.sub(r"<.*>", "<>", name)
    name = re.sub(r"\(.*\)", "", name)
    return name[:90]


def summarize(kernels: list[dict]) -> dict:
    by = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        row = by[k["name"]]
        row[0] += 1
        row[1] += float(k.get("dur", 0.0))
    rows = sorted(({"kernel": n, "calls": c, "us": t} for n, (c, t) in by.items()),
                  key=lambda r: -r["us"])  # fmt: skip
    return {"kernels": len(kernels), "us": sum(r["us"] for r in rows), "by_name": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("traces", nargs="+")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    out = {}
    for path in ns.traces:
        s = summarize(load(path))
        out[path] = s
        print(f"{path}: {s['kernels']} kernels, {s['us']:.1f} us of device time")
        for r in s["by_name"][: ns.top]:
            print(
                f"  {r['us']:9.1f} us {r['calls']:5d} x {r['us'] / r['calls']:7.2f}  {r['kernel']}"
            )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
