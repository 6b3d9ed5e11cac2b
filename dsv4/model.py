"""DeepSeek-V4 forward pass, top to bottom in paper order. Module paths equal checkpoint keys.

Shapes: T = new tokens of the step (all sequences flattened), D = dim, n = hc_mult streams,
H = heads, hd = head_dim. Per-sequence bookkeeping lives in `Batch` and `DecodeState` (state.py).
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace as Ops
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dsv4.config import CSA, HASH_MOE, SLIDING, ModelArgs, yarn_inv_freq
from dsv4.parallel import Parallel, ParallelError
from dsv4.state import Batch, CompressorState, DecodeState, LayerState

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, rd/2] fp32


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _hc_params(module: nn.Module, prefix: str, rows: int, n_scales: int, hc_dim: int) -> None:
    """Register `{prefix}_fn [rows, hc_dim]`, `{prefix}_base [rows]`, `{prefix}_scale` (fp32)."""
    module.register_parameter(f"{prefix}_fn", _param(rows, hc_dim, dtype=torch.float32))
    module.register_parameter(f"{prefix}_base", _param(rows, dtype=torch.float32))
    module.register_parameter(f"{prefix}_scale", _param(n_scales, dtype=torch.float32))


class Linear(nn.Module):
    """y = x Wᵀ with W as stored in the checkpoint: dense, FP8 (128x128 UE8M0), MXFP4 or NVFP4."""

    def __init__(
        self, in_features: int, out_features: int, fmt: str, dtype: torch.dtype, ops: Ops
    ) -> None:
        super().__init__()
        self.fmt, self.ops = fmt, ops
        if fmt == "dense":
            self.weight = _param(out_features, in_features, dtype=dtype)
        elif fmt == "fp8":
            self.weight = _param(out_features, in_features, dtype=torch.float8_e4m3fn)
            self.scale = _param(
                -(-out_features // 128), -(-in_features // 128), dtype=torch.float8_e8m0fnu
            )
        elif fmt == "fp4":
            self.weight = _param(out_features, in_features // 2, dtype=torch.int8)
            self.scale = _param(out_features, in_features // 32, dtype=torch.float8_e8m0fnu)
        elif fmt == "nvfp4":
            self.weight = _param(out_features, in_features // 2, dtype=torch.uint8)
            self.weight_scale = _param(out_features, in_features // 16, dtype=torch.float8_e4m3fn)
            self.weight_scale_2 = _param(dtype=torch.float32)
            self.input_scale = _param(dtype=torch.float32)
        else:
            raise ValueError(f"unknown weight format {fmt!r}")

    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(block scale, global scale) of the stored format; no aliases, so state_dict keys stay
        exactly the checkpoint's."""
        if self.fmt == "nvfp4":
            return self.weight_scale, self.weight_scale_2
        return getattr(self, "scale", None), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.fmt, *self.scales())


JOINABLE = ("dense", "fp8")  # formats whose pairs can run as one GEMM (no per-tensor scales)


def _stored(lin: Linear) -> tuple[torch.Tensor, ...]:
    return (lin.weight, lin.scale) if lin.fmt == "fp8" else (lin.weight,)


def split(p: nn.Parameter, dim: int, par: Parallel) -> None:
    """Let `p` (built at this rank's size) take its part of the checkpoint's full tensor along
    `dim` when loaded (`load_checkpoint` calls `weight_loader`): rank r's r-th of world slices."""
    if par.world_size == 1:
        return

    def load(param: torch.Tensor, full: torch.Tensor) -> None:
        n = param.shape[dim]
        want = [*param.shape[:dim], n * par.world_size, *param.shape[dim + 1 :]]
        if list(full.shape) != want:
            raise ValueError(
                f"rank {par.rank} of {par.world_size} holds {list(param.shape)} (dim {dim}); "
                f"the full tensor should be {want}, checkpoint has {list(full.shape)}"
            )
        with torch.no_grad():
            param.copy_(full.narrow(dim, par.rank * n, n).to(param.dtype))

    p.weight_loader = load


def split_linear(lin: Linear, dim: int, par: Parallel) -> Linear:
    """Shard a projection over the ranks: dim 0 its output rows, dim 1 its input columns. FP8
    block scales go with their 128 x 128 blocks, so this rank's part must be whole blocks."""
    if par.world_size == 1:
        return lin
    if lin.fmt not in ("dense", "fp8"):
        raise ParallelError(f"a {lin.fmt!r} projection cannot be split over ranks")
    if lin.fmt == "fp8" and lin.weight.shape[dim] % 128:
        raise ParallelError(
            f"an FP8 projection's part {list(lin.weight.shape)} is not whole 128-blocks along "
            f"dim {dim} at {par.world_size} ranks"
        )
    for p in _stored(lin):
        split(p, dim, par)
    return lin


def join_linears(a: Linear, b: Linear) -> None:
    """Put b's stored tensors right after a's in one allocation, so `pair(x, a, b)` runs both
    as one GEMM; values and state_dict keys are unchanged. Call once the weights are final and
    on their device: moving the module later splits them again (then `pair` makes two calls)."""
    if a.fmt != b.fmt or a.fmt not in JOINABLE or a.weight.shape[1:] != b.weight.shape[1:]:
        return
    if a.fmt == "fp8" and a.weight.shape[0] % 128:  # a's last block-scale row would be shared
        return
    if all(map(_follows, _stored(a), _stored(b))):  # joined already (weights reloaded in place:
        return  # a new allocation would leave captured CUDA graphs reading the old one)
    with torch.no_grad():
        for ta, tb in zip(_stored(a), _stored(b)):
            j = torch.cat([ta.data, tb.data])
            ta.data, tb.data = j[: ta.shape[0]], j[ta.shape[0] :]


def _follows(ta: torch.Tensor, tb: torch.Tensor) -> bool:
    return (
        ta.is_contiguous()
        and tb.is_contiguous()
        and ta.untyped_storage().data_ptr() == tb.untyped_storage().data_ptr()
        and ta.data_ptr() + ta.numel() * ta.element_size() == tb.data_ptr()
    )


