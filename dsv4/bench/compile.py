"""Compiling a captured kernel launch without a GPU (the tools that check kernels for GPUs this
machine does not have: tests/ops/compile_tiles.py, bench/sm90_compile.py)."""

from __future__ import annotations

import torch

DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32",
          torch.uint8: "u8"}  # fmt: skip


def launch_signature(
    kernel, args: tuple, kwargs: dict, overrides: dict | None = None, int_divisibility: bool = False
) -> tuple[dict, dict, dict]:  # noqa: ANN001
    """(signature, constexprs, attrs) for `ASTSource(kernel, ...)` from a captured launch
    (args, kwargs): tensors as pointers (16-byte aligned where they are), floats fp32, ints i32 (with
    int_divisibility, those divisible by 16 marked so, as a GPU launch specializes them);
    `overrides`: parameter values as a GPU launch passes them."""
    overrides = overrides or {}
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = kwargs[p.name] if p.name in kwargs else (args[i] if i < len(args) else p.default)
        v = overrides.get(p.name, v)
        if p.is_constexpr:
            sig[p.name], consts[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + DTYPES[v.dtype]
            if v.data_ptr() % 16 == 0:  # (as a GPU launch specializes a pointer)
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
            if int_divisibility and v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs
