"""Compile the Gluon sparse-attention kernel (`dsv4.ops.sparse_attn_sm90._decode_kernel`) for
sm_90a on a machine with no GPU: compile errors, shared memory, registers and spills (ptxas -v),
and the PTX / SASS to read, before any device time is spent.

The device image has Triton 3.6; the CPU venv's newer Triton has removed Gluon APIs this kernel
uses (`async_copy_global_to_shared`), so this runs under a Triton 3.6 venv that sees the main
venv's torch:

  pip download triton==3.6.0 --no-deps -d /tmp/tw && python3 -m venv /tmp/t36
  /tmp/t36/bin/pip install /tmp/tw/triton-3.6.0-*.whl
  echo $PWD/.venv/lib/python3.11/site-packages > /tmp/t36/lib/python3.11/site-packages/zz_main.pth
  PYTHONPATH=$PWD /tmp/t36/bin/python bench/sm90_compile.py [CASE ...] [--out DIR]

CASE: fixup (2 splits, the in-kernel combine, each split half the heads), fixup_rope (with the
inverse RoPE), fixup_oneway / fixup_oneway_rope (split 1 combines all the heads), split3 (3
splits, partials for the combine launch), one (unsplit), bn32 (32-key tiles, 2 splits), three
(unsplit over three sources: a prefill chunk's ring, new rows and entries), one_rope (unsplit,
the inverse RoPE in the kernel), entries / entries_rope / entries_one_rope / three_entries /
three_entries_split3 (FP8 entries: 2 splits, with the inverse RoPE, unsplit with it, ...);
default all. The launch is captured
from the launcher on CPU tensors (T=64, 640 keys), not run.
"""

from __future__ import annotations

import argparse
import os
import subprocess

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from dsv4.bench.compile import launch_signature
from dsv4.ops import sparse_attn_sm90 as sm90
from dsv4.quant import quant_kv_entries

CASES = {
    "fixup": {}, "fixup_rope": {"rope": True}, "fixup_oneway": {"halves": False},
    "fixup_oneway_rope": {"halves": False, "rope": True}, "split3": {"num_splits": 3},
    "one": {"num_splits": 1}, "bn32": {"block_n": 32},
    "three": {"num_splits": 1, "sources": 3}, "one_rope": {"num_splits": 1, "rope": True},
    "entries": {"entries": True}, "entries_rope": {"entries": True, "rope": True},
    "entries_one_rope": {"entries": True, "num_splits": 1, "rope": True},
    "three_entries": {"num_splits": 1, "sources": 3, "entries": True},
    "three_entries_split3": {"num_splits": 3, "sources": 3, "entries": True},
    "entries_overlap": {"entries": True, "rope": True, "overlap": True},
    "entries_one_overlap": {"entries": True, "num_splits": 1, "rope": True, "overlap": True},
}  # fmt: skip


def capture(case: dict) -> tuple[tuple, dict]:
    """(args, kwargs) of the `_decode_kernel` launch the launcher makes for `case`."""
    calls = []

    class Launch:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            return lambda *a, **kw: calls.append((a, kw))

    T = 64
    q = torch.randn(T, 64, 512, dtype=torch.bfloat16)
    kv = torch.randn(2000, 512, dtype=torch.bfloat16)
    if case.get("entries"):  # FP8 entries (448 e4m3 + 64 bf16 rope + scales)
        kv = quant_kv_entries(kv, 64)
    idx = torch.randint(0, 2000, (T, 640), dtype=torch.int32)
    cs = (torch.randn(T, 32), torch.randn(T, 32)) if case.get("rope") else None
    kernel, supported, sms = sm90._decode_kernel, sm90.supported, sm90.num_sms
    sm90._decode_kernel, sm90.supported = Launch(), lambda *a, **k: True
    sm90.num_sms = lambda *a: 132  # an H200's (the launcher's choices as on the GPU)
    sm90.OVERLAP = case.get("overlap", False)
    sm90.FIXUP_HALVES = case.get("halves", True)
    # three sources as views from row 1: an FP8 source 0 then starts on 8 bytes, not 16
    srcs = (kv[1:129], kv[129:162], kv[162:]) if "sources" in case else (kv,)
    try:
        sm90.sparse_attn_sm90(
            q, srcs, torch.zeros(64), idx, 0.04, 64 if case.get("entries") else 0,
            num_splits=case.get("num_splits", 2), inv_rope=cs, block_n=case.get("block_n", 64),
        )  # fmt: skip
    except Exception:  # noqa: BLE001  (the launcher's CPU tail after the captured launch)
        if not calls:
            raise
    finally:
        sm90._decode_kernel, sm90.supported, sm90.num_sms = kernel, supported, sms
        sm90.OVERLAP = False
        sm90.FIXUP_HALVES = True
    return calls[0]


def compile_case(name: str, out: str) -> None:
    args, kwargs = capture(CASES[name])
    kernel = sm90._decode_kernel
    # (PDL as on the GPU; the strides' divisibility decides the cp.async widths)
    sig, consts, attrs = launch_signature(
        kernel, args, kwargs, {"PDL": True}, int_divisibility=True
    )
    src = GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ptx = os.path.join(out, f"{name}.ptx")
    with open(ptx, "w") as f:
        f.write(k.asm["ptx"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cubin = os.path.join(out, f"{name}.cubin")
    info = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                          capture_output=True, text=True).stderr  # fmt: skip
    regs = [ln.strip() for ln in info.splitlines() if "registers" in ln or "spill" in ln]
    with open(os.path.join(out, f"{name}.sass"), "w") as f:
        f.write(subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin],
                               capture_output=True, text=True).stdout)  # fmt: skip
    print(f"{name}: FIXUP {kwargs['FIXUP']} HALVES {kwargs['HALVES']} RD {kwargs['RD']} shared {k.metadata.shared} B; "
          + "; ".join(regs))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cases", nargs="*", default=list(CASES))
    p.add_argument("--out", default="/tmp/sm90_compile")
    ns = p.parse_args()
    os.makedirs(ns.out, exist_ok=True)
    print(f"triton {triton.__version__}")
    for name in ns.cases:
        compile_case(name, ns.out)


if __name__ == "__main__":
    main()