def pair(x: torch.Tensor, a: Linear, b: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(a(x), b(x)) for two projections of one input: one GEMM over the joined weights when
    `join_linears(a, b)` holds (the outputs are then column slices of one [.., na + nb])."""
    if a.fmt != b.fmt or a.fmt not in JOINABLE or not all(map(_follows, _stored(a), _stored(b))):
        return a(x), b(x)
    joined = [
        ta.detach().as_strided((ta.shape[0] + tb.shape[0], *ta.shape[1:]), ta.stride())
        for ta, tb in zip(_stored(a), _stored(b))
    ]
    w, scale = joined[0], joined[1] if a.fmt == "fp8" else None
    y = a.ops.linear(x, w, a.fmt, scale, None)
    na = a.weight.shape[0]
    return y[..., :na], y[..., na:]


@dataclass(frozen=True)
class Build:
    """How modules are built: config, compute dtype, weight formats kept in memory, op backend."""

    args: ModelArgs
    dtype: torch.dtype
    quant: str  # dense projections: "dense" (dequantized) | "fp8"
    expert_quant: str  # routed experts: "dense" | "fp8" | "fp4" | "nvfp4"
    ops: Ops
    par: Parallel = field(default_factory=Parallel)  # this rank's part (dsv4.parallel)

    def linear(self, n_in: int, n_out: int, fmt: str | None = None) -> Linear:
        return Linear(n_in, n_out, self.quant if fmt is None else fmt, self.dtype, self.ops)

    def norm(self, dim: int) -> RMSNorm:
        return RMSNorm(dim, self.args.norm_eps, self.ops)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight."""

    def __init__(self, dim: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = _param(dim, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


@functools.cache
def _mm_fp32_out(device: torch.device) -> bool:
    """Does torch.mm take out_dtype=float32 for bf16 inputs here (CUDA builds of recent torch)?"""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(2, 16, dtype=torch.bfloat16, device=device)
        out = torch.mm(a, a.t(), out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return out.dtype == torch.float32 and bool((out == 16).all())


def rope_at(inv_freq: torch.Tensor, positions: torch.Tensor) -> Rope:
    """cos/sin of angle p * f_i (fp32), one entry per rotated pair."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


class Compressor(nn.Module):
    """Softmax-gated pooling of m tokens into one KV entry (CSA: overlapping 2m slots; HCA: m)."""

    def __init__(self, b: Build, ratio: int, head_dim: int, overlap: bool) -> None:
        super().__init__()
        self.ratio, self.head_dim, self.overlap, self.ops = ratio, head_dim, overlap, b.ops
        c = 2 if overlap else 1
        self.wkv = b.linear(b.args.dim, c * head_dim, "dense")
        self.wgate = b.linear(b.args.dim, c * head_dim, "dense")
        self.ape = _param(ratio, c * head_dim, dtype=torch.float32)
        self.norm = b.norm(head_dim)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_kv x, W_gate x): one GEMM once joined; no index list is read."""
        return pair(x, self.wkv, self.wgate)

    def forward(
        self,
        x: torch.Tensor,
        batch: Batch,
        st: CompressorState,
        inv_freq: torch.Tensor,
        proj: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        # proj: `project(x)`, when computed already (dsv4.piecewise)
        m, d = self.ratio, self.head_dim
        kv, gate = self.project(x) if proj is None else proj
        if batch.decode:  # store first: a closing window's slots are then all in the ring
            # (one launch: a = W_kv x and z = W_gate x + ape[slot] into every token's ring row)
            keep_rows = batch.ring_writes(st.ring)[1]
            self.ops.compress_keep(
                kv, gate, self.ape, batch.positions, m, st.kv_state, st.score_state, keep_rows
            )
            self._close(batch, st, inv_freq, None)
            return
        # a prefill chunk or a verify step: a = W_kv x, z = W_gate x + ape[slot] of every token
        # into rows of their own first (a later token of the step would overwrite ring slots of a
        # window that closes earlier in it), the closing windows pooled from ring | those rows,
        # then each sequence's last R tokens into the ring: three launches
        if batch.short_step(st.ring, st.step_rows):
            a, z = self.short_step(st, len(kv))
        else:
            a = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)  # [T, c*d]
            z = torch.empty_like(a)
        self.ops.compress_keep(kv, gate, self.ape, batch.positions, m, a, z, batch.token_rows())
        self._close(batch, st, inv_freq, (a.view(-1, d), z.view(-1, d)))
        keep_rows = batch.keep_rows(st.ring)
        self.ops.compress_keep(
            kv, gate, self.ape, batch.positions, m, st.kv_state, st.score_state, keep_rows
        )
        if batch.snapshots:  # prefix caching: the ring at a block boundary inside the chunk
            keep_rows = batch.snapshot_keep_rows(st.ring)
            self.ops.compress_keep(
                kv, gate, self.ape, batch.positions, m, st.kv_snap, st.score_snap, keep_rows
            )

    def short_step(self, st: CompressorState, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify step's own rows: the state's step rows after the ring (fixed addresses, which
        CUDA graphs of verify steps need)."""
        n = len(st.kv_state)
        return st.kv_all[n : n + T], st.score_all[n : n + T]

    def _close(
        self, batch: Batch, st: CompressorState, inv_freq: torch.Tensor,
        chunk: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:  # fmt: skip
        # ---- pool every window closed by a token of this step (spec 5.3.1); with overlap
        # window w-1 gives its A-half (slots 0..m-1), window w its B-half (slots m..2m-1).
        # pool -> RMSNorm -> RoPE at the window's first token -> store, one op. The slots are
        # rows of the ring (decode) or of ring | the step's own rows (`chunk`), read as
        # [rows * c, d]
        m, d, n = self.ratio, self.head_dim, self.norm
        tok, w, dest, _ = batch.closing_windows(m, self.overlap)
        if not tok.numel():
            return
        key = ("close_rope", m, self.overlap, inv_freq.data_ptr())
        cos, sin = batch.memo(key, lambda: rope_at(inv_freq, w * m))
        if chunk is None:
            rows = batch.closing_ring_rows(m, self.overlap)
        else:
            rows = batch.close_rows(m, self.overlap)
        ring_kv, ring_score = st.kv_state.view(-1, d), st.score_state.view(-1, d)
        self.ops.compress_store(
            ring_kv, ring_score, n.weight, n.eps, cos, sin, st.kv_cache, dest, rows, st.kv_scale,
            chunk=chunk,
        )  # fmt: skip


class Indexer(nn.Module):
    """Lightning indexer: I(p, w) = sum_h w_h ReLU(q_h . k_w); keeps the top-k compressed entries."""

    def __init__(self, b: Build) -> None:
        super().__init__()
        a, self.ops = b.args, b.ops
        self.n_heads, self.head_dim, self.topk = a.index_n_heads, a.index_head_dim, a.index_topk
        self.wq_b = b.linear(a.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = b.linear(a.dim, self.n_heads, "dense")
        self.compressor = Compressor(b, a.csa_ratio, self.head_dim, True)
        self.softmax_scale = self.head_dim**-0.5

    def project(self, x: torch.Tensor, qr: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, ...]:
        """What reads no index list: (its compressor's W_kv x, W_gate x, the rotated index
        queries [T, heads, d], the head weights [T, heads])."""
        kv, gate = self.compressor.project(x)
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)
        q = self.ops.rotary(q, *rope)
        # head weights: weights_proj(x).float() * softmax_scale / sqrt(heads), the scaling inside
        # the op (no launch of its own)
        return kv, gate, q, self.weights_proj(x)

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        batch: Batch,
        ls: LayerState,
        rope: Rope,
        inv_freq: torch.Tensor,
        proj: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        # returns [T, k] compressed entry ids (0..), -1 = none ; proj: `project`'s, if computed
        kv, gate, q, weights = self.project(x, qr, rope) if proj is None else proj
        self.compressor(x, batch, ls.indexer, inv_freq, (kv, gate))
        keys, key_scale = ls.indexer.kv_cache, ls.indexer.kv_scale
        scale = self.softmax_scale * self.n_heads**-0.5
        ratio = self.compressor.ratio
        # a long chunk at long context takes its tokens in slices (the [tokens x entries]
        # candidates and scores of the whole chunk would not fit beside the state); one
        # sequence's tokens share the score kernel's key tiles
        picks = []
        for t0, t1 in batch.index_slices(ratio):
            cand, counts = batch.index_rows(ratio, t0, t1)
            # attention takes the entries as a set: no sort by score
            picks.append(self.ops.index_topk(
                q[t0:t1], weights[t0:t1], keys, cand, self.topk, key_scale, scale, sort=False,
                one_sequence=batch.one_sequence(t0, t1), counts=counts,
            ))  # fmt: skip
        return picks[0] if len(picks) == 1 else torch.cat(picks)


class Attention(nn.Module):
    """Shared K=V MQA over window ∪ compressed entries ∪ sink, with grouped low-rank output."""

    def __init__(self, layer_id: int, b: Build) -> None:
        super().__init__()
        a, self.ops, par = b.args, b.ops, b.par
        self.kind = a.layer_types[layer_id] if layer_id < a.n_layers else SLIDING
        self.head_dim, self.window, self.par = a.head_dim, a.window_size, par
        self.eps, self.rope_dim = a.norm_eps, a.rope_head_dim
        # this rank's query heads and the output groups that read them (all of them on one rank)
        self.n_heads, self.o_groups = (
            par.part(a.n_heads, "n_heads"),
            par.part(a.o_groups, "o_groups"),
        )
        self.wq_a = b.linear(a.dim, a.q_lora_rank)
        self.q_norm = b.norm(a.q_lora_rank)
        self.wq_b = split_linear(b.linear(a.q_lora_rank, self.n_heads * a.head_dim), 0, par)
        self.wkv = b.linear(a.dim, a.head_dim)
        self.kv_norm = b.norm(a.head_dim)
        group_in = a.n_heads * a.head_dim // a.o_groups
        self.wo_a = split_linear(b.linear(group_in, self.o_groups * a.o_lora_rank), 0, par)
        self.wo_b = split_linear(b.linear(self.o_groups * a.o_lora_rank, a.dim), 1, par)
        self.attn_sink = _param(self.n_heads, dtype=torch.float32)
        split(self.attn_sink, 0, par)
        if self.kind != SLIDING:
            ratio = a.csa_ratio if self.kind == CSA else a.hca_ratio
            self.compressor = Compressor(b, ratio, a.head_dim, self.kind == CSA)
        if self.kind == CSA:
            self.indexer = Indexer(b)

    def forward(
        self, x: torch.Tensor, batch: Batch, ls: LayerState, rope: Rope, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        # the new K=V rows: at decode stored into the ring (the slot it takes held position
        # p - window, outside every window of this step). With FP8 state (uint8 rows) a prefill
        # chunk is quantized the same way into rows of its own, which attention then reads like
        # the ring (the reference rounds them alike, spec 3.3)
        store = (ls.window, batch.ring_writes(self.window)[1]) if batch.decode else None
        fp8_rows = ls.window.shape[1] if not batch.decode and ls.window.dtype == torch.uint8 else 0
        T, arange = x.shape[0], None
        if fp8_rows:
            arange = batch.memo(("arange", T), lambda: torch.arange(T, device=x.device))
        qr, q, kv = self.qkv(x, rope, store, fp8_rows, arange)
        side = self.side_projections(x, qr, rope)
        return self.out(self.attend(x, qr, q, kv, batch, ls, rope, inv_freq, side))

    def side_projections(self, x: torch.Tensor, qr: torch.Tensor, rope: Rope) -> tuple:
        """The compressor's projections, and for CSA the indexer's (`Indexer.project`): they read
        no index list either. () for a sliding layer."""
        if self.kind == SLIDING:
            return ()
        comp = self.compressor.project(x)
        return (*comp, *self.indexer.project(x, qr, rope)) if self.kind == CSA else comp

    def qkv(
        self,
        x: torch.Tensor,
        rope: Rope,
        store: tuple | None = None,
        fp8_rows: int = 0,
        arange: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections of the attention input x [T, D]: (qr [T, q_lora_rank], q [T, H, hd],
        the new tokens' K=V [T, hd], or with fp8_rows their FP8 rows [T, fp8_rows] uint8).
        store: the decode ring's (rows, slots) the K=V goes to as well; arange: 0..T-1 (fp8_rows;
        made here when not given). No index list is read:
        a prefill chunk's part of a step can be a CUDA graph (`dsv4.piecewise`)."""
        T, H, hd = x.shape[0], self.n_heads, self.head_dim
        qa, kva = pair(x, self.wq_a, self.wkv)  # one GEMM once joined (both read x)
        # ---- queries: low-rank, then per-head unweighted RMS and RoPE on the trailing dims ; the
        # window K=V of the new tokens: RMS, RoPE (both in one op)
        qr = self.q_norm(qa)  # [T, q_lora_rank]
        chunk = None
        if fp8_rows:
            chunk = torch.empty((T, fp8_rows), dtype=torch.uint8, device=x.device)
            store = (chunk, torch.arange(T, device=x.device) if arange is None else arange)
        q, kv = self.ops.norm_rope_qkv(
            self.wq_b(qr).view(T, H, hd), kva, self.kv_norm.weight, self.eps, *rope, store=store
        )
        return qr, q, (kv if chunk is None else chunk)

    def attend(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        batch: Batch,
        ls: LayerState,
        rope: Rope,
        inv_freq: torch.Tensor,
        side: tuple | None = None,
    ) -> torch.Tensor:
        """Attention over the state and the new rows (`qkv`'s) -> [T, H, hd], RoPE undone: the
        compressor, the indexer and the kernels that read the step's index lists. side: the
        layer's `side_projections` (None: computed here)."""
        hd = self.head_dim
        if side is None:
            side = self.side_projections(x, qr, rope)
        # ---- key rows: ring | new tokens | compressed entries. At decode the new K=V is already
        # in the ring: ring | compressed entries (one allocation: one source for the kernel)
        idxs = batch.window_idxs(self.window, ring_only=batch.decode)  # [T, W]
        sources = [ls.window] if batch.decode else [ls.window, kv]
        if self.kind != SLIDING:
            st = ls.compressor
            # emits the entries closed by this step first
            self.compressor(x, batch, st, inv_freq, side[:2])
            base = sum(s.shape[0] for s in sources)
            if self.kind == CSA:  # the entries the indexer picked
                ent = self.indexer(x, qr, batch, ls, rope, inv_freq, side[2:])
                idxs = batch.selected_idxs(self.window, st.ratio, base, ent)
            else:  # all visible entries: one list for every HCA layer of the step
                idxs = batch.attention_idxs(self.window, st.ratio, base)
            sources.append(st.kv_cache)
        # ---- the output with RoPE undone (V = K carries it)
        o = self.ops.sparse_attn(
            q, tuple(sources), self.attn_sink, idxs, hd**-0.5, self.rope_dim, inv_rope=rope
        )
        if not batch.decode:  # a chunk's ring slots still hold its earlier tokens' windows
            tok, rows = batch.ring_writes(self.window)
            ls.window[rows] = kv[tok].to(ls.window.dtype)
            if batch.snapshots:  # prefix caching: the ring at a block boundary in the chunk
                tok, rows = batch.snapshot_writes(self.window)
                ls.window_snap[rows] = kv[tok].to(ls.window.dtype)
        return o

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """The grouped low-rank output projection of o [T, H, hd] -> [T, D] (ranks summed)."""
        T = o.shape[0]
        o = self.ops.grouped_linear(
            o.reshape(T, self.o_groups, -1), self.wo_a.weight, self.wo_a.fmt, *self.wo_a.scales()
        )
        return self.par.all_reduce(self.wo_b(o.flatten(1)))  # the ranks' heads summed


class Gate(nn.Module):
    """Router: sqrtsoftplus scores; top-k of score + bias, or a fixed token-id hash table."""

    def __init__(self, layer_id: int, b: Build) -> None:
        super().__init__()
        args, self.ops = b.args, b.ops
        self.topk, self.route_scale = args.n_activated_experts, args.route_scale
        self.hash = layer_id < args.n_layers and args.mlp_layer_types[layer_id] == HASH_MOE
        self.weight = _param(args.n_routed_experts, args.dim, dtype=b.dtype)
        if self.hash:
            self.tid2eid = nn.Parameter(
                torch.empty(args.vocab_size, self.topk, dtype=torch.int64), requires_grad=False
            )
        else:
            self.bias = _param(args.n_routed_experts, dtype=torch.float32)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # sqrt(softplus(x . W)) in fp32; top-k of score + bias (bias only for selection, ties ->
        # lower expert id) or the token's fixed experts; the chosen scores normalised, scaled
        if self.hash:
            idx, bias = self.tid2eid[input_ids], None
        else:
            idx, bias = None, self.bias
        return self.ops.moe_gate(x, self.weight, bias, self.topk, self.route_scale, idx)


class Expert(nn.Module):
    """SwiGLU expert with the asymmetric clamp (gate <= limit, |up| <= limit)."""

    def __init__(self, b: Build, inter_dim: int, fmt: str) -> None:
        super().__init__()
        dim, self.limit, self.ops = b.args.dim, b.args.swiglu_limit, b.ops
        self.w1 = b.linear(dim, inter_dim, fmt)
        self.w2 = b.linear(inter_dim, dim, fmt)
        self.w3 = b.linear(dim, inter_dim, fmt)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        # silu(min(w1 x, limit)) * clamp(w3 x, +-limit), the routing weight before w2 as the
        # reference does, in x.dtype
        g, u = pair(x, self.w1, self.w3)  # one GEMM once joined (the shared expert)
        return self.w2(self.ops.swiglu(g, u, self.limit, weights))


class Experts(nn.ModuleList):
    """This rank's routed experts: indexed 0.. locally, named by their global ids (checkpoint keys
    `experts.{id}.`). On one rank the ids are 0..n-1, as in a plain ModuleList."""

    def __init__(self, experts: Iterable[nn.Module], first: int) -> None:
        nn.Module.__init__(self)
        self.first = first
        for i, e in enumerate(experts):
            self.add_module(str(first + i), e)

    def __getitem__(self, i: int) -> nn.Module:  # type: ignore[override]
        n, i = len(self), operator.index(i)
        if not -n <= i < n:
            raise IndexError(f"expert {i} of {n} local experts")
        return self._modules[str(self.first + i % n)]


class MoE(nn.Module):
    """Routed experts (top-k of n_routed) plus one shared expert."""

    def __init__(self, layer_id: int, b: Build) -> None:
        super().__init__()
        a, self.ops, self.par = b.args, b.ops, b.par
        self.gate = Gate(layer_id, b)
        # expert parallel: this rank's consecutive routed experts; the shared expert's inner
        # dimension split (w1 / w3 rows, w2 columns)
        n = b.par.part(a.n_routed_experts, "n_routed_experts")
        self.first = b.par.start(a.n_routed_experts, "n_routed_experts")
        self.experts = Experts(
            (Expert(b, a.moe_inter_dim, b.expert_quant) for _ in range(n)), self.first
        )
        self.shared_experts = None
        if a.n_shared_experts:
            inter = b.par.part(a.moe_inter_dim * a.n_shared_experts, "shared expert inner dim")
            sh = self.shared_experts = Expert(b, inter, b.quant)
            for lin, dim in ((sh.w1, 0), (sh.w3, 0), (sh.w2, 1)):
                split_linear(lin, dim, b.par)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x, input_ids)  # [T, k] each, global expert ids
        if self.par.world_size > 1:  # local ids; -1 = held by another rank (contributes nothing)
            loc = idx - self.first
            idx = torch.where((loc >= 0) & (loc < len(self.experts)), loc, -1)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        # routed experts summed over the k slots, plus the shared expert's output, in fp32; then
        # cast to x.dtype in the same op (across ranks: the parts summed in fp32, then cast)
        out_dtype = torch.float32 if self.par.world_size > 1 else x.dtype
        y = self.ops.moe_experts(x, weights, idx, self.experts, shared=shared, out_dtype=out_dtype)
        return self.par.all_reduce(y).to(x.dtype)  # (one rank: y itself, no copy)


class Pending(NamedTuple):
    """A sublayer's output y [T, D] not yet mixed into the streams: hc_post(y, residual, post,
    comb) gives them. Blocks hand it on, so that the mix and the next hc_pre run as one op."""

    y: torch.Tensor
    residual: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


class Block(nn.Module):
    """One layer on n residual streams: [hc_post of the previous FFN +] hc_pre -> attention ->
    hc_post + hc_pre -> MoE, whose hc_post is left to the next block (`Pending`)."""

    def __init__(self, layer_id: int, b: Build) -> None:
        super().__init__()
        args = self.args = b.args
        self.ops = b.ops
        self.attn = Attention(layer_id, b)
        self.ffn = MoE(layer_id, b)
        self.attn_norm = b.norm(args.dim)
        self.ffn_norm = b.norm(args.dim)
        mix = (2 + args.hc_mult) * args.hc_mult  # pre (n) + post (n) + comb (n*n)
        _hc_params(self, "hc_attn", mix, 3, args.hc_dim)  # hc_attn_fn / _base / _scale
        _hc_params(self, "hc_ffn", mix, 3, args.hc_dim)

    def forward(
        self,
        h: torch.Tensor | Pending,
        input_ids: torch.Tensor,
        batch: Batch,
        ls: LayerState,
        rope: Rope,
        inv_freq: torch.Tensor,
    ) -> Pending:
        # h: the streams [T, n, D], or the previous block's FFN output with its hc_post still to
        # apply (that hc_post and this block's hc_pre are one op, which may share launches) ->
        # this block's FFN output, its hc_post left to the next block or the caller (`Pending`)
        x, y, post, comb = self.attn_in(h)
        y = self.attn(y, batch, ls, rope, inv_freq)
        return self.ffn_out(y, x, post, comb, input_ids)

    def attn_in(
        self, h: torch.Tensor | Pending
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x = hc_post(previous); y = attn_norm(collapse(x)) -> (x, y, post, comb)."""
        a = self.args
        attn_mix = (self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, a.norm_eps, a.hc_eps,
                    a.hc_sinkhorn_iters, self.attn_norm.weight)  # fmt: skip
        if isinstance(h, Pending):
            return self.ops.hc_post_pre(*h, *attn_mix)
        return (h, *self.ops.hc_pre(h, *attn_mix))

    def ffn_out(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        input_ids: torch.Tensor,
    ) -> Pending:
        """The attention output y into the streams x; the MoE of ffn_norm(collapse(x)), its
        hc_post left to the next block (`Pending`)."""
        a = self.args
        x, y, post, comb = self.ops.hc_post_pre(
            y, x, post, comb, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base,
            a.norm_eps, a.hc_eps, a.hc_sinkhorn_iters, self.ffn_norm.weight,
        )  # fmt: skip
        return Pending(self.ffn(y, input_ids), x, post, comb)


class MTPBlock(Block):
    """Next-n prediction layer: mixes the main streams with the next token's embedding."""

    def __init__(self, layer_id: int, b: Build) -> None:
        super().__init__(layer_id, b)
        D = b.args.dim
        self.e_proj = b.linear(D, D)
        self.h_proj = b.linear(D, D)
        self.enorm, self.hnorm, self.norm = b.norm(D), b.norm(D), b.norm(D)
        _hc_params(self, "hc_head", b.args.hc_mult, 1, b.args.hc_dim)

    def forward(
        self,
        h: torch.Tensor,
        e: torch.Tensor,
        input_ids: torch.Tensor,
        batch: Batch,
        ls: LayerState,
        rope: Rope,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        # h: [T, n, D] main streams before hc_head ; e: [T, D] embedding of the next token
        x = self.e_proj(self.enorm(e)).unsqueeze(1) + self.h_proj(self.hnorm(h))
        return self.ops.hc_post(*super().forward(x, input_ids, batch, ls, rope, inv_freq))


_EXPERT_KEY = re.compile(r"\.ffn\.experts\.(\d+)\.")


class Transformer(nn.Module):
    """DeepSeek-V4: embedding, n_layers Blocks on hc_mult streams, hc_head, norm, head (+ MTP)."""

    def __init__(
        self,
        args: ModelArgs,
        dtype: torch.dtype = torch.float32,
        quantized: bool = False,
        ops: Ops | None = None,
        par: Parallel | None = None,
    ) -> None:
        super().__init__()
        if ops is None:
            from dsv4.ops import select

            ops = select("ref")
        self.args, self.dtype, self.ops = args, dtype, ops
        self.par = par = par or Parallel()
        b = Build(
            args,
            dtype,
            quant=args.weight_dtype.replace("bf16", "dense") if quantized else "dense",
            expert_quant=args.expert_dtype.replace("bf16", "dense") if quantized else "dense",
            ops=ops,
            par=par,
        )
        self.embed = nn.Embedding(args.vocab_size, args.dim, dtype=dtype)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(i, b) for i in range(args.n_layers))
        self.norm = b.norm(args.dim)
        self.head = b.linear(args.dim, args.vocab_size, "dense")
        _hc_params(self, "hc_head", args.hc_mult, 1, args.hc_dim)
        self.mtp = nn.ModuleList(MTPBlock(args.n_layers + i, b) for i in range(args.n_mtp_layers))
        rd = args.rope_head_dim
        self.register_buffer(
            "freqs_main", yarn_inv_freq(rd, args.rope_theta, None), persistent=False
        )
        self.register_buffer(
            "freqs_compress",
            yarn_inv_freq(rd, args.compress_rope_theta, args.yarn),
            persistent=False,
        )

    def elsewhere(self, name: str) -> bool:
        """Is checkpoint tensor `name` held by another rank (a routed expert outside this rank's
        range)? `load_checkpoint` skips those without reading them."""
        m = _EXPERT_KEY.search(name)
        if m is None or self.par.world_size == 1:
            return False
        n = self.par.part(self.args.n_routed_experts, "n_routed_experts")
        first = self.par.start(self.args.n_routed_experts, "n_routed_experts")
        return not first <= int(m[1]) < first + n

    def join_projections(self) -> None:
        """One GEMM for each pair of projections that read the same input: attention's wq_a /
        wkv (FP8), a compressor's wkv / wgate (bf16), the shared expert's w1 / w3. Called once the
        weights are loaded, on their device (`load_checkpoint`, `init_random_`); the routed
        experts keep their own tensors (`ops.moe` addresses them by weight offsets)."""
        for m in self.modules():
            if isinstance(m, Attention):
                join_linears(m.wq_a, m.wkv)
            elif isinstance(m, Compressor):
                join_linears(m.wkv, m.wgate)
            elif isinstance(m, MoE) and m.shared_experts is not None:
                join_linears(m.shared_experts.w1, m.shared_experts.w3)

    def forward(self, input_ids: torch.Tensor, batch: Batch, state: DecodeState) -> torch.Tensor:
        """input_ids: [T] -> streams after the last layer, before hc_head: [T, n, D]."""
        batch.prepare(self.args)  # the index lists every layer shares (memoized: once per step)
        h = self.streams(input_ids)
        ropes = self.ropes(batch.positions)
        for i, layer in enumerate(self.layers):
            kind, inv = self.rope_kind(i)
            h = layer(h, input_ids, batch, state.layers[i], ropes[kind], inv)
        return self.ops.hc_post(*h)  # the last block's FFN into the streams

    def streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding on hc_mult streams: [T, n, D]."""
        return self.embed(input_ids).unsqueeze(1).repeat(1, self.args.hc_mult, 1)

    def ropes(self, positions: torch.Tensor) -> dict[str, Rope]:
        """RoPE tables at `positions`: "main" (sliding layers) and "compress" (the others)."""
        return {
            kind: rope_at(inv, positions)
            for kind, inv in (("main", self.freqs_main), ("compress", self.freqs_compress))
        }

    def rope_kind(self, layer: int) -> tuple[str, torch.Tensor]:
        """Layer `layer`'s RoPE table name in `ropes` and its inverse frequencies."""
        if self.args.layer_types[layer] == SLIDING:
            return "main", self.freqs_main
        return "compress", self.freqs_compress

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [N, n, D] streams -> fp32 logits [N, vocab]."""
        return self.head_logits(self.hc_head(h, self))

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> fp32 logits: the products of the activation-dtype values summed in fp32.
        With bf16 on a GPU that is one bf16 GEMM with fp32 output, not an fp32 copy of the ~1 GB
        head weight on every step."""
        w = self.head.weight
        if x.dtype == w.dtype == torch.bfloat16 and _mm_fp32_out(x.device):
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        return F.linear(x.float(), w.float())

    def hc_head(self, h: torch.Tensor, owner: nn.Module) -> torch.Tensor:
        """Collapse the n streams with `owner`'s hc_head params (main model or an MTP layer), norm."""
        a = self.args
        return self.ops.hc_head(
            h, owner.hc_head_fn, owner.hc_head_scale, owner.hc_head_base, a.norm_eps, a.hc_eps,
            owner.norm.weight,
        )  # fmt: skip

    def mtp_forward(
        self,
        h: torch.Tensor,
        next_ids: torch.Tensor,
        batch: Batch,
        state: DecodeState,
        depth: int = 0,
    ) -> torch.Tensor:
        """MTP layer `depth` on main streams h [T, n, D] (before hc_head) and the next tokens
        [T] -> its streams [T, n, D]; `mtp_logits` of those predict the token after the next.

        Position convention (UNCONFIRMED upstream; vLLM's): the MTP block runs at the positions of
        `h`, and the next token's embedding is masked at position 0.
        """
        mtp = self.mtp[depth]  # (a sliding layer: it builds the window lists it reads itself)
        inv = self.freqs_main
        e = self.embed(next_ids)
        x = mtp(
            h,
            torch.where((batch.positions == 0)[:, None], 0.0, e),
            next_ids,
            batch,
            state.layers[self.args.n_layers + depth],
            rope_at(inv, batch.positions),
            inv,
        )
        return x

    def mtp_logits(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """MTP streams x [N, n, D] -> fp32 logits [N, vocab] (the shared head)."""
        return self.head_logits(self.hc_head(x, self.mtp[depth]))
