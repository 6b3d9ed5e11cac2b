"""Analytic floor of a decode step or a prefill (`dsv4 roofline`): bytes, FLOPs, time per part."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dsv4 import state
from dsv4.config import CSA, HASH_MOE, HCA, SLIDING, ConfigError, ModelArgs, flash_args


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's datasheet peaks: HBM bytes/s and dense (non-sparse) tensor FLOP/s per dtype."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float
    fp4_flops: float | None  # None: no FP4 tensor cores (Hopper)
    memory_bytes: float
    link_bytes_per_s: float = 0.0  # GPU-to-GPU, one direction (tensor-parallel all-reduces)

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s of a GEMM whose weights are stored as `dtype`."""
        if dtype == "fp32":
            return self.bf16_flops / 2  # fp32 mHC GEMMs run as TF32: half the bf16 rate
        if dtype in ("fp8", "fp4", "nvfp4"):
            # e4m3 activations (1x128 act quant); FP4 experts run W4A8 (Blackwell MXFP8 x MXFP4,
            # Hopper: lossless FP4->FP8 re-encode, spec 10.3); fp4_flops (W4A4) does not apply
            return self.fp8_flops
        return self.bf16_flops


# Dense peaks (sparsity 2:4 doubles them). H100/H200/HBM figures: performance-anchors.md (e.0)
# and the NVIDIA H100/H200 datasheets (989 TF bf16, 1979 TF fp8). B200: HGX B200 datasheet per GPU
# (2.25 PF bf16, 4.5 PF fp8, 9 PF fp4 dense; 8 TB/s; 180 GB). RTX PRO 6000 Blackwell Workstation:
# 1792 GB/s GDDR7, 96 GB, "4000 AI TOPS" (sparse fp4) -> dense 2000 fp4, 1000 fp8, 500 bf16.
# Links, one direction: NVLink 4 (H100/H200 SXM) 900 GB/s both ways, NVLink 5 (B200) 1.8 TB/s,
# the RTX PRO 6000 has no NVLink: PCIe 5.0 x16, ~64 GB/s.
GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", 3.35e12, 989e12, 1979e12, None, 80e9, 450e9),
    "H200": GpuSpec("H200", 4.8e12, 989e12, 1979e12, None, 141e9, 450e9),
    "B200": GpuSpec("B200", 8.0e12, 2250e12, 4500e12, 9000e12, 180e9, 900e9),
    "RTX-PRO-6000": GpuSpec("RTX-PRO-6000", 1.792e12, 500e12, 1000e12, 2000e12, 96e9, 64e9),
}

# tensors split over tensor-parallel ranks (dsv4/parallel.py): the query heads' projections and
# the output groups, the shared expert; routed experts are spread (expert parallel). The rest,
# the one K=V head's state reads included, is replicated on every rank.
SPLIT = {"wq_b", "wo_a", "wo_b", "attn_sink"}


def get_gpu(name: str) -> GpuSpec:
    key = "".join(ch for ch in name.upper() if ch.isalnum())
    for k, spec in GPUS.items():
        if key == "".join(ch for ch in k if ch.isalnum()):
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")


# ---- tensor inventory (spec 10.2) -----------------------------------------------------------


class _T(NamedTuple):
    comp: str  # roofline component
    name: str
    rows: int
    cols: int
    fmt: str  # fp8 | fp4 | nvfp4 | bf16 | fp32
    matmul: bool = True  # False: vectors, ape, embedding (no FLOPs)
    count: int = 1  # routed experts: one entry stands for n_routed_experts copies


def tensor_bytes(rows: int, cols: int, fmt: str) -> float:
    n = rows * cols
    if fmt == "fp8":  # bytes: 1 per e4m3 value + 1 UE8M0 per 128x128 tile
        return n + math.ceil(rows / 128) * math.ceil(cols / 128)
    if fmt == "fp4":  # bytes: 0.5 per e2m1 value + 1 UE8M0 per 32 along a row (MXFP4)
        return n / 2 + rows * math.ceil(cols / 32)
    if fmt == "nvfp4":  # bytes: 0.5 per e2m1 + 1 e4m3 per 16 + fp32 weight_scale_2, input_scale
        return n / 2 + rows * math.ceil(cols / 16) + 8
    return n * {"bf16": 2, "fp32": 4}[fmt]


