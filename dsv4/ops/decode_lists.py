"""A static decode step's index lists in one launch (`Batch.prepare` on a GPU, `FUSED`).

A CUDA-graph decode step (`Batch.build_static`) replays the index arithmetic of its `Batch` every
step: the window rows, the ring writes, the windows a token closes, the visible compressed entries
and the attention's key rows, each as a chain of small torch ops (~150 of them at batch 1 for a
sliding + CSA + HCA model, counted on the CPU). This kernel writes the same lists, one program per
(token, chunk of 1024 entries); `Batch.prepare` files them under its builders' keys. The builders
are the reference: `tests/ops/test_decode_lists.py` checks every list against them, entry for entry.

Only the static decode form (one token per sequence, graph_len > 0) is covered: there every list
has a shape fixed by the batch size and graph_len. `selected_rows` is the CSA layers' per-layer
list (`Batch.selected_idxs`: the window rows, then the rows of the entries the indexer picked) in
one launch where the builder takes three (remainder, gather, cat); any batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4.ops.device import cdiv, chain, chain_start, next_power_of_2

# Batch.prepare runs this kernel on a GPU (H200, as CUDA graphs: 6.3 vs 194-290 us for the torch
# builders at 4K, 9.7-15.4 vs 267-399 at 128K; decode step batch 1 7.36 -> 7.11 ms: docs/PERF.md)
FUSED = True
BLOCK = 128  # list entries per step of a program's loops
CHUNK = 1024  # entries of a kind's lists per program (a 128K-context token: 32 programs)


@triton.jit
def _entry_rows(bt_row, w, epb, max_blocks):
    # the paged rows of compressed entries w of one sequence (block table row bt_row); w < 0 -> -1
    blk = tl.minimum(tl.maximum(w, 0) // epb, max_blocks - 1)
    page = tl.load(bt_row + blk)
    return tl.where((w >= 0) & (page >= 0), page * epb + tl.maximum(w, 0) % epb, -1)


@triton.jit
def _kind(t, slot, p, bt_row, max_blocks, max_seqs, block_size, base, close_ptr, rows_ptr,
          ring_ptr, vis_ptr, cring_ptr, keys_ptr, keys_stride, keys_off,
          M: tl.constexpr, OVERLAP: tl.constexpr, C, KEYS_LAST: tl.constexpr,
          BLOCK: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    # one compression ratio M, token t at position p:
    #   close_ptr [3, T]: w, dest, count ; rows_ptr [T, S]: the closing window's source rows
    #   (ring | chunk) ; ring_ptr [T]: the compressor ring row of p ; vis_ptr [T, C]: visible
    #   entries ; cring_ptr [T, S]: the closing window's rows in the compressor ring (as [rows*c, d]
    #   with overlap) ; keys_ptr: the attention's key rows of the entries (+ base, -1 = none),
    #   from column keys_off, with a last column of -1 when KEYS_LAST. Program (t, c) writes entries
    #   [c * CHUNK, (c + 1) * CHUNK) of the two entry lists; program (t, 0) also the rest
    T = tl.num_programs(0)
    c = tl.program_id(1)
    S: tl.constexpr = 2 * M if OVERLAP else M  # slots of a window = the ring
    epb = block_size // M
    w = p // M
    count = (p + 1) // M
    if c == 0:
        dest = tl.where((p + 1) % M == 0, _entry_rows(bt_row, w, epb, max_blocks), -1)
        tl.store(close_ptr + t, w)
        tl.store(close_ptr + T + t, dest)
        tl.store(close_ptr + 2 * T + t, count)
        tl.store(ring_ptr + t, slot * S + p % S)
        j = tl.arange(0, S)
        first = M * w - M if OVERLAP else M * w
        pos = first + j
        # history rows: this step's token (pos >= p) in the chunk rows after the ring, else the ring
        hist = tl.where(pos >= p, max_seqs * S + t + (pos - p), slot * S + tl.maximum(pos, 0) % S)
        tl.store(rows_ptr + t * S + j, tl.where(pos >= 0, hist, -1))
        ring = slot * S + tl.maximum(pos, 0) % S
        if OVERLAP:
            ring = 2 * ring + j // M
        tl.store(cring_ptr + t * S + j, tl.where(pos >= 0, ring, -1))
        if KEYS_LAST:
            tl.store(keys_ptr + t * keys_stride + keys_off + C, -1)

    for c0 in range(c * CHUNK, tl.minimum(C, c * CHUNK + CHUNK), BLOCK):
        cw = c0 + tl.arange(0, BLOCK)
        ok = cw < C
        rows = _entry_rows(bt_row, tl.where(cw < count, cw, -1), epb, max_blocks)
        tl.store(vis_ptr + t * C + cw, rows, mask=ok)
        keys = tl.where(rows >= 0, rows + base, -1)
        tl.store(keys_ptr + t * keys_stride + keys_off + cw, keys, mask=ok)


# CA / CB (entries a token's lists hold: the graph's position bound / ratio) grow with the
# context: unspecialized, one compile serves every bound (they were constexprs, one compile a
# bound, met by served steps after the warm-up: docs/PERF.md, 2026-12-01)
@triton.jit(do_not_specialize=["CA", "CB"])
def _decode_lists_kernel(
    slots_ptr,  # [T] int64 state slot of each token's sequence
    pos_ptr,  # [T] int64 position of each token
    bt_ptr,  # [T, max_blocks] int64 block table rows of the batch
    win_ptr,  # [T, W] window rows (ring only)
    wring_ptr,  # [T] the window ring row of p
    tok_ptr,  # [T] 0..T-1
    a_close, a_rows, a_ring, a_vis, a_cring, a_keys,  # CSA (ratio MA, overlap): see _kind
    b_close, b_rows, b_ring, b_vis, b_cring, b_keys,  # HCA (ratio MB)
    max_blocks,
    stride_bt,
    max_seqs,
    block_size,
    base,
    W: tl.constexpr,
    HAS_A: tl.constexpr,
    MA: tl.constexpr,
    CA,
    HAS_B: tl.constexpr,
    MB: tl.constexpr,
    CB,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    # grid (T, chunks of CHUNK entries): program (t, 0) writes token t's window lists and each
    # kind's per-token lists, every program one chunk of each kind's entry lists
    chain_start(PDL)
    t = tl.program_id(0)
    head = tl.program_id(1) == 0
    slot = tl.load(slots_ptr + t)
    p = tl.load(pos_ptr + t)
    bt_row = bt_ptr + t * stride_bt
    j = tl.arange(0, W)
    pos = p - W + 1 + j
    win = tl.where(pos >= 0, slot * W + tl.maximum(pos, 0) % W, -1)
    if head:
        tl.store(tok_ptr + t, t.to(tl.int64))
        tl.store(wring_ptr + t, slot * W + p % W)
        tl.store(win_ptr + t * W + j, win)
    if HAS_A:  # CSA: the entry_idxs list, [T, CA + 1], its last column -1
        _kind(t, slot, p, bt_row, max_blocks, max_seqs, block_size, base, a_close, a_rows, a_ring,
              a_vis, a_cring, a_keys, CA + 1, 0, MA, True, CA, True, BLOCK, CHUNK)  # fmt: skip
    if HAS_B:  # HCA: the attention_idxs list, [T, W + CB]: the window rows, then the entries
        if head:
            tl.store(b_keys + t * (W + CB) + j, win)
        _kind(t, slot, p, bt_row, max_blocks, max_seqs, block_size, base, b_close, b_rows, b_ring,
              b_vis, b_cring, b_keys, W + CB, W, MB, False, CB, False, BLOCK, CHUNK)  # fmt: skip


class KindLists(NamedTuple):
    """One compressed kind's lists, as `Batch`'s builders give them."""

    ratio: int
    overlap: bool  # CSA (else HCA)
    closing: tuple  # `closing_windows(ratio, overlap)`: (token, entry w, pool row of w, rows)
    closing_ring: torch.Tensor  # `closing_ring_rows(ratio, overlap)`
    ring_writes: tuple  # `ring_writes(2 * ratio if overlap else ratio)`: (token, rows)
    visible: tuple  # `visible_entries(ratio)`: (rows, counts)
    # CSA: `entry_idxs(ratio, base)` ; HCA: `attention_idxs(window, ratio, base)`
    keys: torch.Tensor


class DecodeLists(NamedTuple):
    """A static decode step's shared lists (`Batch.prepare` files them under its builders' keys)."""

    window: torch.Tensor  # `window_idxs(window, ring_only=True)`
    ring_writes: tuple  # `ring_writes(window)`: (token, rows)
    kinds: list  # KindLists of the kinds present (CSA, then HCA)


def fill(
    batch,  # noqa: ANN001  (state.Batch: a static decode step)
    window: int,
    csa_ratio: int | None,
    hca_ratio: int | None,
    base: int,
) -> DecodeLists:
    """The static decode `batch`'s shared lists in one launch: what `Batch.window_idxs(window,
    True)`, `ring_writes`, `closing_windows`, `closing_ring_rows`, `visible_entries`,
    `entry_idxs(csa_ratio, base)` and `attention_idxs(window, hca_ratio, base)` build (a ratio of
    None: no layer of that kind)."""
    assert batch.graph_len > 0 and batch.decode, "decode_lists: a static decode batch only"
    assert window & (window - 1) == 0, f"window {window} must be a power of 2"
    T, dev = batch.num_tokens, batch.positions.device
    i64 = dict(dtype=torch.long, device=dev)
    win = torch.empty((T, window), **i64)
    wring = torch.empty(T, **i64)
    tok = torch.empty(T, **i64)
    kinds = []
    for m, overlap in ((csa_ratio, True), (hca_ratio, False)):
        if m is None:
            kinds.append(None)
            continue
        assert m & (m - 1) == 0, f"ratio {m} must be a power of 2"
        S, C = (2 * m if overlap else m), max(batch.graph_len // m, 1)
        keys_w = C + 1 if overlap else window + C
        kinds.append((m, overlap, S, C, torch.empty((3, T), **i64), torch.empty((T, S), **i64),
                      torch.empty(T, **i64), torch.empty((T, C), **i64),
                      torch.empty((T, S), **i64), torch.empty((T, keys_w), **i64)))  # fmt: skip
    if T:
        bt = batch.block_table
        assert bt.dtype == torch.long and bt.stride(1) == 1, "block table: int64 rows"
        a, b = kinds
        dummy = (wring,) * 6
        chunks = cdiv(max(k[3] if k else 1 for k in kinds), CHUNK)
        _decode_lists_kernel[(T, chunks)](
            batch.slots, batch.positions, bt, win, wring, tok,
            *(a[4:] if a else dummy), *(b[4:] if b else dummy),
            bt.shape[1], bt.stride(0), batch.max_seqs, batch.block_size, base,
            W=window, HAS_A=a is not None, MA=a[0] if a else 1, CA=a[3] if a else 1,
            HAS_B=b is not None, MB=b[0] if b else 1, CB=b[3] if b else 1, BLOCK=BLOCK,
            CHUNK=CHUNK, num_warps=4, **chain(dev),
        )  # fmt: skip
    out = []
    for kind in kinds:
        if kind is None:
            continue
        m, overlap, S, C, close, rows, ring, vis, cring, keys = kind
        w, dest, count = close[0], close[1], close[2]
        out.append(
            KindLists(m, overlap, (tok, w, dest, rows), cring, (tok, ring), (vis, count), keys)
        )
    return DecodeLists(win, (tok, wring), out)


@triton.jit(do_not_specialize=["C1", "K", "stride_er"])  # per-step counts: one compile
def _selected_rows_kernel(win_ptr, ent_rows_ptr, ent_ptr, out_ptr, C1, K, stride_er,
                          W: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    # token t: out[t] = win[t] (W rows), then ent_rows[t, ent[t, i] mod C1] for the K picks
    chain_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, W)
    tl.store(out_ptr + t * (W + K) + j, tl.load(win_ptr + t * W + j))
    for k0 in range(0, K, BLOCK):
        i = k0 + tl.arange(0, BLOCK)
        ok = i < K
        e = tl.load(ent_ptr + t * K + i, mask=ok, other=0)
        e = tl.where(e < 0, C1 - 1, e)  # -1 picks the last column (all -1)
        rows = tl.load(ent_rows_ptr + t * stride_er + e, mask=ok)
        tl.store(out_ptr + t * (W + K) + W + i, rows, mask=ok)


def selected_rows(win: torch.Tensor, ent_rows: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    """win [T, W] window rows, ent_rows [T, C + 1] entry key rows (`Batch.entry_idxs`, last column
    -1), ent [T, K] picked positions (-1 = none) -> [T, W + K] int64: `Batch.selected_idxs`."""
    T, W = win.shape
    K = ent.shape[1]
    assert W & (W - 1) == 0, f"window {W} must be a power of 2"
    assert ent_rows.shape[0] == T == ent.shape[0], f"{win.shape} {ent_rows.shape} {ent.shape}"
    assert win.is_contiguous() and ent.is_contiguous() and ent_rows.stride(1) == 1
    out = torch.empty((T, W + K), dtype=torch.long, device=win.device)
    if T:
        _selected_rows_kernel[(T,)](
            win, ent_rows, ent, out, ent_rows.shape[1], K, ent_rows.stride(0), W=W,
            BLOCK=min(BLOCK, next_power_of_2(max(K, 1))), num_warps=4, **chain(win.device),
        )  # fmt: skip
    return out
