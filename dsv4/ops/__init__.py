"""The op interface: `select(EngineConfig.ops)` returns the module whose functions the model calls.

Each backend module exports the same functions as `dsv4.ops.ref` (the torch reference):
linear, grouped_linear, rms_norm, rotary, sparse_attn, hc_pre, hc_post, hc_head, compress_pool,
index_topk, stable_topk. This is the only backend dispatch in the package.
"""

from __future__ import annotations

from types import ModuleType


def select(name: str) -> ModuleType:
    if name == "ref":
        from dsv4.ops import ref

        return ref
    raise ValueError(f"unknown op backend {name!r} (available: 'ref')")