def _layer_tensors(a: ModelArgs, layer_id: int) -> list[_T]:
    """Tensors of main layer `layer_id`; layer_id >= n_layers is the MTP block (sliding, top-k)."""
    kind = a.layer_types[layer_id] if layer_id < a.n_layers else SLIDING
    hashed = layer_id < a.n_layers and a.mlp_layer_types[layer_id] == HASH_MOE
    w, hd, n = a.weight_dtype, a.head_dim, a.hc_mult
    t = [
        _T("attn_proj", "wq_a", a.q_lora_rank, a.dim, w),
        _T("attn_proj", "q_norm", a.q_lora_rank, 1, "fp32", False),
        _T("attn_proj", "wq_b", a.n_heads * hd, a.q_lora_rank, w),
        _T("attn_proj", "wkv", hd, a.dim, w),
        _T("attn_proj", "kv_norm", hd, 1, "fp32", False),
        _T("attn_proj", "wo_a", a.o_groups * a.o_lora_rank, a.n_heads * hd // a.o_groups, w),
        _T("attn_proj", "wo_b", a.dim, a.o_groups * a.o_lora_rank, w),
        _T("attn_proj", "attn_sink", a.n_heads, 1, "fp32", False),
    ]
    if kind != SLIDING:  # compressor: c = 2 (overlapping A|B halves) for CSA, 1 for HCA; bf16
        c, m = (2, a.csa_ratio) if kind == CSA else (1, a.hca_ratio)
        t += [
            _T("compressor", "compressor.wkv", c * hd, a.dim, "bf16"),
            _T("compressor", "compressor.wgate", c * hd, a.dim, "bf16"),
            _T("compressor", "compressor.ape", m, c * hd, "fp32", False),
            _T("compressor", "compressor.norm", hd, 1, "fp32", False),
        ]
    if kind == CSA:  # lightning indexer projections and its own ratio-m, c = 2 compressor
        ihd = a.index_head_dim
        t += [
            _T("compressor", "indexer.wq_b", a.index_n_heads * ihd, a.q_lora_rank, w),
            _T("compressor", "indexer.weights_proj", a.index_n_heads, a.dim, "bf16"),
            _T("compressor", "indexer.compressor.wkv", 2 * ihd, a.dim, "bf16"),
            _T("compressor", "indexer.compressor.wgate", 2 * ihd, a.dim, "bf16"),
            _T("compressor", "indexer.compressor.ape", a.csa_ratio, 2 * ihd, "fp32", False),
            _T("compressor", "indexer.compressor.norm", ihd, 1, "fp32", False),
        ]
    for site in ("attn", "ffn"):  # fn: [(2+n)*n, n*dim] fp32 mixes
        t += [
            _T("mhc", f"hc_{site}_fn", (2 + n) * n, n * a.dim, "fp32"),
            _T("mhc", f"hc_{site}_base", (2 + n) * n, 1, "fp32", False),
            _T("mhc", f"hc_{site}_scale", 3, 1, "fp32", False),
            _T("mhc", f"{site}_norm", a.dim, 1, "fp32", False),
        ]
    t.append(_T("router", "gate", a.n_routed_experts, a.dim, "bf16"))  # also scores hash layers
    if not hashed:
        t.append(_T("router", "gate.bias", a.n_routed_experts, 1, "fp32", False))
    inter = a.moe_inter_dim  # SwiGLU: w1, w3 [inter, dim], w2 [dim, inter]
    for name, r, c in (("w1", inter, a.dim), ("w3", inter, a.dim), ("w2", a.dim, inter)):
        t += [
            _T("experts", name, r, c, a.expert_dtype, True, a.n_routed_experts),
            _T("shared_expert", name, r, c, w, True, a.n_shared_experts),
        ]
    return t


def _head_tensors(a: ModelArgs) -> list[_T]:
    n = a.hc_mult
    return [
        _T("head", "head", a.vocab_size, a.dim, "bf16"),
        _T("mhc", "hc_head_fn", n, n * a.dim, "fp32"),
        _T("mhc", "hc_head_base", n, 1, "fp32", False),
        _T("mhc", "hc_head_scale", 1, 1, "fp32", False),
        _T("mhc", "norm", a.dim, 1, "fp32", False),
    ]


def _model_tensors(a: ModelArgs) -> list[_T]:
    t = [_T("embed", "embed", a.vocab_size, a.dim, "bf16", False)] + _head_tensors(a)
    return t + [x for i in range(a.n_layers) for x in _layer_tensors(a, i)]


def param_counts(args: ModelArgs) -> dict[str, int]:
    """Parameters per component (main model), plus total, active per token (spec 11.1) and mtp."""
    out: dict[str, int] = {}
    for x in _model_tensors(args):
        out[x.comp] = out.get(x.comp, 0) + x.rows * x.cols * x.count
    out["total"] = sum(out.values())
    per_expert = 3 * args.moe_inter_dim * args.dim
    out["active"] = (
        out["total"]
        - out["embed"]
        - out["experts"]
        + args.n_layers * args.n_activated_experts * per_expert
    )
    mtp = (
        _layer_tensors(args, args.n_layers)
        + [
            _T("mtp", "e_proj", args.dim, args.dim, args.weight_dtype),
            _T("mtp", "h_proj", args.dim, args.dim, args.weight_dtype),
            _T("mtp", "enorm", args.dim, 1, "fp32", False),
            _T("mtp", "hnorm", args.dim, 1, "fp32", False),
        ]
        + _head_tensors(args)[1:]
    )
    out["mtp"] = args.n_mtp_layers * sum(x.rows * x.cols * x.count for x in mtp)
    return out


# ---- decode state (spec 9.6) -----------------------------------------------------------------


def _kv_format(state_dtype: str) -> str:
    # the roofline's state names as the state's kv_format ("bf16" is the value form)
    if state_dtype not in ("bf16", "fp8"):
        raise ValueError(f"state_dtype must be 'bf16' or 'fp8', got {state_dtype!r}")
    return "fp8" if state_dtype == "fp8" else "auto"


def entry_bytes(args: ModelArgs, state_dtype: str) -> tuple[int, int]:
    """Bytes of one (main KV, indexer key) state entry: bf16 values, or FlashMLA MODEL1 entries
    and FP8 indexer keys (`dsv4.state.entry_bytes`)."""
    return state.entry_bytes(args, torch.bfloat16, _kv_format(state_dtype))


def state_bytes_per_token(args: ModelArgs, state_dtype: str = "bf16") -> float:
    """Growth of one sequence's state per token (compressed entries; window rings are fixed)."""
    return state.bytes_per_token(args, torch.bfloat16, _kv_format(state_dtype))


def _query_reads(a: ModelArgs, ctx: int) -> tuple[int, int]:
    """One query seeing `ctx` tokens (itself included), summed over layers: (keys attended =
    window + CSA top-k + all HCA entries, CSA entries scored by the indexer)."""
    keys = scored = 0
    for t in a.layer_types:
        keys += min(a.window_size, ctx)
        if t == CSA:
            keys += min(a.index_topk, ctx // a.csa_ratio)
            scored += ctx // a.csa_ratio
        elif t == HCA:
            keys += ctx // a.hca_ratio
    return keys, scored


def _held(a: ModelArgs, ctx: int) -> tuple[int, int]:
    """State entries of one sequence at `ctx` tokens: (window + compressed main, indexer keys)."""
    main = sum(
        min(a.window_size, ctx)
        + (ctx // a.csa_ratio if t == CSA else ctx // a.hca_ratio if t == HCA else 0)
        for t in a.layer_types
    )
    return main, sum(ctx // a.csa_ratio for t in a.layer_types if t == CSA)


def distinct_experts(n_experts: int, k: int, tokens: float) -> float:
    """Expected distinct experts per layer when `tokens` pick k of n uniformly: n(1 - (1-k/n)^t)."""
    return n_experts * (1 - (1 - k / n_experts) ** tokens)


# ---- roofline -------------------------------------------------------------------------------


@dataclass
class Component:
    """One row of the roofline: bytes moved, FLOPs and the floor time of one step."""

    name: str
    weight_bytes: float = 0.0
    state_bytes: float = 0.0
    flops: float = 0.0
    compute_s: float = 0.0  # sum over parts of flops / peak(dtype of the part)
    floor_s: float = 0.0  # max(bytes / bandwidth, compute_s)
    bound: str = "memory"

    def add(
        self,
        gpu: GpuSpec,
        flops: float,
        dtype: str,
        weight_bytes: float = 0.0,
        state_bytes: float = 0.0,
    ) -> None:
        self.weight_bytes += weight_bytes
        self.state_bytes += state_bytes
        self.flops += flops
        self.compute_s += flops / gpu.peak(dtype)


@dataclass
class Roofline:
    """Per-component floor of one step; components run one after another, so times add."""

    components: list[Component]
    gpu: GpuSpec
    config: dict[str, Any]
    tokens: int  # tokens processed by the step: batch (decode) or batch * prompt_len (prefill)
    weight_bytes: float = 0.0  # totals, filled in __post_init__
    state_bytes: float = 0.0
    total_bytes: float = 0.0
    flops: float = 0.0
    floor_s: float = 0.0
    tok_per_s: float = 0.0

    def __post_init__(self) -> None:
        self.weight_bytes = sum(c.weight_bytes for c in self.components)
        self.state_bytes = sum(c.state_bytes for c in self.components)
        self.total_bytes = self.weight_bytes + self.state_bytes
        self.flops = sum(c.flops for c in self.components)
        self.floor_s = sum(c.floor_s for c in self.components)
        self.tok_per_s = self.tokens / self.floor_s

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"]["gpu"] = d.pop("gpu")
        return d


def roofline(
    args: ModelArgs,
    batch: int,
    context: int,
    gpu: GpuSpec,
    *,
    state_dtype: str = "bf16",
    mode: str = "decode",
    prompt_len: int | None = None,
    tp: int = 1,
) -> Roofline:
    """Floor of one decode step (`batch` sequences at `context` tokens, the new one included) or
    of a prefill of `prompt_len` (default: `context`) tokens per sequence ending at `context`.
    With `tp` ranks: the floor of one rank (each reads its part of the split tensors and all of
    the replicated ones), plus its all-reduces over the GPU link ("comm")."""
    if batch < 1 or context < 1:
        raise ValueError(f"batch={batch} and context={context} must be >= 1")
    inner = args.moe_inter_dim * args.n_shared_experts
    sizes = (args.n_heads, args.o_groups, args.n_routed_experts, inner or tp)
    if tp < 1 or any(n % tp for n in sizes):
        raise ValueError(
            f"tp={tp} must divide n_heads, o_groups, n_routed_experts and the shared expert's "
            f"inner dim {sizes}"
        )
    if mode not in ("decode", "prefill"):
        raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
    main_b, idx_b = entry_bytes(args, state_dtype)
    s = context if prompt_len is None else prompt_len
    if (mode == "decode" and prompt_len is not None) or not 1 <= s <= context:
        raise ValueError(f"prompt_len={prompt_len} needs mode='prefill' and 1 <= it <= {context}")
    tokens = batch if mode == "decode" else batch * s
    rows = {
        name: Component(name)
        for name in (
            "attn_proj",
            "compressor",
            "indexer",
            "attention",
            "mhc",
            "router",
            "experts",
            "shared_expert",
            "head",
            "comm",
        )
    }

    # weights: read once per step; routed experts scaled by the expected distinct ones
    # (with tp ranks: a rank holds E / tp experts, so it meets 1/tp of the distinct ones)
    n_distinct = distinct_experts(args.n_routed_experts, args.n_activated_experts, tokens)
    for x in _model_tensors(args):
        part = 1 / tp if x.comp in ("experts", "shared_expert") or x.name in SPLIT else 1.0
        wb = x.count * tensor_bytes(x.rows, x.cols, x.fmt) * part
        fl = (2.0 * tokens * x.rows * x.cols if x.matmul else 0.0) * part  # 2 FLOPs per MAC
        if x.comp == "embed":  # gather: one bf16 row per token
            rows["head"].add(gpu, 0.0, "bf16", weight_bytes=tokens * x.cols * 2)
        elif x.comp == "experts":  # per token k of the E experts run
            rows["experts"].add(
                gpu, fl * args.n_activated_experts, x.fmt, weight_bytes=wb * n_distinct / x.count
            )
        elif x.name == "head":  # logits for the last position of each sequence only
            rows["head"].add(gpu, 2.0 * batch * x.rows * x.cols, x.fmt, weight_bytes=wb)
        else:
            rows[x.comp].add(gpu, fl, x.fmt, weight_bytes=wb)
    tid2eid = args.n_hash_layers * tokens * args.n_activated_experts * 8  # bytes: k int64 per token
    rows["router"].add(gpu, 0.0, "bf16", weight_bytes=tid2eid)

    # attention and indexer: FLOPs per query averaged over its positions (causal halving in
    # prefill); decode reads each query's keys, prefill touches each state entry once
    if mode == "decode":
        ctxs = [context]
    else:  # midpoint samples of the query contexts context-s+1 .. context
        n = min(s, 1024)
        ctxs = [context - s + 1 + int((i + 0.5) * s / n) for i in range(n)]
    reads = [_query_reads(args, c) for c in ctxs]
    keys, scored = (sum(r[j] for r in reads) / len(reads) for j in range(2))
    attn_flops = tokens * 4.0 * args.n_heads * args.head_dim * keys / tp  # QK^T, PV; K = V
    idx_flops = tokens * 2.0 * args.index_n_heads * args.index_head_dim * scored
    if mode == "decode":  # each query reads its keys and scans all visible indexer keys
        attn_state, idx_state = batch * keys * main_b, batch * scored * idx_b
    else:  # each entry of the sequence's state at `context` is written or read once
        held, idx_held = _held(args, context)
        attn_state, idx_state = batch * held * main_b, batch * idx_held * idx_b
    rows["attention"].add(gpu, attn_flops, "bf16", state_bytes=attn_state)  # fp8 KV: bf16 MMA
    rows["indexer"].add(gpu, idx_flops, state_dtype, state_bytes=idx_state)  # + top-k: no FLOPs

    # all-reduces: after wo_b and after the MoE, [tokens, dim] in fp32; a ring sends (and
    # receives) 2 (tp - 1) / tp of it per rank
    comm = 2 * args.n_layers * tokens * args.dim * 4 * 2 * (tp - 1) / tp
    for c in rows.values():
        mem_s = (c.weight_bytes + c.state_bytes) / gpu.hbm_bytes_per_s
        c.floor_s, c.bound = max(mem_s, c.compute_s), "compute" if c.compute_s > mem_s else "memory"
    if comm:
        if not gpu.link_bytes_per_s:
            raise ValueError(f"tp={tp}: no GPU-to-GPU link bandwidth for {gpu.name}")
        c = rows["comm"]
        c.floor_s, c.bound = comm / gpu.link_bytes_per_s, "link"
    config = {
        "batch": batch,
        "context": context,
        "mode": mode,
        "state_dtype": state_dtype,
        "prompt_len": s if mode == "prefill" else None,
        "tokens": tokens,
        "distinct_experts": n_distinct,
        "weight_dtype": args.weight_dtype,
        "expert_dtype": args.expert_dtype,
        "n_layers": args.n_layers,
        "layer_types": {t: args.layer_types.count(t) for t in (SLIDING, CSA, HCA)},
        "tp": tp,
        "comm_bytes": comm,
    }
    return Roofline(list(rows.values()), gpu, config, tokens)


# ---- CLI ------------------------------------------------------------------------------------


def _table(r: Roofline) -> str:
    lines = [
        f"{'component':<14}{'weight MB':>11}{'state MB':>10}{'GFLOP':>10}{'floor us':>10}"
        f"{'% step':>8}  bound"
    ]
    for c in r.components:
        lines.append(
            f"{c.name:<14}{c.weight_bytes / 1e6:>11.1f}{c.state_bytes / 1e6:>10.1f}"
            f"{c.flops / 1e9:>10.1f}{c.floor_s * 1e6:>10.1f}"
            f"{100 * c.floor_s / r.floor_s:>8.1f}  {c.bound}"
        )
    lines.append(
        f"{'total':<14}{r.weight_bytes / 1e6:>11.1f}{r.state_bytes / 1e6:>10.1f}"
        f"{r.flops / 1e9:>10.1f}{r.floor_s * 1e6:>10.1f}{100.0:>8.1f}"
    )
    g, cfg = r.gpu, r.config
    return "\n".join(lines) + (
        f"\nfloor {r.floor_s * 1e3:.3f} ms/step -> {r.tok_per_s:.1f} tok/s  ({cfg['mode']}, "
        f"batch {cfg['batch']}, context {cfg['context']}, {cfg['state_dtype']} state, "
        f"{cfg['distinct_experts']:.1f} experts/layer"
        + (f", one of {cfg['tp']} ranks" if cfg["tp"] > 1 else "")
        + f"; {g.name}: "
        f"{g.hbm_bytes_per_s / 1e9:.0f} GB/s, {g.bf16_flops / 1e12:.0f} TFLOP/s bf16)"
    )


def _bench(r: Roofline, bench: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """measured / floor per component (and `step`) from {components: {name: s}, step_s: s}, or
    from the run at this batch and context of a `dsv4 bench step` JSON ({runs: [{batch, context,
    roofline: {...}}]}). A name "a+b" is compared with the sum of the floors of a and b."""
    if "runs" in bench:
        b, ctx = r.config["batch"], r.config["context"]
        runs = [x for x in bench["runs"] if (x.get("batch"), x.get("context")) == (b, ctx)]
        if not runs or "roofline" not in runs[0]:
            have = sorted((x.get("batch"), x.get("context")) for x in bench["runs"])
            raise ValueError(f"bench file has no run at batch={b}, context={ctx} (has {have})")
        bench = runs[0]["roofline"]
    floors = {c.name: c.floor_s for c in r.components} | {"step": r.floor_s}
    for name in bench.get("components", {}):
        if "+" in name and all(p in floors for p in name.split("+")):
            floors[name] = sum(floors[p] for p in name.split("+"))
    measured = dict(bench.get("components", {}))
    if bench.get("step_s") is not None:
        measured["step"] = bench["step_s"]
    return {
        name: {
            "measured_s": float(m),
            "floor_s": floors.get(name),
            "ratio": float(m) / floors[name] if name in floors else None,
        }
        for name, m in measured.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsv4 roofline", description=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint dir (or config.json)")
    src.add_argument("--preset", choices=["flash"], default="flash")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096, help="tokens seen, the new one included")
    p.add_argument("--prompt-len", type=int, default=None, help="prefill tokens (default context)")
    p.add_argument("--gpu", default="H200", help=f"one of {', '.join(GPUS)}")
    p.add_argument("--bandwidth", type=float, help="GB/s, overrides the GPU's HBM bandwidth")
    p.add_argument("--flops", type=float, help="TFLOP/s, overrides every dtype's peak")
    p.add_argument("--state-dtype", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--mode", choices=["decode", "prefill"], default="decode")
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        dest="tp",
        type=int,
        default=1,
        help="ranks: the floor of one rank (its part of the split weights, all the replicated "
        "ones, its all-reduces over the GPU link)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--bench", help="JSON {components: {name: seconds}, step_s: seconds}")
    a = p.parse_args(argv)
    try:
        gpu = get_gpu(a.gpu)
        if a.bandwidth is not None:
            gpu = dataclasses.replace(gpu, hbm_bytes_per_s=a.bandwidth * 1e9)
        if a.flops is not None:
            gpu = dataclasses.replace(
                gpu, bf16_flops=a.flops * 1e12, fp8_flops=a.flops * 1e12, fp4_flops=a.flops * 1e12
            )
        if a.bandwidth is not None or a.flops is not None:
            gpu = dataclasses.replace(gpu, name=f"{gpu.name} (custom)")
        args = ModelArgs.from_json(a.model) if a.model else flash_args()
        r = roofline(
            args,
            a.batch,
            a.context,
            gpu,
            state_dtype=a.state_dtype,
            mode=a.mode,
            prompt_len=a.prompt_len,
            tp=a.tp,
        )
        bench = None
        if a.bench:
            with open(a.bench) as fh:
                bench = _bench(r, json.load(fh))
    except (ValueError, TypeError, ConfigError, OSError) as e:  # JSONDecodeError: ValueError
        print(f"dsv4 roofline: error: {e}", file=sys.stderr)
        return 2
    r.config["model"] = a.model or a.preset
    if a.json:
        print(json.dumps(r.to_dict() | ({"bench": bench} if bench is not None else {})))
        return 0
    print(_table(r))
    if bench is not None:
        print(f"\n{'component':<30}{'measured us':>12}{'floor us':>10}{'meas/floor':>11}")
        for name, b in bench.items():
            fl, ratio = b["floor_s"] or math.nan, b["ratio"] or math.nan
            print(f"{name:<30}{b['measured_s'] * 1e6:>12.1f}{fl * 1e6:>10.1f}{ratio:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
