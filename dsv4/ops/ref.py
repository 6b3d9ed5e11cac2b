"""PyTorch reference ops: each function is the spec's equation, written for reading, not speed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4 import quant


def dequant_weight(
    weight: torch.Tensor,
    fmt: str,
    scale: torch.Tensor | None,
    scale2: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A checkpoint weight in compute dtype: dense | fp8 (128x128 UE8M0) | fp4 (MXFP4) | nvfp4."""
    if fmt == "dense":
        return weight.to(dtype)
    if fmt == "fp8":
        return quant.dequant_fp8(weight, scale, dtype)
    if fmt == "fp4":
        return quant.dequant_mxfp4(weight, scale, dtype)
    if fmt == "nvfp4":
        return quant.dequant_nvfp4(weight, scale, scale2, dtype)
    raise ValueError(f"unknown weight format {fmt!r}")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    fmt: str = "dense",
    scale: torch.Tensor | None = None,
    scale2: torch.Tensor | None = None,
) -> torch.Tensor:
    # x: [..., in] ; weight: [out, in] in `fmt` ; y: [..., out] in x.dtype
    return F.linear(x, dequant_weight(weight, fmt, scale, scale2, x.dtype))


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    fmt: str = "dense",
    scale: torch.Tensor | None = None,
    scale2: torch.Tensor | None = None,
) -> torch.Tensor:
    # x: [T, G, K] ; weight: [G*R, K] (group g = rows g*R..g*R+R-1) ; y: [T, G, R]
    groups = x.shape[1]
    w = dequant_weight(weight, fmt, scale, scale2, x.dtype)
    return torch.einsum("tgk,grk->tgr", x, w.view(groups, -1, w.shape[-1]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # fp32 statistics; weight (fp32) multiplies the fp32 normalised value, then cast back
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    # x: [T, ..., d] ; cos/sin: [T, rd/2] fp32 ; rotate pairs (2i, 2i+1) of the trailing rd channels
    rd = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    rope = x[..., -rd:].float().unflatten(-1, (-1, 2))
    re, im = rope[..., 0], rope[..., 1]
    out = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], out.to(x.dtype)], dim=-1)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    # x: [T, ..., d] -> RMSNorm over d (fp32 weight or none), then RoPE on the trailing rd dims ;
    # store = (dst [N, d], rows [T]): also dst[rows[t]] = out[t] (x: [T, d]; rows distinct, >= 0)
    # (dst uint8: FP8 entries of out, `dsv4.quant.quant_kv_entries`)
    out = rotary(rms_norm(x, weight, eps), cos, sin)
    if store is not None:
        dst, rows = store
        dst[rows] = _to_rows(out, dst, 2 * cos.shape[-1])
    return out


def _to_rows(x: torch.Tensor, dst: torch.Tensor, rope_dim: int) -> torch.Tensor:
    # rows x [n, d] in dst's form: its dtype, or FP8 entries when dst is uint8
    if dst.dtype == torch.uint8:
        return quant.quant_kv_entries(x, rope_dim)
    return x.to(dst.dtype)


