"""Compile `sparse_attn`'s fixed tiles and its autotune tiles for small shared memory for GPUs
this machine does not have (no GPU needed).

  python3 tests/ops/compile_tiles.py --arch 90 120 [--only NAME]  ->  JSON {tile: {arch: bytes}}

Each tile's launch is captured from the launcher on the CPU (the kernel is not run), its
constexprs set to what a GPU launch passes, and the kernel compiled with Triton for each
sm_<arch>. Run without TRITON_INTERPRET (the interpreter replaces Triton's builder):
`tests/ops/test_targets.py` runs it in a subprocess.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dsv4.bench.compile import launch_signature
from dsv4.ops import sparse_attn as sa
from dsv4.quant import kv_entry_layout, quant_kv_entries

OPTIONS = ("num_warps", "num_stages")
# constexprs as a GPU launch passes them (the CPU launch picks the interpreter's forms)
ON_GPU = dict(UPCAST=False, PRECISION="tf32", FP8_DECODE=1, SPLIT=True, PDL=True, ALIGNED=True)
# (name, tokens, FP8 entries, tile): T tokens of 64 heads x 512 channels, 128 + 512 keys
TILES = [
    ("FEW_TOKENS_TILE", 1, False, sa.FEW_TOKENS_TILE),
    ("FEW_TOKENS_TILE_FP8", 1, True, sa.FEW_TOKENS_TILE_FP8),
    ("FP8_MANY_TOKENS_TILE", 64, True, sa.FP8_MANY_TOKENS_TILE),
] + [  # the autotuner's tiles for small shared memory, over FP8 entries
    (f"SMALL_SHARED_SHAPES[{i}] fp8", 64, True, sa.shape_tile(shape))
    for i, shape in enumerate(sa.SMALL_SHARED_SHAPES)
]


def capture(T: int, entries: bool, tile: dict) -> tuple[tuple, dict]:
    """(args, kwargs) of the `_sparse_attn_kernel` launch `sparse_attn` makes with `tile`."""
    calls = []

    class Launch:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            return lambda *a, **kw: calls.append((a, kw))

    q = torch.randn(T, 64, 512, dtype=torch.bfloat16)
    kv = torch.randn(700, 512, dtype=torch.bfloat16)
    src = quant_kv_entries(kv, 64) if entries else kv
    assert src.shape[1] == (kv_entry_layout(512, 64)[2] if entries else 512)
    idx = torch.randint(0, 700, (T, 640), dtype=torch.int32)
    kernel, sa._sparse_attn_kernel = sa._sparse_attn_kernel, Launch()
    try:
        sa.sparse_attn(
            q, (src,), torch.zeros(64), idx, 0.04, 64 if entries else 0, num_splits=1, config=tile
        )
    finally:
        sa._sparse_attn_kernel = kernel
    return calls[0]


def shared_bytes(args: tuple, kwargs: dict, arch: int) -> int:
    """Shared memory of the captured launch compiled for sm_<arch>."""
    kernel = sa._sparse_attn_kernel
    sig, consts, attrs = launch_signature(kernel, args, kwargs, ON_GPU)
    src = ASTSource(kernel, sig, constexprs=consts, attrs=attrs)
    options = {o: kwargs[o] for o in OPTIONS}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options).metadata.shared


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90, 120])
    p.add_argument("--only", default="", help="tiles whose name contains this")
    ns = p.parse_args()
    out = {}
    for name, T, entries, tile in TILES:
        if ns.only in name:
            args, kwargs = capture(T, entries, dict(tile))
            out[name] = {str(a): shared_bytes(args, kwargs, a) for a in ns.arch}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
