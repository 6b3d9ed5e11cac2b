"""The indexer's unsorted top-k for Hopper (sm_90) in Gluon: a radix select with shared-memory counts.

  select(skey, out) -> None   (score keys [T, C] int32 of `indexer._scores`, INT32_MIN = not
  visible -> out [T, K] int64 positions: the same set as `indexer.index_topk(..., sort=False)`)

Why a second select: the Triton hist select needs every key counted into global histograms by
the score kernel (one L2 atomic a key, ~4.5 us at T=16, 128K) and then a chain of programs that
merge through L2 atomics (~8 us after the scores). Triton has no shared-memory atomics. Here one
program (CTA) takes a whole row, and `red.shared.add` (inline PTX on a shared buffer the kernel
allocates) counts its keys into 65536 bins of the keys' top 16 bits, two 16-bit counts a word
(so rows are shorter than 65536 keys). Then, all inside the program:
  1. the bin b of the K-th largest key (a scan over the counts);
  2. the keys above b (winners) go to out in position order, the keys in b (candidates) to a
     scratch list in position order, packed as (key << 32 | C-1-pos);
  3. the candidates are ranked against each other (distinct packed values: higher key, then lower
     position) and the best K - winners follow the winners in descending order.
A bin holding more than CAND candidates (many equal or close scores) is refined once more by the
keys' low 16 bits the same way; then the keys left tied are equal and the lower positions win.
The output order is the Triton hist select's: winners by position, then the bin's picks by
descending score.

The PTX addresses a word of the counts as `global_smem` (the kernel's shared memory) plus OFFSET
plus 4 * word. OFFSET is where Triton 3.6's allocator puts the kernel's one explicit buffer (0, in
its PTX for sm_90a). Each program checks it: the winners and candidates it files from the keys
must number what the counts said, else it traps (a CUDA error, never a wrong top-k).

No CPU path: Gluon has no interpreter. Tested on the GPU against the reference top-k
(tests/ops/test_indexer.py).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dsv4.ops.device import chain_start, is_sm90

INT32_MIN = gl.constexpr(-(2**31))
INT64_MIN = gl.constexpr(-(2**63))
WORDS = gl.constexpr(32768)  # 65536 bins of 16 bits, two to a 32-bit word
MAX_C = 65535  # a bin's 16-bit count holds any row of at most this many keys
CAND = 128  # candidates of the threshold bin ranked at once; more take the refining pass
NUM_WARPS = 32
CHUNK = 32 * 32 * NUM_WARPS  # keys counted a step (32 a thread)
FILE = 8 * 32 * NUM_WARPS  # keys filed a step (8 a thread: fewer would spill)
OFFSET = 0  # where the allocator puts the counts (checked per compiled kernel)


@gluon.jit
def _add(a, b):  # noqa: ANN001, ANN202
    return a + b


@gluon.jit
def _count(bins, ok, OFF: gl.constexpr):  # noqa: ANN001, ANN202
    # counts[bins] += 1 for ok lanes: `red.shared.add.u32` on the word bins // 2, the low or high
    # half. Returns 0s (the asm needs an output)
    word_at = (bins >> 1) * 4 + OFF
    one = gl.where((bins & 1) != 0, 65536, 1)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a; setp.ne.s32 p, $3, 0; mov.u32 a, global_smem; "
        "add.u32 a, a, $1; @p red.shared.add.u32 [a], $2; mov.u32 $0, 0; }",
        "=r,r,r,r",
        [word_at, one, ok.to(gl.int32)],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _trap_unless(ok):  # noqa: ANN001, ANN202
    # abort the kernel (a CUDA error at the next synchronisation) unless ok
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.s32 p, $1, 0; @p trap; mov.u32 $0, 0; }",
        "=r,r",
        [ok.to(gl.int32)],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _threshold(counts, need, NT: gl.constexpr, NW: gl.constexpr):  # noqa: ANN001, ANN202
    # counts: the shared [NT, WORDS // NT] words ; need >= 1 -> (b, above, in_b): the highest bin b with at
    # least `need` counted keys at or above it (-1 when fewer are counted), the keys above b and
    # in b. Each thread reads WORDS // NT consecutive words
    WPT: gl.constexpr = WORDS // NT
    lay: gl.constexpr = gl.BlockedLayout([1, WPT], [32, 1], [NW, 1], [1, 0])
    w = counts.load(lay)
    lo = w & 0xFFFF
    hi = (w >> 16) & 0xFFFF
    tot = lo + hi
    # keys in the words after each word of the thread, then in the threads after the thread
    after_w = gl.associative_scan(tot, 1, _add, reverse=True) - tot
    row = gl.convert_layout(gl.sum(tot, 1), gl.BlockedLayout([1], [32], [NW], [0]))
    after_r = gl.associative_scan(row, 0, _add, reverse=True) - row
    after_r = gl.convert_layout(after_r, gl.SliceLayout(1, lay))  # (a scan needs a blocked layout)
    at_hi = after_r[:, None] + after_w + hi  # keys at or above the high bin of each word
    at_lo = at_hi + lo
    r = gl.arange(0, NT, layout=gl.SliceLayout(1, lay))
    j = gl.arange(0, WPT, layout=gl.SliceLayout(0, lay))
    bin_lo = 2 * (r[:, None] * WPT + j[None, :])
    b = gl.max(gl.max(gl.maximum(gl.where(at_hi >= need, bin_lo + 1, -1),
                                 gl.where(at_lo >= need, bin_lo, -1)), 1), 0)  # fmt: skip
    above = gl.where(bin_lo > b, lo, 0) + gl.where(bin_lo + 1 > b, hi, 0)
    in_b = gl.where(bin_lo == b, lo, 0) + gl.where(bin_lo + 1 == b, hi, 0)
    both = gl.sum(gl.sum(above.to(gl.int64) + (in_b.to(gl.int64) << 32), 1), 0)
    return b, (both & 0xFFFFFFFF).to(gl.int32), (both >> 32).to(gl.int32)


@gluon.jit
def _zero(counts, NT: gl.constexpr, NW: gl.constexpr):  # noqa: ANN001, ANN202
    WPT: gl.constexpr = WORDS // NT
    lay: gl.constexpr = gl.BlockedLayout([1, WPT], [32, 1], [NW, 1], [1, 0])
    counts.store(gl.zeros([NT, WPT], gl.int32, lay))


@gluon.jit
def _rank_store(list_ptr, n, need, out_row, base, C, LIM: gl.constexpr, NW: gl.constexpr):  # noqa: ANN001, ANN202
    # list_ptr[0 .. n): distinct packed values (n <= LIM) -> those of rank < need (0 = the
    # largest) as positions at out_row[base + rank]
    JB: gl.constexpr = 8
    lay: gl.constexpr = gl.BlockedLayout([1, JB], [32, 1], [NW, 1], [1, 0])
    offs_i = gl.arange(0, LIM, layout=gl.SliceLayout(1, lay))
    v = gl.load(list_ptr + offs_i, mask=offs_i < n, other=INT64_MIN, cache_modifier=".cg")
    rank = gl.zeros([LIM], gl.int32, gl.SliceLayout(1, lay))
    for j0 in range(0, n, JB):
        offs_j = j0 + gl.arange(0, JB, layout=gl.SliceLayout(0, lay))
        vj = gl.load(list_ptr + offs_j, mask=offs_j < n, other=INT64_MIN, cache_modifier=".cg")
        rank += gl.sum((vj[None, :] > v[:, None]).to(gl.int32), 1)
    pos = C - 1 - (v & 0xFFFFFFFF)
    gl.store(out_row + base + rank, pos, mask=(offs_i < n) & (rank < need))


@gluon.jit
def _select_kernel(
    key_ptr,  # [T, C] int32 score keys (INT32_MIN = not visible)
    out_ptr,  # [T, K] int64 positions
    cand_ptr,  # [T, C] int64 scratch: the threshold bin's candidates
    pick_ptr,  # [T, BLOCK_K] int64 scratch: the refined picks
    C,
    K,
    stride_kt,
    stride_ot,
    stride_ct,
    stride_pt,
    OFF: gl.constexpr,  # byte offset of the counts in shared memory (OFFSET, checked)
    CHUNK: gl.constexpr,  # keys counted a step
    FILE: gl.constexpr,  # keys filed a step
    BLOCK_K: gl.constexpr,
    CAND: gl.constexpr,
    PDL: gl.constexpr,
):
    # read C keys twice ; write K positions (+ the candidates, int64)
    NW: gl.constexpr = gl.num_warps()
    NT: gl.constexpr = 32 * NW
    t = gl.program_id(0).to(gl.int64)
    # the counts, row-major and unswizzled: word w at byte OFF + 4 w of shared memory
    counts = gl.allocate_shared_memory(
        gl.int32, [NT, WORDS // NT], gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    )
    _zero(counts, NT, NW)
    chain_start(PDL)
    gl.thread_barrier()

    lay: gl.constexpr = gl.BlockedLayout([4], [32], [NW], [0])
    key_row = key_ptr + t * stride_kt
    out_row = out_ptr + t * stride_ot
    cand_row = cand_ptr + t * stride_ct

    # ---- count every visible key into the bin of its top 16 bits (CHUNK keys a step: 32 a
    # thread in flight)
    offs = gl.arange(0, CHUNK, layout=lay)
    for c0 in range(0, C, CHUNK):
        key = gl.load(key_row + c0 + offs, mask=c0 + offs < C, other=INT32_MIN)
        _count((key.to(gl.uint32, bitcast=True) >> 16).to(gl.int32) ^ 0x8000, key != INT32_MIN,
               OFF)  # fmt: skip
    gl.thread_barrier()
    b, n_win, n_cand = _threshold(counts, K, NT, NW)

    # ---- winners (bins above b) to out, candidates (bin b) to the scratch list, position order
    # (FILE keys a step, the next step's keys loaded ahead)
    offs_f = gl.arange(0, FILE, layout=lay)
    base_w = C * 0
    base_c = C * 0
    key = gl.load(key_row + offs_f, mask=offs_f < C, other=INT32_MIN)
    for c0 in range(0, C, FILE):
        nxt = gl.load(key_row + FILE + c0 + offs_f, mask=FILE + c0 + offs_f < C, other=INT32_MIN)
        vis = key != INT32_MIN
        bin = (key.to(gl.uint32, bitcast=True) >> 16).to(gl.int32) ^ 0x8000
        win = (vis & (bin > b)).to(gl.int32)
        cand = (vis & (bin == b)).to(gl.int32)
        both = win + (cand << 16)  # one scan for both (FILE < 65536)
        before = gl.associative_scan(both, 0, _add) - both
        pos = c0 + offs_f
        gl.store(out_row + base_w + (before & 0xFFFF), pos.to(gl.int64), mask=win != 0)
        packed = (key.to(gl.int64) << 32) | (C - 1 - pos).to(gl.int64)
        gl.store(cand_row + base_c + (before >> 16), packed, mask=cand != 0)
        n = gl.sum(both, 0)
        base_w += n & 0xFFFF
        base_c += n >> 16
        key = nxt
    # the counts must have seen what the keys say (else the PTX's counts were not the buffer read)
    _trap_unless((base_w == n_win) & (base_c == n_cand))
    gl.thread_barrier()  # the candidates filed by every thread

    # ---- the candidates: the best K - n_win of them after the winners, by descending value
    need = K - n_win
    n_pick = gl.minimum(need, n_cand)
    if n_cand <= CAND:
        _rank_store(cand_row, n_cand, need, out_row, n_win, C, CAND, NW)
    else:  # a crowded bin: refine by the low 16 bits of the keys (all share the top 16)
        _zero(counts, NT, NW)
        gl.thread_barrier()
        for c0 in range(0, n_cand, FILE):
            ok = c0 + offs_f < n_cand
            v = gl.load(cand_row + c0 + offs_f, mask=ok, other=0, cache_modifier=".cg")
            _count(((v >> 32) & 0xFFFF).to(gl.int32), ok, OFF)
        gl.thread_barrier()
        b2, n_win2, n_tie = _threshold(counts, need, NT, NW)
        # the need picks: every candidate above b2, then the first ties (equal keys: the lower
        # positions, filed first), into pick_ptr in filing order
        pick_row = pick_ptr + t * stride_pt
        base_p = C * 0
        base_t = C * 0
        for c0 in range(0, n_cand, FILE):
            ok = c0 + offs_f < n_cand
            v = gl.load(cand_row + c0 + offs_f, mask=ok, other=0, cache_modifier=".cg")
            low = ((v >> 32) & 0xFFFF).to(gl.int32)
            tie = (ok & (low == b2)).to(gl.int32)
            tie_before = base_t + gl.associative_scan(tie, 0, _add) - tie
            sel = ((ok & (low > b2)) | ((tie != 0) & (tie_before < need - n_win2))).to(gl.int32)
            gl.store(pick_row + base_p + gl.associative_scan(sel, 0, _add) - sel, v, mask=sel != 0)
            base_p += gl.sum(sel, 0)
            base_t += gl.sum(tie, 0)
        gl.thread_barrier()
        _rank_store(pick_row, need, need, out_row, n_win, C, BLOCK_K, NW)

    # ---- slots past the winners and picks: -1
    offs_k = gl.arange(0, BLOCK_K, layout=lay)
    n_out = n_win + gl.where(b >= 0, n_pick, 0)
    gl.store(out_row + offs_k, gl.full([BLOCK_K], -1, gl.int64, lay),
             mask=(offs_k >= n_out) & (offs_k < K))  # fmt: skip


def supported(C: int, K: int) -> bool:
    """Rows this select takes (on an sm_90 GPU): shorter than MAX_C keys, K <= 1024."""
    return C <= MAX_C and 1 <= K <= 1024


def select(skey: torch.Tensor, out: torch.Tensor, pdl: bool, early: bool = False) -> None:
    """Score keys [T, C] int32 -> out [T, K] int64: the K largest keys' positions (ties: the lower
    position), winners above the threshold bin in position order, then its picks by descending
    key, then -1 (fewer than K visible). One program a row; `pdl`: chained (PDL constexpr),
    `early`: launched while the score kernel runs."""
    (T, C), K = skey.shape, out.shape[1]
    assert skey.is_cuda and is_sm90(skey.device), "topk_sm90: an sm_90 GPU"
    assert supported(C, K), f"topk_sm90: C={C} (<= {MAX_C}), K={K} (1..1024)"
    assert skey.dtype == torch.int32 and skey.stride(1) == 1 and out.stride(1) == 1
    block_k = max(16, triton.next_power_of_2(K))
    cand = torch.empty(T, C, dtype=torch.int64, device=skey.device)
    pick = torch.empty(T, block_k, dtype=torch.int64, device=skey.device)
    _select_kernel[(T,)](
        skey, out, cand, pick, C, K,
        skey.stride(0), out.stride(0), cand.stride(0), pick.stride(0),
        OFF=OFFSET,
        CHUNK=CHUNK,
        FILE=FILE,
        BLOCK_K=block_k,
        CAND=CAND,
        PDL=pdl,
        launch_pdl=early,
        num_warps=NUM_WARPS,
    )  # fmt: skip
