"""Decode state (window rings, compressed stores, compressor partial state) and the Batch of one step.

Every sequence owns one state slot. Within a layer all attention keys live in row-addressed tensors
(K=V rows of head_dim values, or with kv_format "fp8" uint8 FP8 entries, `kv_row`):
  window ring   [max_seqs * W, hd]       token p of slot s at row s*W + p % W
  compressed    [num_blocks * b/m, hd]   entry w of a sequence at row page*(b/m) + w % (b/m),
                                          page = block_table[slot, w // (b/m)], b = block_size
  compressor    [max_seqs * R, c*hd] x2  raw (a, z + ape) of token p at row s*R + p % R (fp32)
                                          R = 2m for CSA (last closed window's A-half + open window),
                                          R = m for HCA (open window)
The model turns positions into row index lists here; attention only ever sees index lists (-1 = none).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from dsv4.config import CSA, HCA, KV_CACHE_DTYPES, ModelArgs
from dsv4.ops import decode_lists
from dsv4.quant import cdiv, index_key_bytes, kv_entry_layout

# an eager step's visible-entry width (`Batch.visible_entries`) is rounded up to a multiple of
# this: Triton specializes lengths and row strides on divisibility by 16, so widths that take every
# value would compile the indexer's kernels again in the middle of a request
ENTRY_ALIGN = 16
# a step whose [tokens x visible entries] table of a compressed kind would exceed this many
# elements (a long prefill chunk at long context: 2048 tokens at 1M context see 2^29 CSA entries,
# 4 GiB as int64) never builds it whole (`Batch.sliced`): the indexer takes each sequence's tokens
# in slices, given the sequence's row list and the tokens' counts (`Batch.index_slices`,
# `Batch.index_rows`), and a CSA layer's picks map to their rows directly (`Batch.selected_idxs`)
ENTRY_TABLE_ELEMENTS = 1 << 24
# [slice tokens x entries] of one such slice: its scores (int32) and the select's first level
# (~1 B an element) hold ~5 B an element, 320 MiB; a 2048-token chunk at 128K is one slice, at
# 1M eight of 256 tokens
INDEX_SLICE_ELEMENTS = 1 << 26


def context_table_bytes(args: ModelArgs, tokens: int, max_seq_len: int) -> int:
    """An estimate of what a step of `tokens` tokens at positions up to max_seq_len allocates for
    its index tables beyond the same step at a fresh context (what an activation profile run
    measures): the CSA candidates whole (at most ENTRY_TABLE_ELEMENTS: rows, mask, their gather,
    scores; 24 B an element; a sliced step's slices hold less: INDEX_SLICE_ELEMENTS at ~5 B) and
    the HCA tables whole (entries, the attention list and their build; 32 B an element). H200,
    2048 tokens at 1M: 0.77 GiB measured (bench/probe_long_chunk.py), 0.88 GiB by this."""
    n = 0
    if CSA in args.layer_types:
        n += min(tokens * (max_seq_len // args.csa_ratio), ENTRY_TABLE_ELEMENTS) * 24
    if HCA in args.layer_types:
        n += tokens * (max_seq_len // args.hca_ratio) * 32
    return n


@dataclass
class CompressorState:
    """Emitted entries (paged) plus the raw projections of tokens whose window is still needed."""

    kv_cache: torch.Tensor  # [num_blocks * block_size/m, d] emitted entries (normed, RoPE'd)
    kv_state: torch.Tensor  # [S*R, c*d] fp32 raw W_kv x
    score_state: torch.Tensor  # [S*R, c*d] fp32 raw W_gate x + ape
    ratio: int
    overlap: bool
    # FP8 indexer keys (kv_format "fp8"): kv_cache holds uint8 e4m3 codes, this their fp32 scales
    kv_scale: torch.Tensor | None = None
    # [S*R + step_rows, c*d] fp32: the ring rows (kv_state / score_state are views of the first
    # S*R), then rows for the tokens of a short step (speculative verify steps: `Compressor`)
    kv_all: torch.Tensor | None = None
    score_all: torch.Tensor | None = None
    # prefix caching: the snapshots of kv_state / score_state (`DecodeState.snapshots`)
    kv_snap: torch.Tensor | None = None
    score_snap: torch.Tensor | None = None

    @property
    def ring(self) -> int:
        return 2 * self.ratio if self.overlap else self.ratio

    @property
    def step_rows(self) -> int:
        return len(self.kv_all) - len(self.kv_state)


@dataclass
class LayerState:
    """What one attention layer keeps per sequence."""

    window: torch.Tensor  # [S*W, hd] ring of window K=V
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    window_snap: torch.Tensor | None = None  # prefix caching: the window ring's snapshots


def kv_row(args: ModelArgs, dtype: torch.dtype, kv_format: str = "auto") -> tuple[int, torch.dtype]:
    """(width, dtype) of one attention K=V row in the state: head_dim values of `dtype`, or for
    kv_format "fp8" one uint8 FP8 entry (`dsv4.quant.kv_entry_layout`; 584 B at Flash width)."""
    if kv_format not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_format must be one of {KV_CACHE_DTYPES}, got {kv_format!r}")
    if kv_format == "fp8":
        return kv_entry_layout(args.head_dim, args.rope_head_dim)[2], torch.uint8
    return args.head_dim, dtype


def entry_bytes(args: ModelArgs, dtype: torch.dtype, kv_format: str = "auto") -> tuple[int, int]:
    """Bytes of one (attention K=V row, indexer key) of the state: head_dim / index_head_dim
    values of `dtype`, or for kv_format "fp8" an FP8 entry and an FP8 indexer key (e4m3 codes and
    one fp32 scale): 584 and 132 B at Flash width."""
    width, dt = kv_row(args, dtype, kv_format)
    if kv_format == "fp8":
        return width * dt.itemsize, index_key_bytes(args.index_head_dim)
    return width * dt.itemsize, args.index_head_dim * dtype.itemsize


def bytes_per_token(args: ModelArgs, dtype: torch.dtype, kv_format: str = "auto") -> float:
    """Growing state per token (all layers): compressed KV + indexer keys (spec 9.6)."""
    main, index = entry_bytes(args, dtype, kv_format)
    total = 0.0
    for kind in args.layer_types:
        if kind == CSA:
            total += (main + index) / args.csa_ratio
        elif kind == HCA:
            total += main / args.hca_ratio
    return total


def _compressor_rows(args: ModelArgs) -> list[tuple[int, int]]:
    """(ring rows, bytes of one row) of each layer's compressors together: fp32 kv and score of
    width c*d (CSA: 2m rows, the main and the indexer's compressors, c = 2; HCA: m rows, c = 1)."""
    out = []
    for kind in args.layer_types:
        if kind == CSA:
            out.append((2 * args.csa_ratio, 2 * 2 * (args.head_dim + args.index_head_dim) * 4))
        elif kind == HCA:
            out.append((args.hca_ratio, 2 * args.head_dim * 4))
    return out


def bytes_per_seq(args: ModelArgs, dtype: torch.dtype, kv_format: str = "auto") -> int:
    """Fixed state per sequence: window rings (main + MTP) and fp32 compressor partial state."""
    main = entry_bytes(args, dtype, kv_format)[0]
    total = (args.n_layers + args.n_mtp_layers) * args.window_size * main
    return total + sum(ring * row for ring, row in _compressor_rows(args))


def step_row_bytes(args: ModelArgs) -> int:
    """Bytes of one step row (`DecodeState(step_rows=)`) in every compressor."""
    return sum(row for _, row in _compressor_rows(args))


def default_block_size(args: ModelArgs) -> int:
    """The smallest multiple of both compress ratios that is >= 256 tokens."""
    lcm = math.lcm(args.csa_ratio, args.hca_ratio)
    return lcm * -(-256 // lcm)


class DecodeState:
    """All layers' state: `max_seqs` slots (rings) and `num_blocks` pages of compressed entries.

    A block holds `block_size` tokens' worth of compressed entries in every compressed layer
    (block_size/m entries each). Sequences map logical blocks to pages through `block_table`.
    """

    def __init__(
        self,
        args: ModelArgs,
        max_seqs: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_blocks: int | None = None,
        block_size: int | None = None,
        kv_format: str = "auto",
        num_snapshots: int = 0,
        step_rows: int = 0,
    ) -> None:
        block_size = block_size or default_block_size(args)
        width, kv_dtype = kv_row(args, dtype, kv_format)  # attention rows: values or FP8 entries
        self.args = args
        for m in {args.csa_ratio, args.hca_ratio}:
            if block_size % m:
                raise ValueError(f"block_size={block_size} must be a multiple of ratio {m}")
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        static = num_blocks is None
        if static:  # room for every slot at full length, pages assigned once
            num_blocks = max_seqs * self.max_blocks_per_seq
        self.max_seqs, self.max_seq_len, self.window_size = max_seqs, max_seq_len, args.window_size
        self.num_blocks, self.block_size = num_blocks, block_size
        S, hd = max_seqs, args.head_dim
        self.block_table = torch.full(
            (max_seqs, self.max_blocks_per_seq), -1, dtype=torch.long, device=device
        )
        if static:
            self.block_table.copy_(torch.arange(num_blocks, device=device).view(max_seqs, -1))

        def comp(
            m: int, d: int, overlap: bool, cache: torch.Tensor | None = None
        ) -> CompressorState:
            c, r = (2, 2 * m) if overlap else (1, m)
            scale = None
            if cache is None:  # the indexer's keys: values, or FP8 codes and their scales
                n = num_blocks * (block_size // m)
                fp8 = kv_format == "fp8"
                cache = torch.zeros(n, d, dtype=torch.uint8 if fp8 else dtype, device=device)
                if fp8:
                    scale = torch.zeros(n, dtype=torch.float32, device=device)
            # the ring rows, then step_rows for a short step's own tokens
            kv = torch.zeros(S * r + step_rows, c * d, dtype=torch.float32, device=device)
            score = torch.zeros_like(kv)
            return CompressorState(
                kv_cache=cache,
                kv_state=kv[: S * r],
                score_state=score[: S * r],
                ratio=m,
                overlap=overlap,
                kv_scale=scale,
                kv_all=kv,
                score_all=score,
            )

        self.layers: list[LayerState] = []
        ring_rows = S * args.window_size
        for i in range(args.n_layers + args.n_mtp_layers):
            kind = args.layer_types[i] if i < args.n_layers else None
            m = {CSA: args.csa_ratio, HCA: args.hca_ratio}.get(kind, 0)
            # the ring and the compressed entries of a layer are one allocation, ring first: the
            # attention kernel then sees one key source at decode (rows ring | entries)
            rows = ring_rows + (num_blocks * (block_size // m) if m else 0)
            kv = torch.zeros(rows, width, dtype=kv_dtype, device=device)
            layer = LayerState(window=kv[:ring_rows])
            if kind in (CSA, HCA):
                layer.compressor = comp(m, hd, kind == CSA, kv[ring_rows:])
            if kind == CSA:
                layer.indexer = comp(m, args.index_head_dim, True)
            self.layers.append(layer)
        # prefix caching: copies of a slot's rings at a block boundary (`save_snapshot`), one
        # per ring, num_snapshots slots' worth each
        self.num_snapshots = num_snapshots
        self.all_rings = self.rings(range(len(self.layers)))  # (fixed tensors: listed once)
        self.snapshots = [
            t.new_zeros(num_snapshots * size, t.shape[1]) for t, size in self.all_rings
        ] if num_snapshots else []  # fmt: skip
        if num_snapshots:  # each ring's snapshots beside it, for the model's writes inside a chunk
            snaps = iter(self.snapshots)  # (the order of `rings`)
            for ls in self.layers:
                ls.window_snap = next(snaps)
                for c in (ls.compressor, ls.indexer):
                    if c is not None:
                        c.kv_snap, c.score_snap = next(snaps), next(snaps)

    @staticmethod
    def blocks_for_budget(
        args: ModelArgs,
        max_seqs: int,
        budget_bytes: int,
        dtype: torch.dtype,
        block_size: int,
        kv_format: str = "auto",
        num_snapshots: int = 0,
        step_rows: int = 0,
    ) -> int:
        """How many pages fit in `budget_bytes` after the fixed per-slot state, the snapshots'
        (each one slot's rings) and the step rows (as the constructor's arguments)."""
        fixed = bytes_per_seq(args, dtype, kv_format)
        free = budget_bytes - (max_seqs + num_snapshots) * fixed - step_rows * step_row_bytes(args)
        per_block = bytes_per_token(args, dtype, kv_format) * block_size
        if free <= 0 or per_block <= 0:
            raise ValueError(
                f"memory budget {budget_bytes} B does not cover {max_seqs} sequences' fixed state "
                f"({fixed} B each)"
            )
        return int(free // per_block)

    @staticmethod
    def default_snapshots(
        args: ModelArgs,
        max_seqs: int,
        budget_bytes: int | None,
        dtype: torch.dtype,
        kv_format: str = "auto",
        step_rows: int = 0,
    ) -> int:
        """Prefix caching's default snapshot count: 4 a slot, at most as many as fit in a quarter
        of what the slots' fixed state and the step rows leave of `budget_bytes` for pages (no
        budget: 4 a slot). 0 where not one fits."""
        if budget_bytes is None:
            return 4 * max_seqs
        fixed = bytes_per_seq(args, dtype, kv_format)
        free = budget_bytes - max_seqs * fixed - step_rows * step_row_bytes(args)
        return max(0, min(4 * max_seqs, free // 4 // fixed))

    def rings(self, layers: range) -> list[tuple[torch.Tensor, int]]:
        """(tensor, ring size) of every ring of `layers`: window K=V rows and the compressors'
        raw rows, token p of slot s at row s*size + p % size."""
        out = []
        for ls in self.layers[layers.start : layers.stop]:
            out.append((ls.window, self.window_size))
            for c in (ls.compressor, ls.indexer):
                if c is not None:
                    out += [(c.kv_state, c.ring), (c.score_state, c.ring)]
        return out

    def save_snapshot(self, slot: int, i: int) -> None:
        """Copy slot's rings (every layer, MTP included) into snapshot i."""
        rows, kept = self._snapshot_views(slot, i)
        torch._foreach_copy_(kept, rows)

    def load_snapshot(self, i: int, slot: int) -> None:
        """Copy snapshot i into slot's rings: the slot continues from the snapshot's position."""
        rows, kept = self._snapshot_views(slot, i)
        torch._foreach_copy_(rows, kept)

    def snapshot_prior(self, slot: int, i: int, at: int, start: int) -> None:
        """Snapshot i of the rings at position `at` (a block boundary inside a prefill chunk that
        starts at `start`), its rows from before the chunk: every ring's tokens at - ring ..
        start - 1, copied from slot's rows now (the chunk may overwrite them). The model writes
        the chunk's own tokens before `at` there itself (`Batch.snapshot_writes`,
        `snapshot_keep_rows`)."""
        by_size = {}
        for (t, size), sn in zip(self.all_rings, self.snapshots):
            if size not in by_size:
                lo = max(at - size, 0)
                p = torch.arange(lo, max(lo, start), device=t.device)
                by_size[size] = (slot * size + p % size, i * size + p % size)
            src, dst = by_size[size]
            if len(src):
                sn.index_copy_(0, dst, t.index_select(0, src))

    def _snapshot_views(self, slot: int, i: int) -> tuple[list, list]:
        # (slot's rows of every ring, snapshot i's rows of the same rings)
        rings = self.all_rings
        rows = [t[slot * size : (slot + 1) * size] for t, size in rings]
        kept = [sn[i * size : (i + 1) * size] for sn, (_, size) in zip(self.snapshots, rings)]
        return rows, kept

    def save_rows(
        self, layers: range, slots: list[int], positions: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Copies of the ring rows that tokens at `positions` of `slots` would write in `layers`
        (token i: positions[i] of slots[i]). Speculative decoding puts back the rows that
        rejected drafts overwrote (`restore_rows`): a rejected token past the first overwrites
        an older token that the next step still reads."""
        if not slots:
            return []
        dev = self.block_table.device
        s = torch.tensor(slots, dtype=torch.long, device=dev)
        p = torch.tensor(positions, dtype=torch.long, device=dev)
        saved = []
        for t, size in self.rings(layers):
            rows = s * size + p % size
            saved.append((t, rows, t[rows].clone()))
        return saved

    @staticmethod
    def restore_rows(
        saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], which: list[bool]
    ) -> None:
        """Put back the saved rows of the tokens marked in `which`."""
        if not saved or not any(which):
            return
        pick = torch.tensor(which, device=saved[0][1].device)
        for t, rows, values in saved:
            t[rows[pick]] = values[pick]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the layers' state and of the snapshots (views among them; not the
        block table): what sleep mode gives back."""
        out = []
        for layer in self.layers:
            out += [layer.window] + ([layer.window_snap] if layer.window_snap is not None else [])
            for c in (layer.compressor, layer.indexer):
                if c is not None:
                    out += [t for t in (c.kv_cache, c.kv_all, c.score_all, c.kv_scale,
                                        c.kv_snap, c.score_snap) if t is not None]  # fmt: skip
        return out + list(self.snapshots)

    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            total += layer.window.nbytes
            for c in (layer.compressor, layer.indexer):
                if c is not None:
                    total += c.kv_cache.nbytes + c.kv_all.nbytes + c.score_all.nbytes
                    total += 0 if c.kv_scale is None else c.kv_scale.nbytes
        return total + sum(t.nbytes for t in self.snapshots)


@dataclass
class Batch:
    """One forward step: the new tokens of several sequences, flattened to [T]."""

    slots: torch.Tensor  # [B] state slot of each sequence
    start_pos: torch.Tensor  # [B] position of each sequence's first new token
    lens: torch.Tensor  # [B] new tokens per sequence
    positions: torch.Tensor  # [T]
    token_seq: torch.Tensor  # [T] sequence (0..B-1) of each token
    cu_lens: torch.Tensor  # [B+1] flat offset of each sequence's first token
    block_table: torch.Tensor  # [B, max_blocks] pages of each sequence (-1 = none)
    block_size: int
    max_seqs: int
    decode: bool = False  # every sequence brings one new token
    # the same per-sequence (start_pos, lens) on the host: index lists whose length depends on
    # positions (closing windows, ring writes, the visible width) come from these, so the forward
    # never waits on the device for a count
    host_seqs: tuple[tuple[int, int], ...] = ()
    # > 0: a static decode step (`build_static`): every list keeps its shape for all positions
    # below graph_len, and windows that do not close are stored nowhere (dest -1)
    graph_len: int = 0
    # prefix caching: (sequence, position `at`, snapshot i) for each sequence whose chunk crosses
    # a block boundary `at` where the rings are snapshotted (`Scheduler.snapshots_inside`)
    snapshots: tuple[tuple[int, int, int], ...] = ()
    _cache: dict = field(default_factory=dict, repr=False)
    _prepared: bool = field(default=False, repr=False)  # `prepare` ran

    @classmethod
    def build(
        cls,
        slots: list[int],
        start_pos: list[int],
        lens: list[int],
        state: DecodeState,
        need_pages: bool = True,
    ) -> Batch:
        """The step's tokens: lens[i] of slots[i] from start_pos[i]. need_pages=False: a batch
        for the MTP layer alone (window ring only), whose positions may lie past the pages
        allocated so far."""
        max_seqs, device = state.max_seqs, state.block_table.device
        if not (len(slots) == len(start_pos) == len(lens)) or not slots:
            raise ValueError(
                f"batch lists differ or are empty: {len(slots)}, {len(start_pos)}, {len(lens)}"
            )
        if len(set(slots)) != len(slots) or min(slots) < 0 or max(slots) >= max_seqs:
            raise ValueError(f"slots {slots} must be distinct and in [0, {max_seqs})")
        if min(lens) <= 0 or min(start_pos) < 0:
            raise ValueError(f"lens {lens} must be > 0 and start_pos {start_pos} >= 0")
        last_page = [(s + n - 1) // state.block_size for s, n in zip(start_pos, lens)]
        if max(last_page) >= state.max_blocks_per_seq:
            raise ValueError(f"positions beyond max_seq_len={state.max_seq_len}")
        slots_t = torch.tensor(slots, dtype=torch.long, device=device)
        block_table = state.block_table[slots_t]
        # one check per step (not per layer): every position's page must be allocated
        last_t = torch.tensor(last_page, dtype=torch.long, device=device)
        if need_pages and bool((block_table.gather(1, last_t[:, None]) < 0).any()):
            raise RuntimeError(f"slots {slots}: a position of this step has no page allocated")
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        start_t = torch.tensor(start_pos, dtype=torch.long, device=device)
        token_seq = torch.repeat_interleave(torch.arange(len(lens), device=device), lens_t)
        cu = torch.zeros(len(lens) + 1, dtype=torch.long, device=device)
        cu[1:] = lens_t.cumsum(0)
        positions = start_t[token_seq] + torch.arange(int(cu[-1]), device=device) - cu[token_seq]
        return cls(
            slots=slots_t,
            start_pos=start_t,
            lens=lens_t,
            positions=positions,
            token_seq=token_seq,
            cu_lens=cu,
            block_table=block_table,
            block_size=state.block_size,
            max_seqs=max_seqs,
            decode=max(lens) == 1,
            host_seqs=tuple(zip(start_pos, lens)),
        )

    @classmethod
    def build_static(
        cls,
        slots: torch.Tensor,
        start_pos: torch.Tensor,
        state: DecodeState,
        graph_len: int,
        q: int = 1,
    ) -> Batch:
        """q tokens per sequence at start_pos .. start_pos + q - 1 (one decode token, or a
        speculative step's pending token and drafts), from device tensors [B] (read, not copied),
        with index lists shaped only by B, q and graph_len (> every position): what a CUDA graph
        captures and replays with new slots / positions written into the same tensors. Build it
        inside the capture so the page-table gather is replayed too."""
        B, device = slots.shape[0], slots.device
        if graph_len <= 0 or graph_len > state.max_seq_len:
            raise ValueError(f"graph_len={graph_len} must be in [1, {state.max_seq_len}]")
        ring = min(size for _, size in state.all_rings)
        if not 1 <= q <= ring:
            raise ValueError(f"q={q} tokens per sequence must be in [1, {ring}] (the rings)")
        ar = torch.arange(B + 1, device=device)
        token_seq = ar[:B].repeat_interleave(q)
        return cls(
            slots=slots,
            start_pos=start_pos,
            lens=torch.full((B,), q, dtype=torch.long, device=device),
            positions=start_pos[token_seq] + torch.arange(q, device=device).repeat(B),
            token_seq=token_seq,
            cu_lens=ar * q,
            block_table=state.block_table[slots],
            block_size=state.block_size,
            max_seqs=state.max_seqs,
            decode=q == 1,
            graph_len=graph_len,
        )

    def prepare(self, args: ModelArgs) -> None:
        """Build the index lists every layer of the step shares, before the first layer asks: the
        window rows and ring writes, and per compressed kind present the closing windows, their
        ring rows (decode), the ring writes and the visible entries with their key rows. Once per
        step (later calls return at once). A static decode step on a GPU writes them all in one
        launch (`ops.decode_lists`, when FUSED); the builders below are the reference it is
        tested against."""
        if self._prepared:
            return
        self._prepared = True
        csa = args.csa_ratio if CSA in args.layer_types else None
        hca = args.hca_ratio if HCA in args.layer_types else None
        # rows before the entries: the window rings (+ the new tokens' K=V)
        base = self.max_seqs * args.window_size + (0 if self.decode else self.num_tokens)
        if decode_lists.FUSED and self.graph_len and self.decode and self.positions.is_cuda:
            self.file_lists(decode_lists.fill(self, args.window_size, csa, hca, base), base)
            return
        self.window_idxs(args.window_size, ring_only=self.decode)
        self.ring_writes(args.window_size)
        for m, overlap in ((csa, True), (hca, False)):
            if m is None:
                continue
            self.closing_windows(m, overlap)
            if self.decode:
                self.closing_ring_rows(m, overlap)
            self.ring_writes(2 * m if overlap else m)
            if overlap and self.sliced(m):  # (built in slices, not kept)
                continue
            self.visible_entries(m)
            if overlap:  # CSA: the rows its layers pick their entries from
                self.entry_idxs(m, base)
            else:  # HCA: one key list for every HCA layer
                self.attention_idxs(args.window_size, m, base)

    def file_lists(self, lists: decode_lists.DecodeLists, base: int) -> None:
        """Memoize the one-launch lists (`decode_lists.fill`) under the keys the builders below
        memoize them by, so every layer finds them (tests/ops/test_decode_lists.py checks the keys
        against the builders')."""
        window = lists.window.shape[1]
        c = self._cache
        c[("win", window, True)] = lists.window
        c[("ring", window)] = lists.ring_writes
        for k in lists.kinds:
            c[("close", k.ratio, k.overlap)] = k.closing
            c[("close_ring", k.ratio, k.overlap)] = k.closing_ring
            c[("ring", 2 * k.ratio if k.overlap else k.ratio)] = k.ring_writes
            c[("vis", k.ratio)] = k.visible
            c[("entries", k.ratio, base) if k.overlap else ("attn", window, k.ratio, base)] = k.keys

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    def last_token_idx(self) -> torch.Tensor:
        return self.cu_lens[1:] - 1

    # ---- per-token views of per-sequence fields -------------------------------------------
    def _tok(self, name: str) -> torch.Tensor:
        key = ("tok", name)
        if key not in self._cache:
            v = {
                "slot": self.slots,
                "start": self.start_pos,
                "off": self.cu_lens[:-1],
                "len": self.lens,
            }
            self._cache[key] = v[name][self.token_seq]
        return self._cache[key]

    def _memo(self, key: tuple, fn):  # noqa: ANN001, ANN202
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def memo(self, key: tuple, fn):  # noqa: ANN001, ANN202
        """fn() once per step under `key` (per-step values every layer shares, e.g. RoPE tables)."""
        return self._memo(("user",) + key, fn)

    def history_rows(self, pos: torch.Tensor, tok: torch.Tensor, ring: int) -> torch.Tensor:
        """Rows of positions `pos` [..] of the sequences of tokens `tok` [..] in ring | chunk coordinates.

        Positions already processed (< start_pos) live in the ring (row slot*ring + pos % ring);
        positions of this step live in the chunk (row max_seqs*ring + flat token index); pos < 0 -> -1.
        """
        seq = self.token_seq[tok]
        start, off, slot = self.start_pos[seq], self.cu_lens[:-1][seq], self.slots[seq]
        in_chunk = pos >= start
        rows = torch.where(
            in_chunk, self.max_seqs * ring + off + (pos - start), slot * ring + pos.remainder(ring)
        )
        return torch.where(pos >= 0, rows, -1)

    def window_idxs(self, window: int, ring_only: bool = False) -> torch.Tensor:
        """[T, W] rows (ring | chunk) of each token's window p-W+1 .. p. ring_only: rows of the
        ring alone, for a decode step whose new K=V was stored into the ring before attention
        (position p takes slot p % W; p - W, the position it overwrote, is in no window)."""

        def build() -> torch.Tensor:
            pos = (
                self.positions[:, None]
                - window
                + 1
                + torch.arange(window, device=self.positions.device)
            )
            if ring_only:
                rows = self._tok("slot")[:, None] * window + pos.remainder(window)
                return torch.where(pos >= 0, rows, -1)
            tok = torch.arange(self.num_tokens, device=pos.device)[:, None].expand_as(pos)
            return self.history_rows(pos, tok, window)

        assert not ring_only or self.decode, "ring_only windows need a decode step"
        return self._memo(("win", window, ring_only), build)

    def _host_tokens(self, pick) -> torch.Tensor:  # noqa: ANN001
        """Flat token indices, chosen on the host per sequence: pick(start, len) -> offsets within
        the sequence's tokens. Uploaded without a stream sync (pinned, non-blocking)."""
        flat, off = [], 0
        for start, n in self.host_seqs:
            flat += [off + i for i in pick(start, n)]
            off += n
        device = self.positions.device
        host = torch.tensor(flat, dtype=torch.long, pin_memory=device.type == "cuda")
        return host.to(device, non_blocking=True)

    def ring_writes(self, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, rows): the last `ring` tokens of each sequence and their ring rows."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            if self.decode or self.graph_len:  # every token is among its sequence's last
                tok = torch.arange(self.num_tokens, device=self.positions.device)  # (q <= ring)
                return tok, self._tok("slot") * ring + self.positions.remainder(ring)
            tok = self._host_tokens(lambda start, n: range(max(0, n - ring), n))
            return tok, self._tok("slot")[tok] * ring + self.positions[tok].remainder(ring)

        return self._memo(("ring", ring), build)

    def closing_windows(self, ratio: int, overlap: bool) -> tuple[torch.Tensor, ...]:
        """Windows closed by a token of this step: (token, entry w, pool row of w, source rows [n, slots]).

        Window w closes at token m*w + m - 1. Its slots are tokens m*w-m .. m*w+m-1 (CSA: the first m
        give their A-half, the last m their B-half) or m*w .. m*w+m-1 (HCA), as ring | chunk rows.
        """

        def build() -> tuple[torch.Tensor, ...]:
            if self.graph_len:  # every token, the windows that stay open stored nowhere
                tok = torch.arange(self.num_tokens, device=self.positions.device)
            else:  # positions p = start + i with (p + 1) % ratio == 0: i = first, +ratio, ...
                tok = self._host_tokens(lambda start, n: range((-start - 1) % ratio, n, ratio))
            w = self.positions[tok] // ratio
            n_slots, first = (2 * ratio, ratio * w - ratio) if overlap else (ratio, ratio * w)
            pos = first[:, None] + torch.arange(n_slots, device=tok.device)
            ring = 2 * ratio if overlap else ratio
            rows = self.history_rows(pos, tok[:, None].expand_as(pos), ring)
            dest = self.entry_rows(self.token_seq[tok], w, ratio)
            if self.graph_len:
                dest = torch.where((self.positions + 1).remainder(ratio) == 0, dest, -1)
            return tok, w, dest, rows

        return self._memo(("close", ratio, overlap), build)

    def entry_idxs(self, ratio: int, base: int) -> torch.Tensor:
        """[T, C + 1] key rows of the compressed entries each token may see: their pool rows offset
        by `base` (the key rows before the entries), -1 = not visible, then a column of -1. Every
        compressed layer of a ratio shares it (the same page layout): built once per step."""

        def build() -> torch.Tensor:
            rows, _ = self.visible_entries(ratio)
            none = torch.full_like(rows[:, :1], -1)
            return torch.cat([torch.where(rows >= 0, rows + base, -1), none], dim=1)

        return self._memo(("entries", ratio, base), build)

    def attention_idxs(self, window: int, ratio: int, base: int) -> torch.Tensor:
        """[T, W + C] key rows of an HCA layer: each token's window rows (ring-only at decode), then
        all its visible compressed entries (`entry_idxs`). Shared by every HCA layer of a step."""

        def build() -> torch.Tensor:
            win = self.window_idxs(window, ring_only=self.decode)
            return torch.cat([win, self.entry_idxs(ratio, base)[:, :-1]], dim=1)

        return self._memo(("attn", window, ratio, base), build)

    def selected_idxs(self, window: int, ratio: int, base: int, ent: torch.Tensor) -> torch.Tensor:
        """[T, W + k] key rows of a CSA layer: the window rows, then the rows of the entries its
        indexer picked (`ent` [T, k]: positions in `visible_entries`, -1 = none) taken from
        `entry_idxs`; -1 picks its last column (ent mod C+1): one remainder, gather and cat."""
        win = self.window_idxs(window, ring_only=self.decode)
        if self.sliced(ratio):  # no whole table: the picks' own rows
            rows = self.entry_rows(self.token_seq[:, None].expand_as(ent), ent, ratio)
            return torch.cat([win, torch.where(rows >= 0, rows + base, -1)], dim=1)
        t = self.entry_idxs(ratio, base)
        if decode_lists.FUSED and ent.is_cuda:  # one launch (ops.decode_lists)
            return decode_lists.selected_rows(win, t, ent)
        picked = t.gather(1, ent.remainder(t.shape[1]))
        return torch.cat([win, picked], dim=1)

    def short_step(self, ring: int, step_rows: int) -> bool:
        """A step of several tokens per sequence whose tokens fit `step_rows` rows and each
        sequence's fit its ring (a speculative verify step): its compressors put the step's own
        rows in the state's step rows (fixed addresses for CUDA graphs) instead of fresh ones."""
        if self.decode or self.num_tokens > step_rows:
            return False
        return bool(self.graph_len) or max(n for _, n in self.host_seqs) <= ring

    def close_rows(self, ratio: int, overlap: bool) -> torch.Tensor:
        """A chunk's or verify step's `closing_windows` slot rows (ring | the step's own rows),
        read as [rows * c, d] like `closing_ring_rows`: with overlap slots 0..m-1 take the A-half
        of their row, slots m..2m-1 the B-half; -1 stays."""

        def build() -> torch.Tensor:
            rows = self.closing_windows(ratio, overlap)[3]
            if not overlap:
                return rows
            half = torch.arange(rows.shape[-1], device=rows.device) // ratio
            return torch.where(rows >= 0, 2 * rows + half, -1)

        return self._memo(("close_rows", ratio, overlap), build)

    def snapshot_writes(self, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, rows): the tokens of this step that snapshot i at position `at` holds in a
        ring of `ring` rows (positions at - ring .. at - 1) and their rows there."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            first = [0, *itertools.accumulate(n for _, n in self.host_seqs)]
            tok, rows = [], []
            for j, at, i in self.snapshots:
                start = self.host_seqs[j][0]
                for p in range(max(at - ring, start), at):
                    tok.append(first[j] + p - start)
                    rows.append(i * ring + p % ring)
            dev = self.positions.device
            return torch.tensor(tok, dtype=torch.long, device=dev), torch.tensor(
                rows, dtype=torch.long, device=dev
            )

        return self._memo(("snapshot", ring), build)

    def snapshot_keep_rows(self, ring: int) -> torch.Tensor:
        """[T] each token's row in its snapshot (`snapshot_writes`), -1 for the others."""
        return self._memo(
            ("snapshot_keep", ring), lambda: self._row_per_token(*self.snapshot_writes(ring))
        )

    def token_rows(self) -> torch.Tensor:
        """[T] 0 .. T-1: each token's row among the step's own rows."""
        return self._memo(
            ("token_rows",), lambda: torch.arange(self.num_tokens, device=self.positions.device)
        )

    def keep_rows(self, ring: int) -> torch.Tensor:
        """[T] the ring row of each token `ring_writes` keeps (its sequence's last `ring`), -1
        for the others."""

        return self._memo(("keep_rows", ring), lambda: self._row_per_token(*self.ring_writes(ring)))

    def _row_per_token(self, tok: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # (tokens, their rows) -> [T] each token's row, -1 for the tokens not listed
        keep = torch.full((self.num_tokens,), -1, dtype=torch.long, device=rows.device)
        return keep.index_copy(0, tok, rows.long())

    def closing_ring_rows(self, ratio: int, overlap: bool) -> torch.Tensor:
        """Decode: the slots of `closing_windows` in the compressor ring, where all of them are once
        this step's token is stored (a window closing at p spans p-R+1 .. p, R the ring). The ring
        [S*R, c*d] is read as [S*R*c, d]: with overlap (c = 2) slots 0..m-1 take the A-half of
        their row, slots m..2m-1 the B-half. -> rows [n, slots] (positions before the sequence:
        -1)."""

        def build() -> torch.Tensor:
            tok, w, _, _ = self.closing_windows(ratio, overlap)
            n_slots, first = (2 * ratio, ratio * w - ratio) if overlap else (ratio, ratio * w)
            j = torch.arange(n_slots, device=tok.device)
            pos = first[:, None] + j
            rows = self._tok("slot")[tok][:, None] * n_slots + pos.remainder(n_slots)
            if overlap:
                rows = 2 * rows + j // ratio
            return torch.where(pos >= 0, rows, -1)

        assert self.decode, "ring rows of closing windows need a decode step"
        return self._memo(("close_ring", ratio, overlap), build)

    def entry_rows(self, seq: torch.Tensor, w: torch.Tensor, ratio: int) -> torch.Tensor:
        """Rows of compressed entries w (of sequences `seq`, same shape) in the paged pool; w<0 -> -1."""
        epb = self.block_size // ratio
        blk = (w.clamp(min=0) // epb).clamp(max=self.block_table.shape[1] - 1)
        page = self.block_table[seq, blk]
        return torch.where((w >= 0) & (page >= 0), page * epb + w.remainder(epb), -1)

    def visible_entries(self, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, C] rows of the compressed entries each token may see, -1 = not yet; [T] counts).

        Entry w is visible to position p iff m*w + m - 1 <= p, i.e. w < (p+1) // m.
        """

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            count = self._entry_counts(ratio, 0, self.num_tokens)
            w = torch.arange(self.entry_width(ratio), device=count.device)[None, :]
            w = torch.where(w < count[:, None], w, -1)
            return self.entry_rows(self.token_seq[:, None].expand_as(w), w, ratio), count

        return self._memo(("vis", ratio), build)

    def entry_width(self, ratio: int) -> int:
        """C of `visible_entries`: every entry a token of the step may see (a static step: all
        its positions bound allows; an eager step: rounded up to ENTRY_ALIGN)."""
        # positions < bound: count.max() itself, or for a static step all it can be
        bound = self.graph_len or max(st + n for st, n in self.host_seqs)
        C = max(bound // ratio, 1)
        if not self.graph_len:  # an eager step's width takes every value: a multiple of 16
            C = cdiv(C, ENTRY_ALIGN) * ENTRY_ALIGN
        return C

    def sliced(self, ratio: int) -> bool:
        """Whether the step never builds its [tokens x visible entries] tables of that compressed
        kind whole: an eager step whose table would pass ENTRY_TABLE_ELEMENTS. (A static
        (CUDA-graph) step always builds them: its lists keep their shapes; at most max_seqs
        tokens.)"""
        if self.graph_len:
            return False
        return self.num_tokens * self.entry_width(ratio) > ENTRY_TABLE_ELEMENTS

    def index_slices(self, ratio: int) -> list[tuple[int, int]]:
        """Token ranges the indexer scores at a time: the whole step, or for a sliced step each
        sequence's tokens in slices of at most INDEX_SLICE_ELEMENTS // C (>= 1)."""
        if not self.sliced(ratio):
            return [(0, self.num_tokens)]
        step, out, t0 = max(1, INDEX_SLICE_ELEMENTS // self.entry_width(ratio)), [], 0
        for _, n in self.host_seqs:
            out += [(t, min(t + step, t0 + n)) for t in range(t0, t0 + n, step)]
            t0 += n
        return out

    def index_rows(self, ratio: int, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The indexer's candidates for an `index_slices` range: the whole step's
        (`visible_entries`, None), or for a slice of one sequence's tokens that sequence's rows as
        one list expanded to [t1 - t0, C] (stride 0: no table) and the tokens' counts
        (`index_topk`'s counts: token t sees its first counts[t] entries)."""
        if not self.sliced(ratio):
            return self.visible_entries(ratio)[0], None
        assert self.one_sequence(t0, t1), f"tokens {t0}..{t1} are not one sequence's"

        def build() -> tuple[torch.Tensor, torch.Tensor]:  # (once a step: every CSA layer asks)
            C = self.entry_width(ratio)
            w = torch.arange(C, device=self.positions.device)[None, :]
            rows = self.entry_rows(self.token_seq[t0 : t0 + 1, None].expand(1, C), w, ratio)
            return rows.expand(t1 - t0, C), self._entry_counts(ratio, t0, t1)

        return self._memo(("index_rows", ratio, t0, t1), build)

    def _entry_counts(self, ratio: int, t0: int, t1: int) -> torch.Tensor:
        # [t1 - t0] entries each token may see: entry w is visible to position p iff w < (p+1) // m
        return (self.positions[t0:t1] + 1) // ratio

    def one_sequence(self, t0: int, t1: int) -> bool:
        """Whether tokens t0 .. t1 - 1 of an eager step are all of one sequence (whose visible
        entries are then one list's prefixes, growing with the position)."""
        if self.graph_len:
            return False
        end = 0
        for _, n in self.host_seqs:
            end += n
            if t0 < end:
                return t1 <= end
        return False