def norm_rope_qkv(
    q: torch.Tensor,
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # the attention's queries q [T, H, d] (per-head norm, no weight) and window K=V kv [T, d]
    # (weight, the optional store): two norm_ropes at the same positions
    return norm_rope(q, None, eps, cos, sin), norm_rope(kv, weight, eps, cos, sin, store)


def sparse_attn(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, ...],
    attn_sink: torch.Tensor,
    topk_idxs: torch.Tensor,
    scale: float,
    rope_dim: int = 0,
    *,
    inv_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    # q: [T, H, D] ; kv: row tensors [N_i, D] addressed as one concatenation (K = V), or uint8
    # FP8 entries [N_i, bytes] of D channels whose last rope_dim are the rope part ;
    # attn_sink: [H] fp32 ; topk_idxs: [T, K] rows of the concatenation, -1 = none
    # o_h = sum_j softmax_j([l_hj ; sink_h]) * kv_j, with the sink's probability mass dropped ;
    # inv_rope = (cos, sin): then rotary(o, cos, sin, inverse=True) (V = K carries RoPE)
    valid = topk_idxs >= 0
    keys = torch.cat(kv)[topk_idxs.clamp(min=0)]  # [T, K, D]
    if keys.dtype == torch.uint8:
        keys = quant.dequant_kv_entries(keys, q.shape[-1], rope_dim).to(q.dtype)
    logits = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = attn_sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    o = torch.einsum("thk,tkd->thd", probs, keys.float()).to(q.dtype)
    return o if inv_rope is None else rotary(o, *inv_rope, inverse=True)


def _hc_mixes(x: torch.Tensor, hc_fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    # x: [T, n, D] -> fn . RMS-normalised flatten(x) (unweighted norm over all n*D, stream 0 first)
    flat = x.flatten(1).float()
    return F.linear(flat, hc_fn.float()) * torch.rsqrt(
        flat.square().mean(-1, keepdim=True) + norm_eps
    )


def _hc_collapse(pre: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # y = sum_i pre_i x_i: [T, n] fp32 weights, x [T, n, D] -> [T, D] x.dtype (fp32 sum)
    return (pre.unsqueeze(-1) * x.float()).sum(1).to(x.dtype)


def hc_pre(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x: [T, n, D] -> y: [T, D] (collapse; then rms_norm(., norm_weight, norm_eps) when a weight is
    # given: the block's attn_norm / ffn_norm), post: [T, n] fp32, comb: [T, n, n] fp32
    n = x.shape[1]
    mixes = _hc_mixes(x, hc_fn, norm_eps)  # [T, (2+n)*n]
    pre = torch.sigmoid(mixes[:, :n] * hc_scale[0] + hc_base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * hc_scale[1] + hc_base[n : 2 * n])
    comb = mixes[:, 2 * n :].view(-1, n, n) * hc_scale[2] + hc_base[2 * n :].view(n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps  # row softmax
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)  # column normalisation
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    y = _hc_collapse(pre, x)
    return (y if norm_weight is None else rms_norm(y, norm_weight, norm_eps)), post, comb


def hc_post(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    # X'[k] = post[k] * y + sum_j comb[j, k] * X[j]   (comb consumed transposed)
    out = post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum(
        "tjk,tjd->tkd", comb, residual.float()
    )
    return out.to(y.dtype)


def hc_post_pre(
    y: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    # a sublayer's hc_post, then the next sublayer's hc_pre on its streams: (x', y', post', comb')
    x = hc_post(y, residual, post, comb)
    return (x,) + hc_pre(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps, sinkhorn_iters, norm_weight)


def hc_head(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    # x: [T, n, D] -> [T, D]: sigmoid-weighted collapse, no Sinkhorn (then rms_norm with
    # norm_weight if given: the model's final norm)
    mixes = _hc_mixes(x, hc_fn, norm_eps)  # [T, n]
    pre = torch.sigmoid(mixes * hc_scale.float() + hc_base.float()) + hc_eps
    y = _hc_collapse(pre, x)
    return y if norm_weight is None else rms_norm(y, norm_weight, norm_eps)


def moe_gate(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    route_scale: float,
    idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [T, D] ; weight: [E, D] ; bias: [E] fp32 (selection only) ; idx: [T, k] fixed experts
    # (hash routing; bias unused) -> (weights [T, k] fp32, idx [T, k] int64)
    scores = F.softplus(F.linear(x.float(), weight.float())).sqrt()  # [T, E] fp32
    if idx is None:  # ties -> lower expert id
        idx = stable_topk(scores + bias, k)
    weights = scores.gather(1, idx)
    return weights / weights.sum(-1, keepdim=True) * route_scale, idx


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    # indices of the k largest along the last dim; equal scores resolve to the lower index
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def compress_store(
    kv: torch.Tensor,
    score: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out: torch.Tensor,
    dest: torch.Tensor,
    rows: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    chunk: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    # kv, score: [n, slots, d] fp32 (score -inf = empty slot) ; cos/sin: [n, rd/2] ; dest: [n] rows,
    # -1 = no store (a window that does not close: the static shapes of a CUDA-graph step)
    # rows: [n, slots] (-1 = empty slot): kv / score are then [N, d] rows, slot s of window i row
    # rows[i, s] ; chunk: a second [M, d] (kv, score) source, rows N.. N+M-1 (prefill: ring | chunk)
    # out[dest] = RoPE(RMSNorm(sum_slots softmax_slots(score) * kv)): per-channel softmax pooling
    if chunk is not None:
        kv, score = torch.cat([kv, chunk[0]]), torch.cat([score, chunk[1]])
    if rows is not None:  # a window not stored is not read (its rows may lie past the sources)
        rows = torch.where((dest >= 0)[:, None], rows, -1)
        empty = (rows < 0)[..., None]
        kv = kv[rows.clamp(min=0)].masked_fill(empty, 0.0)
        score = score[rows.clamp(min=0)].masked_fill(empty, float("-inf"))
    # out uint8: FP8 entries (`dsv4.quant.quant_kv_entries`) of the value rounded as bf16, or with
    # out_scale [rows] fp32 FP8 indexer keys (`dsv4.quant.quant_index_keys`)
    act = torch.bfloat16 if out.dtype == torch.uint8 else out.dtype
    pooled = (kv * torch.softmax(score, dim=1)).sum(1).to(act)
    keep = dest >= 0
    y = norm_rope(pooled, weight, eps, cos, sin)[keep]
    if out_scale is not None:
        out[dest[keep]], out_scale[dest[keep]] = quant.quant_index_keys(y)
    else:
        out[dest[keep]] = _to_rows(y, out, 2 * cos.shape[-1])


def compress_keep(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    kv_state: torch.Tensor,
    score_state: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    # a compressor's projections of T tokens into its ring (decode: every token is its sequence's
    # last): kv_state[rows] = kv (fp32) ; score_state[rows] = gate (fp32) + ape[position % ratio]
    # kv, gate: [T, n] ; ape: [ratio, n] fp32 ; positions, rows: [T] (-1: no store) ;
    # kv/score_state: [N, n] fp32
    keep = rows >= 0
    kv_state[rows[keep]] = kv[keep].float()
    score_state[rows[keep]] = gate[keep].float() + ape[positions[keep] % ratio]


def counted_rows(cand_idxs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[T, C] candidate rows with positions at or past counts[t] hidden (-1) for token t."""
    pos = torch.arange(cand_idxs.shape[1], device=cand_idxs.device)
    return torch.where(pos[None, :] < counts[:, None], cand_idxs, -1)


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    cand_idxs: torch.Tensor,
    topk: int,
    key_scale: torch.Tensor | None = None,
    weight_scale: float = 1.0,
    *,
    sort: bool = True,
    one_sequence: bool = False,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    # (one_sequence: the kernel's hint that the rows are one sequence's causal prefixes; the
    # result does not depend on it ; counts [T]: token t sees only positions < counts[t], so that
    # one sequence's tokens may pass its one list of rows, expanded, instead of a table)
    # q: [T, H, d] ; weights: [T, H] ; keys: [N, d] rows ; cand_idxs: [T, C] rows, -1 = not visible.
    # score(t, c) = sum_h w_th * relu(q_th . k_c) with w = weights.float() * weight_scale; returns
    # [T, min(topk, C)] positions in 0..C-1 (the compressed entry ids), -1 where fewer than topk
    # entries are visible: in descending score order (ties: lower position first), or with
    # sort=False in any order that depends only on the inputs (this reference sorts anyway).
    # key_scale [N] fp32: keys are FP8 indexer keys (uint8 e4m3 codes, `dsv4.quant.quant_index_keys`)
    if counts is not None:
        cand_idxs = counted_rows(cand_idxs, counts)
    valid = cand_idxs >= 0
    rows = cand_idxs.clamp(min=0)
    if key_scale is not None:
        k = quant.dequant_index_keys(keys[rows], key_scale[rows])
    else:
        k = keys[rows].float()  # [T, C, d]
    s = torch.relu(torch.einsum("thd,tcd->thc", q.float(), k))
    w = weights.float() * weight_scale
    s = (s * w.unsqueeze(-1)).sum(1).masked_fill(~valid, float("-inf"))
    top = stable_topk(s, min(topk, s.shape[-1]))
    return torch.where(valid.gather(1, top), top, -1)


def swiglu(
    g: torch.Tensor, u: torch.Tensor, limit: float, weights: torch.Tensor | None = None
) -> torch.Tensor:
    # g, u: [T, I] the w1 / w3 outputs -> silu(min(g, limit)) * clamp(u, -limit, limit), times
    # weights[:, None] (the routing weight) if given; fp32 math, returned in g.dtype
    h = F.silu(g.float().clamp(max=limit)) * u.float().clamp(-limit, limit)
    if weights is not None:
        h = h * weights[:, None]
    return h.to(g.dtype)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    experts: torch.nn.ModuleList,
    shared: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    # x: [T, D] ; weights, idx: [T, k] routing weights (fp32) and expert ids -> [T, D] out_dtype:
    # y_t = sum_j Expert_{idx[t,j]}(x_t, weights[t,j]) (SwiGLU, clamp, weight before w2), plus the
    # shared expert's output shared [T, D] (as fp32) when given, summed in fp32, then cast.
    # An id < 0 (expert parallelism: the expert lives on another rank) contributes nothing.
    # (token, slot) pairs grouped by expert; one host sync for the per-expert counts
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = idx.flatten()
    order = flat.argsort(stable=True)  # the pairs with ids < 0 first: skipped
    tok, slot = order // idx.shape[1], order % idx.shape[1]
    # bin 0 counts the skipped pairs, bin e + 1 expert e's
    skipped, *counts = torch.bincount((flat + 1).clamp(min=0), minlength=len(experts) + 1).tolist()
    start = skipped
    for e, n in enumerate(counts):
        if n:
            t, k = tok[start : start + n], slot[start : start + n]
            y.index_add_(0, t, experts[e](x[t], weights[t, k]).float())
            start += n
    return (y if shared is None else y + shared.float()).to(out_dtype)


def forget_params() -> None:
    """Drop what a backend derived from the parameters (their storages moved: sleep mode; some
    of them written: a weight update). The references derive nothing."""
