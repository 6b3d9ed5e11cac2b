"""Triton rotary / norm_rope / compress_store / compress_keep against the torch references in
dsv4.ops.ref."""

from __future__ import annotations

import pytest
import torch

from dsv4.ops import ref, rope

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative-norm error against an fp32 reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _angles(T: int, rd: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(T, rd // 2, device=device) * 12.0 - 6.0
    return ang.cos(), ang.sin()


# (T, heads or None for [T, d], d, rd): rd < d with odd-sized NoPE blocks, and rd == d
ROW_SHAPES = [(1, None, 16, 8), (5, None, 64, 16), (1, 3, 16, 16), (5, 3, 40, 8), (5, 1, 64, 16)]


def _x(T: int, H: int | None, d: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (T, d) if H is None else (T, H, d)
    return (torch.randn(shape) * 3.0).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("T,H,d,rd", ROW_SHAPES)
def test_rotary(T: int, H: int | None, d: int, rd: int, inverse: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = _x(T, H, d, dtype)
    cos, sin = _angles(T, rd)
    y = rope.rotary(x, cos, sin, inverse=inverse)
    assert y.shape == x.shape and y.dtype == x.dtype
    want = ref.rotary(x.float(), cos, sin, inverse=inverse)
    assert _rel(y, want) < TOL[dtype]
    assert torch.equal(y[..., : d - rd], x[..., : d - rd])  # NoPE channels pass through bit-exact
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref.rotary(x, cos, sin, inverse=inverse))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("T,H,d,rd", ROW_SHAPES)
def test_norm_rope(
    T: int, H: int | None, d: int, rd: int, weighted: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(1)
    x = _x(T, H, d, dtype)
    w = torch.rand(d) + 0.5 if weighted else None
    cos, sin = _angles(T, rd)
    y = rope.norm_rope(x, w, 1e-6, cos, sin)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert _rel(y, ref.norm_rope(x.float(), w, 1e-6, cos, sin)) < TOL[dtype]
    assert _rel(y, ref.norm_rope(x, w, 1e-6, cos, sin)) < TOL[dtype]


@pytest.mark.parametrize("block_r", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_store(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, block_r: int) -> None:
    # the window ring write of a decode step in the same launch: dst[rows[t]] = out[t], every
    # other row of dst untouched; the same bits as the reference's index_put
    monkeypatch.setattr(rope, "_rows_config", lambda n_rows, block_d, programs=528: (block_r, 2))
    torch.manual_seed(9)
    T, d = 5, 40
    x = _x(T, None, d, dtype)
    w = torch.rand(d) + 0.5
    cos, sin = _angles(T, 8)
    rows = torch.tensor([7, 0, 12, 3, 9])
    dst = torch.randn(16, d).to(dtype)
    want_dst = dst.clone()
    want = ref.norm_rope(x, w, 1e-6, cos, sin, store=(want_dst, rows))
    y = rope.norm_rope(x, w, 1e-6, cos, sin, store=(dst, rows.int()))
    assert _rel(y, want) < TOL[dtype]
    torch.testing.assert_close(dst[rows], y)  # the copy is the output, bit for bit
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(dst[untouched], want_dst[untouched])
    with pytest.raises(AssertionError, match="store takes x as"):
        rope.norm_rope(x[:, None], w, 1e-6, cos, sin, store=(dst, rows))


@pytest.mark.parametrize("entries", [False, True])
@pytest.mark.parametrize("block_r", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_qkv(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, block_r: int, entries: bool
) -> None:
    # the queries and the window K=V in one launch: the same bits as the two norm_ropes (q per
    # head, no weight; kv weighted, a strided slice, with the ring store or FP8 entries), and
    # close to the reference (on a GPU kv's rows may run on other warps than norm_rope(kv)'s, so
    # test_gpu_flash_rows holds kv to the reference's tolerance)
    monkeypatch.setattr(rope, "_rows_config", lambda n_rows, block_d, programs=528: (block_r, 2))
    if entries and dtype != torch.bfloat16:
        pytest.skip("FP8 entries hold bf16 activations")
    torch.manual_seed(4)
    T, H, d, rd = 5, 3, 64, 16
    q = _x(T, H, d, dtype)
    kv = (torch.randn(T, 2 * d) * 3.0).to(dtype)[:, d:]  # a slice of a joined projection
    w = torch.rand(d) + 0.5
    cos, sin = _angles(T, rd)
    rows = torch.tensor([7, 0, 12, 3, 9])
    if entries:
        from dsv4.quant import kv_entry_layout

        dst = torch.zeros(16, kv_entry_layout(d, rd)[2], dtype=torch.uint8)
    else:
        dst = torch.randn(16, d).to(dtype)
    dst2 = dst.clone()
    gq, gkv = rope.norm_rope_qkv(q, kv, w, 1e-6, cos, sin, store=(dst, rows))
    assert torch.equal(gq, rope.norm_rope(q, None, 1e-6, cos, sin))
    assert torch.equal(gkv, rope.norm_rope(kv, w, 1e-6, cos, sin, store=(dst2, rows)))
    assert torch.equal(dst, dst2)
    wq, wkv = ref.norm_rope_qkv(q, kv, w, 1e-6, cos, sin)
    assert _rel(gq, wq) < TOL[dtype] and _rel(gkv, wkv) < TOL[dtype]
    nq, nkv = rope.norm_rope_qkv(q, kv, w, 1e-6, cos, sin)  # no store
    assert torch.equal(nq, gq) and torch.equal(nkv, gkv)
    with pytest.raises(AssertionError, match="kv must be"):
        rope.norm_rope_qkv(q, kv[:, :32], w, 1e-6, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_row_tiles(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    # large inputs take BLOCK_R > 1 rows per program; force it at a tiny shape with a ragged last tile
    monkeypatch.setattr(rope, "_rows_config", lambda n_rows, block_d, programs=528: (4, 2))
    torch.manual_seed(8)
    x = _x(5, 3, 40, dtype)  # 15 rows -> tiles of 4, 4, 4, 3
    w = torch.rand(40) + 0.5
    cos, sin = _angles(5, 8)
    assert (
        _rel(rope.norm_rope(x, w, 1e-6, cos, sin), ref.norm_rope(x.float(), w, 1e-6, cos, sin))
        < (TOL[dtype])
    )
    y = rope.rotary(x, cos, sin, inverse=True)
    assert _rel(y, ref.rotary(x.float(), cos, sin, inverse=True)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 40), (2, 5, 48), (7, 100)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(shape: tuple[int, ...], weighted: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(9)
    x = (torch.randn(shape) * 3.0).to(dtype)
    w = torch.rand(shape[-1]) + 0.5 if weighted else None
    y = rope.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype
    want = ref.rms_norm(x, w, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    else:  # the same fp32 value rounded once: equal but for a rare one-ulp tie
        assert (y.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
        assert _rel(y, ref.rms_norm(x.float(), w, 1e-6)) < TOL[dtype]


def test_rms_norm_multi_row_tiles_and_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rope, "_rows_config", lambda n_rows, block_d, programs=528: (4, 2))
    x = torch.randn(11, 24)  # tiles of 4, 4, 3 rows
    w = torch.rand(24) + 0.5
    torch.testing.assert_close(rope.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    with pytest.raises(AssertionError, match="weight must be a contiguous"):
        rope.rms_norm(x, w[:12], 1e-5)
    assert rope.rms_norm(x[:0], w, 1e-5).shape == (0, 24)


def test_inverse_undoes_forward() -> None:
    torch.manual_seed(2)
    x = _x(5, 3, 64, torch.float32)
    cos, sin = _angles(5, 16)
    back = rope.rotary(rope.rotary(x, cos, sin), cos, sin, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rope.rotary(x, cos, sin), x)  # the forward did rotate


def test_strided_heads_and_eps() -> None:
    # x: a [T, H, d] view with padded head stride; a large eps must change the result like ref's
    torch.manual_seed(3)
    big = torch.randn(5, 3, 48)
    x = big[:, :, :40]
    cos, sin = _angles(5, 8)
    for eps in (1e-6, 4.0):
        torch.testing.assert_close(
            rope.norm_rope(x, None, eps, cos, sin), ref.norm_rope(x, None, eps, cos, sin)
        )
    torch.testing.assert_close(rope.rotary(x, cos, sin), ref.rotary(x, cos, sin))


def test_empty_tokens() -> None:
    x = torch.randn(0, 3, 16)
    cos, sin = _angles(0, 8)
    assert rope.rotary(x, cos, sin).shape == x.shape
    assert rope.norm_rope(x, None, 1e-6, cos, sin).shape == x.shape


def _windows(n: int, slots: int, d: int, empty_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    # kv, score: [n, slots, d] fp32; window 0 has its first `empty_slots` slots empty (-inf, kv 0),
    # and about 1 in 5 of the other scores is -inf
    kv = torch.randn(n, slots, d) * 2.0
    score = torch.randn(n, slots, d) * 3.0
    score = score.masked_fill(torch.rand(n, slots, d) < 0.2, float("-inf"))
    score[:, -1] = torch.randn(n, d)  # at least one live slot per channel
    score[0, :empty_slots] = float("-inf")
    kv[0, :empty_slots] = 0.0
    return kv, score


# (n windows, slots, d, rd)
COMPRESS_SHAPES = [(1, 8, 16, 8), (3, 8, 40, 16), (4, 16, 64, 16), (2, 128, 16, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,slots,d,rd", COMPRESS_SHAPES)
def test_compress_store(n: int, slots: int, d: int, rd: int, dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    kv, score = _windows(n, slots, d, empty_slots=slots // 2)
    w = torch.rand(d) + 0.5
    cos, sin = _angles(n, rd)
    rows = 23
    before = torch.randn(rows, d).to(dtype)
    dest = torch.randperm(rows)[:n]
    out = before.clone()
    assert rope.compress_store(kv, score, w, 1e-6, cos, sin, out, dest) is None
    want = before.float().clone()
    ref.compress_store(kv, score, w, 1e-6, cos, sin, want, dest)
    assert _rel(out[dest], want[dest]) < TOL[dtype]
    keep = torch.ones(rows, dtype=torch.bool)
    keep[dest] = False
    assert torch.equal(out[keep], before[keep])  # rows not in dest are untouched
    same = before.clone()
    ref.compress_store(kv, score, w, 1e-6, cos, sin, same, dest)  # ref at the store dtype
    assert _rel(out[dest], same[dest]) < TOL[dtype]
    # dest -1: that window is not stored (both backends), the others are as before
    skip = dest.clone()
    skip[::2] = -1
    for impl in (rope, ref):
        o = before.clone()
        impl.compress_store(kv, score, w, 1e-6, cos, sin, o, skip)
        kept = skip[skip >= 0]
        assert torch.equal(o[kept], out[kept] if impl is rope else same[kept])
        untouched = torch.ones(rows, dtype=torch.bool)
        untouched[kept] = False
        assert torch.equal(o[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_store_gathers_rows(dtype: torch.dtype) -> None:
    # the row form (what decode uses): slot s of window i is row rows[i, s] of [N, d] sources,
    # -1 an empty slot whatever the source row holds; equal to the dense form of the same slots,
    # and a window with dest -1 is neither pooled nor stored
    torch.manual_seed(6)
    n, slots, d, rd, N = 4, 8, 40, 16, 50
    src_kv, src_score = torch.randn(N, d) * 2.0, torch.randn(N, d) * 3.0
    src_kv[0], src_score[0] = float("nan"), float("inf")  # what a -1 slot would read if it read
    rows = torch.randint(1, N, (n, slots))
    rows[0, :3] = -1
    rows[2, 5] = -1
    empty = (rows < 0)[..., None]
    kv = src_kv[rows.clamp(min=0)].masked_fill(empty, 0.0)
    score = src_score[rows.clamp(min=0)].masked_fill(empty, float("-inf"))
    w = torch.rand(d) + 0.5
    cos, sin = _angles(n, rd)
    dest = torch.tensor([3, -1, 9, 0])
    before = torch.randn(12, d).to(dtype)
    dense, gathered, want = before.clone(), before.clone(), before.clone()
    rope.compress_store(kv, score, w, 1e-6, cos, sin, dense, dest)
    rope.compress_store(src_kv, src_score, w, 1e-6, cos, sin, gathered, dest, rows=rows)
    ref.compress_store(src_kv, src_score, w, 1e-6, cos, sin, want, dest, rows=rows)
    assert torch.equal(gathered, dense)
    assert _rel(gathered, want) < TOL[dtype]
    assert torch.equal(gathered[[1, 2, 4]], before[[1, 2, 4]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_store_reads_a_second_source(dtype: torch.dtype) -> None:
    # prefill: rows N.. are the chunk's own projections (a second source), the rows below N the
    # ring; the same bits as one source holding both, and the reference
    torch.manual_seed(8)
    n, slots, d, rd, N, M = 5, 8, 40, 16, 30, 20
    src_kv, src_score = torch.randn(N + M, d) * 2.0, torch.randn(N + M, d) * 3.0
    rows = torch.randint(0, N + M, (n, slots))
    rows[0, :3] = -1
    rows[1] = torch.arange(N, N + slots)  # a window all in the chunk
    rows[2] = torch.arange(slots)  # one all in the ring
    w = torch.rand(d) + 0.5
    cos, sin = _angles(n, rd)
    dest = torch.tensor([3, 7, 9, 0, 5])
    before = torch.randn(12, d).to(dtype)
    one, two, want = before.clone(), before.clone(), before.clone()
    ring, chunk = (src_kv[:N], src_score[:N]), (src_kv[N:], src_score[N:])
    rope.compress_store(src_kv, src_score, w, 1e-6, cos, sin, one, dest, rows=rows)
    rope.compress_store(*ring, w, 1e-6, cos, sin, two, dest, rows=rows, chunk=chunk)
    ref.compress_store(*ring, w, 1e-6, cos, sin, want, dest, rows=rows, chunk=chunk)
    assert torch.equal(two, one)
    assert _rel(two, want) < TOL[dtype]
    with pytest.raises(AssertionError, match="needs rows"):
        rope.compress_store(src_kv.view(-1, 2, d), src_score.view(-1, 2, d), w, 1e-6, cos, sin,
                            two, dest, chunk=chunk)  # fmt: skip


def test_compress_store_many_slot_chunks() -> None:
    # slots > one chunk (BLOCK_S = 256 at d = 64): the online softmax crosses chunks, and some
    # channels are empty for a whole chunk; unweighted norm and int32 dest
    torch.manual_seed(5)
    n, slots, d, rd = 2, 520, 64, 16
    kv, score = _windows(n, slots, d, empty_slots=300)
    score[1, :, :7] = float("-inf")
    score[1, 513, :7] = 0.5  # channels 0..6 of window 1: one live slot in the last chunk
    cos, sin = _angles(n, rd)
    out = torch.zeros(10, d)
    dest = torch.tensor([7, 2], dtype=torch.int32)
    rope.compress_store(kv, score, None, 1e-6, cos, sin, out, dest)
    want = torch.zeros(10, d)
    ref.compress_store(kv, score, None, 1e-6, cos, sin, want, dest.long())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_compress_store_no_windows() -> None:
    out = torch.randn(4, 16)
    before = out.clone()
    cos, sin = _angles(0, 8)
    empty = torch.empty(0, 8, 16)
    rope.compress_store(empty, empty, None, 1e-6, cos, sin, out, torch.empty(0, dtype=torch.long))
    assert torch.equal(out, before)


def _keep_case(T: int, n: int, ratio: int, N: int, dtype: torch.dtype, device: str = "cpu"):  # noqa: ANN202
    # kv | gate as column slices of one joined GEMM output, distinct rows (one -1), any positions
    y = (torch.randn(T, 2 * n, device=device) * 3.0).to(dtype)
    ape = torch.randn(ratio, n, device=device)
    positions = torch.randint(0, 10_000, (T,), device=device)
    rows = torch.randperm(N, device=device)[:T]
    if T > 2:
        rows[1] = -1
    states = [torch.randn(N, n, device=device) for _ in range(2)]
    return y[:, :n], y[:, n:], ape, positions, ratio, *states, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,n,ratio", [(1, 16, 4), (5, 40, 8), (3, 1100, 4)])
def test_compress_keep(T: int, n: int, ratio: int, dtype: torch.dtype) -> None:
    # the decode step's ring write: exact (a cast and one fp32 add), other rows untouched
    torch.manual_seed(11)
    kv, gate, ape, pos, m, kv_state, score_state, rows = _keep_case(T, n, ratio, 50, dtype)
    want_kv, want_score = kv_state.clone(), score_state.clone()
    ok = rows >= 0
    ref.compress_keep(kv[ok], gate[ok], ape, pos[ok], m, want_kv, want_score, rows[ok])
    rope.compress_keep(kv, gate, ape, pos, m, kv_state, score_state, rows)
    assert torch.equal(kv_state, want_kv) and torch.equal(score_state, want_score)
    assert not torch.equal(score_state[rows[0]], gate[0].float())  # ape was added


def test_compress_keep_checks() -> None:
    kv, gate, ape, pos, m, kv_state, score_state, rows = _keep_case(3, 16, 4, 10, torch.float32)
    with pytest.raises(AssertionError, match="ape must be"):
        rope.compress_keep(kv, gate, ape[:2], pos, m, kv_state, score_state, rows)
    with pytest.raises(AssertionError, match="score_state must be"):
        rope.compress_keep(kv, gate, ape, pos, m, kv_state, score_state.double(), rows)
    with pytest.raises(AssertionError, match="rows must be"):
        rope.compress_keep(kv, gate, ape, pos, m, kv_state, score_state, rows[:2])


# ---- GPU: real Flash shapes (H = 64, head_dim 512, rd 64; indexer d 128; CSA 8 slots, HCA 128)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 301])
def test_gpu_flash_rows(T: int) -> None:
    torch.manual_seed(6)
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(T, 64, 512, device=dev).to(bf)
    kv = torch.randn(T, 512, device=dev).to(bf)
    iq = torch.randn(T, 64, 128, device=dev).to(bf)
    w = torch.rand(512, device=dev) + 0.5
    cos, sin = _angles(T, 64, dev)
    assert (
        _rel(rope.norm_rope(q, None, 1e-6, cos, sin), ref.norm_rope(q, None, 1e-6, cos, sin)) < 5e-3
    )
    assert _rel(rope.norm_rope(kv, w, 1e-6, cos, sin), ref.norm_rope(kv, w, 1e-6, cos, sin)) < 5e-3
    ring = torch.zeros(T + 3, 512, device=dev, dtype=bf)
    rows = torch.randperm(T + 3, device=dev)[:T]
    got_q, got_kv = rope.norm_rope_qkv(q, kv, w, 1e-6, cos, sin, store=(ring, rows))
    assert torch.equal(got_q, rope.norm_rope(q, None, 1e-6, cos, sin))  # one launch, same bits
    # kv's rows run on the queries' warps: the sum of squares may round differently from
    # norm_rope(kv) alone (T=301: 4 warps against 2)
    assert _rel(got_kv, ref.norm_rope(kv, w, 1e-6, cos, sin)) < 5e-3
    assert torch.equal(ring[rows], got_kv)
    assert _rel(rope.rotary(iq, cos, sin), ref.rotary(iq, cos, sin)) < 5e-3
    o = rope.rotary(q, cos, sin, inverse=True)
    assert _rel(o, ref.rotary(q, cos, sin, inverse=True)) < 5e-3
    assert torch.equal(o[..., :448], q[..., :448])
    qf = q.float()
    torch.testing.assert_close(
        rope.rotary(rope.rotary(qf, cos, sin), cos, sin, inverse=True), qf, rtol=1e-5, atol=1e-5
    )


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 512])
@pytest.mark.parametrize("d", [4096, 1024, 512])
def test_gpu_rms_norm(T: int, d: int) -> None:
    # the block norms (4096), q_norm (q_lora_rank 1024), the compressor's and kv norms (512)
    torch.manual_seed(10)
    x = (torch.randn(T, d, device="cuda") * 3.0).to(torch.bfloat16)
    w = torch.rand(d, device="cuda") + 0.5
    want = ref.rms_norm(x, w, 1e-6)
    y = rope.rms_norm(x, w, 1e-6)
    assert (y.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    assert _rel(y, ref.rms_norm(x.float(), w, 1e-6)) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("slots,d", [(8, 512), (8, 128), (128, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_flash_compress_store(slots: int, d: int, dtype: torch.dtype) -> None:
    torch.manual_seed(7)
    dev, n, rows = "cuda", 16, 100_000
    kv, score = (t.to(dev) for t in _windows(n, slots, d, empty_slots=slots // 2))
    w = torch.rand(d, device=dev) + 0.5
    cos, sin = _angles(n, 64, dev)
    dest = torch.randperm(rows, device=dev)[:n]
    before = torch.randn(rows, d, device=dev).to(dtype)
    out, want = before.clone(), before.clone()
    rope.compress_store(kv, score, w, 1e-6, cos, sin, out, dest)
    ref.compress_store(kv, score, w, 1e-6, cos, sin, want, dest)
    assert _rel(out[dest], want[dest]) < (5e-3 if dtype == torch.bfloat16 else 1e-5)
    keep = torch.ones(rows, dtype=torch.bool, device=dev)
    keep[dest] = False
    assert torch.equal(out[keep], before[keep])
    # the row form over the same slots (flattened), empty slots as -1: the same bits
    flat = torch.arange(n * slots, device=dev).view(n, slots)
    flat[0, : slots // 2] = -1
    gathered = before.clone()
    kv2, score2 = kv.reshape(-1, d), score.reshape(-1, d)
    rope.compress_store(kv2, score2, w, 1e-6, cos, sin, gathered, dest, rows=flat)
    assert torch.equal(gathered, out)
    # prefill's two sources (ring | chunk) split at a row inside the windows: the same bits
    split = n * slots // 2 + 3
    two = before.clone()
    rope.compress_store(kv2[:split], score2[:split], w, 1e-6, cos, sin, two, dest, rows=flat,
                        chunk=(kv2[split:], score2[split:]))  # fmt: skip
    assert torch.equal(two, out)


@pytest.mark.gpu
@pytest.mark.parametrize("T,n", [(1, 1024), (64, 1024), (64, 256), (16, 512)])
def test_gpu_compress_keep(T: int, n: int) -> None:
    # Flash's compressors: CSA 2 x 512 (ratio 4), the indexer's 2 x 128, HCA 512 (ratio 128)
    torch.manual_seed(12)
    ratio = 128 if n == 512 else 4
    kv, gate, ape, pos, m, kv_state, score_state, rows = _keep_case(
        T, n, ratio, 4096, torch.bfloat16, "cuda"
    )
    want_kv, want_score = kv_state.clone(), score_state.clone()
    ok = rows >= 0
    ref.compress_keep(kv[ok], gate[ok], ape, pos[ok], m, want_kv, want_score, rows[ok])
    rope.compress_keep(kv, gate, ape, pos, m, kv_state, score_state, rows)
    assert torch.equal(kv_state, want_kv) and torch.equal(score_state, want_score)
