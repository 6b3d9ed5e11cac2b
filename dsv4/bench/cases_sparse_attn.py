"""Benchmark cases: sparse attention over gathered K=V rows (decode, verify chunks, prefill).

Keys come from three sources as in a prefill step: a window ring (B*window rows), the new tokens'
K=V (T rows) and a paged pool of compressed entries (B * pool_per_seq rows). Decode picks per
token its window (ring slots + the new rows of its own chunk) and either `sel` distinct random
entries of its sequence's pool region (CSA top-k) or the first `sel` entries (HCA: all visible
entries). The "one source" cases are the engine's decode form: the new K=V already in the ring,
ring and pool one allocation. The "FP8" cases read the same rows as FP8 entries (`--kv-cache-dtype
fp8`: 584 B per row at Flash width instead of 1024; at prefill the new rows too).
bytes = gathered key bytes (T * K_valid * row bytes) + q read + o written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.bench.ops import Case
from dsv4.ops import ref
from dsv4.ops.sparse_attn import sparse_attn
from dsv4.quant import quant_kv_entries


@dataclass(frozen=True)
class _Dims:
    H: int
    D: int
    window: int
    seqs: int  # sequences with a ring and a pool region
    pool_per_seq: int  # compressed entries per sequence region of the pool
    rope_dim: int  # the rope part of a row (FP8 entries keep it bf16)


def _entries(ring: torch.Tensor, pool: torch.Tensor, rope_dim: int) -> torch.Tensor:
    # ring | pool as one allocation of FP8 entries
    return quant_kv_entries(torch.cat([ring, pool]), rope_dim)


def _sources(dims: _Dims, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ring = torch.randn(dims.seqs * dims.window, dims.D, device=device).to(torch.bfloat16)
    pool = torch.randn(dims.seqs * dims.pool_per_seq, dims.D, device=device, dtype=torch.bfloat16)
    return ring, pool


def _selected(T: int, seq: torch.Tensor, dims: _Dims, sel: int, hca: bool) -> torch.Tensor:
    # [T, sel] pool rows of each token's sequence region: distinct random (CSA) or the first sel
    if hca:
        ent = torch.arange(sel, device=seq.device).expand(T, sel)
    else:
        ent = torch.rand(T, dims.pool_per_seq, device=seq.device).topk(sel, dim=1).indices
    return seq[:, None] * dims.pool_per_seq + ent


def _decode_idx(
    dims: _Dims, B: int, per_seq: int, sel: int, hca: bool, device: str
) -> torch.Tensor:
    # B sequences x per_seq new tokens (1 = decode, >1 = a verify chunk); token j of a chunk sees
    # window - 1 - j ring slots of its sequence and the chunk's new rows 0..j
    T, W = B * per_seq, dims.window
    tok = torch.arange(T, device=device)
    seq, j = tok // per_seq, tok % per_seq
    c = torch.arange(W, device=device)[None, :]
    first_new = (W - 1 - j)[:, None]
    ring_rows = seq[:, None] * W + c
    new_rows = dims.seqs * W + seq[:, None] * per_seq + (c - first_new)
    win = torch.where(c >= first_new, new_rows, ring_rows)
    base = dims.seqs * W + T
    return torch.cat([win, base + _selected(T, seq, dims, sel, hca)], dim=1)


def _decode_idx_one_source(dims: _Dims, B: int, sel: int, device: str) -> torch.Tensor:
    # the engine's decode form: one new token per sequence, already stored in its ring slot, and
    # ring | pool one allocation: window = the sequence's W ring rows, then its selected entries
    seq = torch.arange(B, device=device)
    win = seq[:, None] * dims.window + torch.arange(dims.window, device=device)[None, :]
    return torch.cat([win, dims.seqs * dims.window + _selected(B, seq, dims, sel, False)], dim=1)


def _prefill_idx(dims: _Dims, T: int, sel: int, hca: bool, device: str) -> torch.Tensor:
    # one sequence (seq 0) prefilling T tokens after a long context: token t's window is the
    # positions t-W+1..t, new rows where >= 0 and the ring (the context's last W tokens) before
    W = dims.window
    t = torch.arange(T, device=device)[:, None]
    pos = t - (W - 1) + torch.arange(W, device=device)[None, :]  # relative to the chunk start
    win = torch.where(pos >= 0, dims.seqs * W + pos, pos + W)  # ring slot W+pos of seq 0
    seq = torch.zeros(T, dtype=torch.long, device=device)
    return torch.cat([win, dims.seqs * W + T + _selected(T, seq, dims, sel, hca)], dim=1)


def _case(
    name: str,
    dims: _Dims,
    ring: torch.Tensor,
    pool: torch.Tensor,
    idx: torch.Tensor,
    device: str,
    num_splits: int | None = None,
    target_us: float | None = None,
    target_bw: float | None = None,
    one_source: bool = False,
    fp8: torch.Tensor | None = None,
) -> Case:
    # fp8: ring | pool as FP8 entries (`_entries`): one source, or with the new rows as entries too
    T, K = idx.shape
    q = torch.randn(T, dims.H, dims.D, device=device).to(torch.bfloat16)
    new = torch.randn(T, dims.D, device=device).to(torch.bfloat16)
    sink = torch.randn(dims.H, device=device)
    kv, scale = (ring, new, pool), dims.D**-0.5
    if one_source:  # ring | pool as one allocation (the launcher merges the two views)
        both = torch.cat([ring, pool]) if fp8 is None else fp8
        kv = (both[: ring.shape[0]], both[ring.shape[0] :])
    elif fp8 is not None:  # a prefill over FP8 state: the chunk's rows are entries as well
        n = ring.shape[0]
        kv = (fp8[:n], quant_kv_entries(new, dims.rope_dim), fp8[n:])
    elt = q.element_size()
    row = kv[0].shape[1] * kv[0].element_size()
    nbytes = int((idx >= 0).sum()) * row + 2 * q.numel() * elt  # keys + q + o
    rd = dims.rope_dim
    return Case(
        "sparse_attn",
        name,
        run=lambda: sparse_attn(q, kv, sink, idx, scale, rd, num_splits=num_splits),
        ref=lambda: ref.sparse_attn(q, kv, sink, idx, scale, rd),
        bytes=nbytes,
        target_us=target_us,
        target_bw=target_bw,
    )


def cases(device: str, quick: bool) -> list[Case]:
    torch.manual_seed(0)
    if quick:  # tiny shapes for the interpreter
        dims = _Dims(H=8, D=64, window=16, seqs=4, pool_per_seq=64, rope_dim=16)
        ring, pool = _sources(dims, device)
        fp8 = _entries(ring, pool, dims.rope_dim)
        return [
            _case("T=1 K=16+24", dims, ring, pool, _decode_idx(dims, 1, 1, 24, False, device), device),
            _case("T=1 K=16+24 splits=3", dims, ring, pool, _decode_idx(dims, 1, 1, 24, False, device),
                  device, num_splits=3),
            _case("T=2x2 K=16+24", dims, ring, pool, _decode_idx(dims, 2, 2, 24, False, device), device),
            _case("T=3 K=16+32 HCA", dims, ring, pool, _decode_idx(dims, 3, 1, 32, True, device), device),
            _case("T=3 K=16+24 one source", dims, ring, pool, _decode_idx_one_source(dims, 3, 24, device),
                  device, one_source=True),
            _case("T=3 K=16+24 one source FP8", dims, ring, pool,
                  _decode_idx_one_source(dims, 3, 24, device), device, one_source=True, fp8=fp8),
            _case("prefill T=20 K=16+24", dims, ring, pool, _prefill_idx(dims, 20, 24, False, device), device),
            _case("prefill T=20 K=16+24 FP8", dims, ring, pool, _prefill_idx(dims, 20, 24, False, device),
                  device, fp8=fp8),
        ]  # fmt: skip
    # Flash: H=64, D=512, window 128; 64 sequences x 32768 compressed entries (CSA at 128K)
    dims = _Dims(H=64, D=512, window=128, seqs=64, pool_per_seq=32768, rope_dim=64)
    ring, pool = _sources(dims, device)
    fp8 = _entries(ring, pool, dims.rope_dim)

    def one(B: int) -> torch.Tensor:
        return _decode_idx_one_source(dims, B, 512, device)

    def dec(B: int, per_seq: int = 1, sel: int = 512, hca: bool = False) -> torch.Tensor:
        return _decode_idx(dims, B, per_seq, sel, hca, device)

    return [
        _case("decode T=1 K=128+512", dims, ring, pool, dec(1), device, target_us=10.0),
        _case("decode T=16 K=128+512", dims, ring, pool, dec(16), device),
        _case("decode T=64 K=128+512", dims, ring, pool, dec(64), device, target_bw=0.6),
        _case("decode T=64 K=128+512 splits=1", dims, ring, pool, dec(64), device, num_splits=1),
        _case("decode T=64 K=128+512 one source", dims, ring, pool, one(64), device,
              target_bw=0.6, one_source=True),
        _case("decode T=1 K=128+512 one source FP8", dims, ring, pool, one(1), device,
              one_source=True, fp8=fp8),
        _case("decode T=16 K=128+512 one source FP8", dims, ring, pool, one(16), device,
              one_source=True, fp8=fp8),
        _case("decode T=64 K=128+512 one source FP8", dims, ring, pool, one(64), device,
              one_source=True, fp8=fp8),
        _case("decode T=1 K=128+1024 HCA", dims, ring, pool, dec(1, sel=1024, hca=True), device),
        _case("verify T=4x16 K=128+512", dims, ring, pool, dec(16, per_seq=4), device),
        _case("prefill T=4096 K=128+512", dims, ring, pool,
              _prefill_idx(dims, 4096, 512, False, device), device),
        _case("prefill T=4096 K=128+1024 HCA", dims, ring, pool,
              _prefill_idx(dims, 4096, 1024, True, device), device),
        _case("prefill T=4096 K=128+512 FP8", dims, ring, pool,
              _prefill_idx(dims, 4096, 512, False, device), device, fp8=fp8),
    ]  # fmt: skip
