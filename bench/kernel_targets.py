"""Compile the kernels of a `bench/kernel_dump.py` dump for other GPUs and check them against
each target's limits.

  python3 bench/kernel_targets.py kernels.json.gz [--arch 100 120] [--json OUT]

Each kernel's TTIR is compiled with the options it had on the GPU that ran it, for each target
(no GPU needed; run with the Triton version that made the dump). Reported: shared memory against
the target's per-block limit, registers and spills from ptxas. A kernel over the limit fails to
launch there with OutOfResources, unless its launcher picks another config for that GPU.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from dsv4.ops.device import shared_memory_of  # opt-in shared memory per block


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    # (registers, spill bytes) of the kernel by ptxas -v
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        err = subprocess.run(
            [ptxas, f"-arch=sm_{arch}{suffix}", "-v", f"{d}/k.ptx", "-o", f"{d}/k.o"],
            capture_output=True, text=True, check=False,
        ).stderr  # fmt: skip
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    return (int(regs.group(1)) if regs else -1), (int(spill.group(1)) if spill else 0)


def compile_for(row: dict, arch: int) -> dict:
    """One dumped kernel compiled for sm_`arch`: shared bytes, registers, spills (or the error)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{row['name']}.ttir"
        path.write_text(row["ttir"])
        try:
            ck = triton.compile(
                str(path), target=GPUTarget("cuda", arch, 32), options=row["options"]
            )
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    regs, spills = _ptxas_usage(ck.asm["ptx"], arch)
    return {"shared": ck.metadata.shared, "n_regs": regs, "n_spills": spills}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dump", help="bench/kernel_dump.py output (.json.gz)")
    p.add_argument("--arch", type=int, nargs="+", default=[100, 120])
    p.add_argument("--only", default="", help="kernel names containing this")
    p.add_argument("--json", help="write the results here")
    ns = p.parse_args()
    with gzip.open(ns.dump, "rt") as f:
        rows = [r for r in json.load(f) if ns.only in r["name"]]
    results, over = [], 0
    head = "".join(f" | sm_{a} KB regs spill" for a in ns.arch)
    here = rows[0]["arch"] if rows else "?"
    print(f"{'kernel':<36} warps stages | sm_{here} KB regs spill{head}")
    for r in sorted(rows, key=lambda r: (r["name"], -r["shared"])):
        res = {a: compile_for(r, a) for a in ns.arch}
        results.append({"name": r["name"], "options": r["options"], "dumped": r["shared"],
                        "targets": res})  # fmt: skip
        cells = []
        for a, x in res.items():
            if "error" in x:
                cells.append(f" | {x['error'][:40]}")
                over += 1
                continue
            bad = x["shared"] > shared_memory_of(divmod(a, 10))
            over += bad
            mark = "!" if bad else " "
            cells.append(f" | {x['shared'] / 1024:6.1f}{mark} {x['n_regs']:4d} {x['n_spills']:5d}")
        o = r["options"]
        print(f"{r['name'][:36]:<36} {o['num_warps']:5d} {o['num_stages']:6d} | "
              f"{r['shared'] / 1024:6.1f}  {r['n_regs']:4d} {r['n_spills']:5d}{''.join(cells)}")  # fmt: skip
    print(
        f"{len(rows)} kernels; {over} (kernel, target) pairs over the shared-memory limit or failing"
    )
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
