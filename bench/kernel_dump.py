"""Every Triton kernel the engine compiles on this GPU, dumped so it can be compiled for others.

  python3 bench/kernel_dump.py OUT.json.gz

Runs `bench ops` (every op family at its real shapes) and decode + prefill steps at Flash width
(bf16 and FP8 state), then writes one record per compiled kernel: its name, TTIR (the IR before
any target-specific layout), the compile options, and what it uses on this GPU (shared memory,
registers, spills). `bench/kernel_targets.py` compiles the same TTIR for sm_100 / sm_120 and
checks each against that target's limits: the configs the launchers chose here (fixed tiles and
autotuned winners) are the ones another GPU gets unless it autotunes differently.
Gluon kernels (sm_90 only, no TTIR) are left out.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json

import torch
from triton.runtime.jit import JITFunction

from dsv4.cli import main as cli

STEP = ["bench", "step", "--preset", "flash", "--ops", "triton", "--layers", "sliding,csa,hca",
        "--batch", "1,64", "--context", "4096", "--prefill", "4096", "--repeat", "1"]  # fmt: skip
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_pdl")


def compiled_kernels() -> list[dict]:
    """Every kernel in the caches of every JITFunction alive, as records (TTIR kernels only)."""
    rows, seen = [], set()
    for fn in gc.get_objects():
        if not isinstance(fn, JITFunction):
            continue
        for caches in fn.device_caches.values():
            for kernel in caches[0].values():
                if "ttir" not in kernel.asm or kernel.hash in seen:
                    continue
                seen.add(kernel.hash)
                try:  # loading the module fills n_regs / n_spills
                    kernel._init_handles()
                except Exception:  # noqa: BLE001  (an autotune config this GPU cannot run)
                    kernel.n_regs = kernel.n_spills = -1
                meta = kernel.metadata._asdict()
                rows.append({
                    "name": kernel.name,
                    "options": {k: meta[k] for k in OPTIONS if k in meta},
                    "shared": meta["shared"],
                    "n_regs": kernel.n_regs,
                    "n_spills": kernel.n_spills,
                    "arch": meta["target"].arch,
                    "ttir": kernel.asm["ttir"],
                })  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the dump (.json.gz)")
    ns = p.parse_args()
    rows: list[dict] = []
    for argv in (["bench", "ops", "--repeat", "1"], STEP, [*STEP, "--kv-cache-dtype", "fp8"]):
        cli(argv)
        torch.cuda.synchronize()
        rows = compiled_kernels()
        with gzip.open(ns.out, "wt") as f:  # after each run: a timeout keeps what was compiled
            json.dump(rows, f)
    worst = sorted(rows, key=lambda r: -r["shared"])[:12]
    print(f"{len(rows)} compiled kernels; most shared memory:")
    for r in worst:
        o = r["options"]
        print(f"  {r['name']:<40} {r['shared'] / 1024:7.1f} KB  {r['n_regs']:3d} regs  "
              f"{r['n_spills']:3d} spills  warps {o['num_warps']} stages {o['num_stages']}")  # fmt: skip


if __name__ == "__main__":
    main()
