"""The op interface: `select(EngineConfig.ops)` returns the namespace whose functions the model calls.

Every backend exports the functions of `dsv4.ops.ref` (the torch references): linear, grouped_linear,
rms_norm, rotary, norm_rope, norm_rope_qkv, sparse_attn, hc_pre, hc_post, hc_post_pre, hc_head, compress_store, compress_keep,
index_topk, stable_topk, moe_gate, moe_experts, swiglu (and forget_params). "triton" binds the Triton kernels (one module
per op, each beside its reference) and keeps the reference for ops without a kernel. This is the
only backend dispatch in the package.
"""

from __future__ import annotations

from types import SimpleNamespace

from dsv4.ops import ref

OPS = (
    "linear",
    "grouped_linear",
    "rms_norm",
    "rotary",
    "norm_rope",
    "norm_rope_qkv",
    "sparse_attn",
    "hc_pre",
    "hc_post",
    "hc_post_pre",
    "hc_head",
    "compress_store",
    "compress_keep",
    "index_topk",
    "stable_topk",
    "moe_gate",
    "moe_experts",
    "swiglu",
    "forget_params",
)


def _triton() -> SimpleNamespace:
    from dsv4.ops import gate, indexer, linear, mhc, moe, rope, sparse_attn

    fns = {name: getattr(ref, name) for name in OPS}
    fns.update(
        linear=linear.linear,
        grouped_linear=linear.grouped_linear,
        sparse_attn=sparse_attn.sparse_attn,
        index_topk=indexer.index_topk,
        hc_pre=mhc.hc_pre,
        hc_post=mhc.hc_post,
        hc_post_pre=mhc.hc_post_pre,
        hc_head=mhc.hc_head,
        rms_norm=rope.rms_norm,
        rotary=rope.rotary,
        norm_rope=rope.norm_rope,
        norm_rope_qkv=rope.norm_rope_qkv,
        compress_store=rope.compress_store,
        compress_keep=rope.compress_keep,
        moe_gate=gate.moe_gate,
        moe_experts=moe.moe_experts,
        swiglu=moe.swiglu,
        forget_params=moe.forget_params,
    )
    return SimpleNamespace(name="triton", **fns)


def select(name: str) -> SimpleNamespace:
    if name == "ref":
        return SimpleNamespace(name="ref", **{n: getattr(ref, n) for n in OPS})
    if name == "triton":
        return _triton()
    raise ValueError(f"unknown op backend {name!r} (available: 'ref', 'triton')")
