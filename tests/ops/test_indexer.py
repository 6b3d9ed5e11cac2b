"""index_topk (Triton) against dsv4.ops.ref.index_topk: positions must match exactly, ties included
(sort=False: the same positions, as a set)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dsv4.ops import indexer, ref


def _inputs(
    T: int,
    Hi: int,
    d: int,
    C: int,
    dtype: torch.dtype,
    p_hidden: float = 0.3,
    n_keys: int | None = None,
    integer: bool = False,
    device: str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # q: [T, Hi, d] ; weights: [T, Hi] fp32 ; keys: [N, d] ; cand: [T, C] int64 with random -1s.
    # n_keys=None: distinct key rows per token (a random permutation of a larger pool); a small n_keys
    # repeats rows. integer=True: small integers, so every score is exact in fp32 and ties are real.
    g = torch.Generator().manual_seed(seed)
    N = n_keys if n_keys is not None else 2 * C + 3
    if integer:
        q = torch.randint(-2, 3, (T, Hi, d), generator=g).float()
        keys = torch.randint(-2, 3, (N, d), generator=g).float()
        weights = torch.randint(-2, 4, (T, Hi), generator=g).float() * 0.5
    else:
        q = torch.randn(T, Hi, d, generator=g)
        keys = torch.randn(N, d, generator=g)
        weights = torch.randn(T, Hi, generator=g) * Hi**-0.5
    if n_keys is None:
        cand = torch.stack([torch.randperm(N, generator=g)[:C] for _ in range(T)])
    else:
        cand = torch.randint(0, N, (T, C), generator=g)
    cand[torch.rand(T, C, generator=g) < p_hidden] = -1
    to = dict(device=device)
    return q.to(dtype).to(**to), weights.to(**to), keys.to(dtype).to(**to), cand.to(**to)


def _check(q, weights, keys, cand, topk, **knobs) -> None:  # noqa: ANN001, ANN003
    # knobs of index_topk; select "hist-unsorted" / "levels-unsorted": that select with sort=False
    select = knobs.pop("select", None)
    if select is not None:
        knobs |= dict(select=select.split("-")[0], sort="-" not in select)
    out = indexer.index_topk(q, weights, keys, cand, topk, **knobs)
    want = ref.index_topk(q, weights, keys, cand, topk)
    assert out.dtype == torch.int64 and out.shape == want.shape, (out.dtype, out.shape, want.shape)
    if not knobs.get("sort", True):
        out, want = out.sort(-1).values, want.sort(-1).values
    bad = (out != want).any(-1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} differ:\n{out[bad[:2]]}\nwant\n{want[bad[:2]]}"


# (T, Hi, d, C, topk): topk > C, topk > visible count, topk = 1, C = 1, one and several tiles
SHAPES = [
    (1, 2, 16, 1, 1),
    (4, 2, 16, 5, 4),
    (7, 16, 32, 5, 64),
    (1, 16, 16, 300, 64),
    (4, 2, 32, 300, 4),
    (7, 16, 32, 300, 64),
    (4, 16, 16, 300, 1),
]


# the two top-k paths (index_topk picks hist for long decode rows), sorted and not (the model's)
SELECTS = ["levels", "hist", "levels-unsorted", "hist-unsorted"]


@pytest.mark.parametrize("select", SELECTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,Hi,d,C,topk", SHAPES)
def test_index_topk_random(
    T: int, Hi: int, d: int, C: int, topk: int, dtype: torch.dtype, select: str
) -> None:
    if select != "levels" and dtype != torch.float32:
        pytest.skip("the select does not see the input dtype: fp32 covers it")
    _check(*_inputs(T, Hi, d, C, dtype), topk, select=select)


@pytest.mark.parametrize("select", SELECTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "T,Hi,d,C,topk", [(4, 2, 16, 300, 64), (7, 16, 32, 300, 4), (4, 16, 16, 5, 4)]
)
def test_index_topk_ties(
    T: int, Hi: int, d: int, C: int, topk: int, dtype: torch.dtype, select: str
) -> None:
    # integer scores with few distinct values and repeated key rows: ties resolve to the lower position
    _check(*_inputs(T, Hi, d, C, dtype, n_keys=7, integer=True), topk, select=select)


@pytest.mark.parametrize("keys_on_m", [True, False])
def test_index_topk_score_orientation(keys_on_m: bool) -> None:
    # both layouts of the score dot (keys or heads on the tile's rows) give the reference
    cfg = indexer.ScoreConfig(block_n=16, keys_on_m=keys_on_m)
    _check(*_inputs(7, 16, 32, 300, torch.float32), 64, score_config=cfg)
    _check(*_inputs(4, 2, 16, 300, torch.float32, n_keys=7, integer=True), 64, score_config=cfg)


def test_index_topk_strided_bf16_weights() -> None:
    # q a slice of a wider tensor (head stride 2d), weights in the activation dtype
    q, weights, keys, cand = _inputs(4, 16, 32, 300, torch.bfloat16)
    wide = torch.cat([q, torch.randn_like(q)], dim=-1)
    _check(wide[..., :32], weights.bfloat16(), keys, cand, 64)


@pytest.mark.parametrize("select", ["levels", "hist"])
def test_index_topk_weight_scale(select: str) -> None:
    # bf16 head weights scaled inside the op (the model's softmax_scale / sqrt(heads)): the same
    # positions as weights.float() * scale passed in, in the kernel and in the reference
    q, weights, keys, cand = _inputs(4, 16, 32, 300, torch.float32)
    w16, scale = (weights * 8).bfloat16(), 32**-0.5 * 16**-0.5
    want = ref.index_topk(q, w16.float() * scale, keys, cand, 64)
    assert torch.equal(ref.index_topk(q, w16, keys, cand, 64, None, scale), want)
    out = indexer.index_topk(q, w16, keys, cand, 64, None, scale, select=select)
    assert torch.equal(out, want)
    # a positive scale keeps the order; a negative one shows that the kernel applies it
    flipped = ref.index_topk(q, w16, keys, cand, 64, None, -scale)
    assert not torch.equal(flipped, want)
    assert torch.equal(indexer.index_topk(q, w16, keys, cand, 64, None, -scale, select=select),
                       flipped)  # fmt: skip


@pytest.mark.parametrize("select", SELECTS)
def test_index_topk_zero_scores(select: str) -> None:
    # zero rows score exactly 0 (-0.0 in torch under all-negative weights): ties by position
    q, weights, keys, cand = _inputs(4, 16, 16, 300, torch.float32, n_keys=9, integer=True)
    keys[:4] = 0
    weights[0] = -weights[0].abs() - 0.5  # all-negative weights: sum_h w_h * 0 = -0.0 in torch
    keys[4:] = keys[4:].abs()
    q[1] = -q[1].abs()  # token 1: every relu is 0
    _check(q, weights, keys, cand, 64, select=select)


@pytest.mark.parametrize("select", SELECTS)
def test_index_topk_hidden_rows(select: str) -> None:
    # a row with no visible entry, a row with one, and a -1 pattern that is not a suffix
    q, weights, keys, cand = _inputs(4, 2, 16, 100, torch.float32, p_hidden=0.0)
    cand[0] = -1
    cand[1, :-1] = -1
    cand[2, ::2] = -1
    cand[3, 70:] = -1
    _check(q, weights, keys, cand, 64, select=select)
    _check(q, weights, keys, cand, 128, select=select)


@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("one_sequence", [False, True])
def test_index_topk_causal_prefill(integer: bool, one_sequence: bool) -> None:
    # one sequence: token t sees compressed entries 0..(t+1)//4-1 of the same key rows
    # (one_sequence: the score kernel shares each key tile between SHARED_TOKENS tokens)
    T, C = 24, 6
    q, weights, keys, cand = _inputs(T, 16, 32, C, torch.bfloat16, p_hidden=0.0, integer=integer)
    cand[:] = cand[0]
    t = torch.arange(T)[:, None]
    cand[torch.arange(C)[None, :] >= (t + 1) // 4] = -1
    _check(q, weights, keys, cand, 4, one_sequence=one_sequence)


@pytest.mark.parametrize(
    "shared,dtype,fp8",
    [(4, torch.float32, False), (4, torch.bfloat16, True), (2, torch.bfloat16, False)],
)
def test_shared_token_scores(shared: int, dtype: torch.dtype, fp8: bool, monkeypatch) -> None:  # noqa: ANN001
    # one sequence's rows, each token a longer prefix (40 .. 300 entries: several key tiles), the
    # last token block partial (T = 21): the shared-tile scores equal the one-token-a-program scores bit for bit, and the
    # top-k matches the reference
    from dsv4.quant import quant_index_keys

    monkeypatch.setattr(indexer, "SHARED_TOKENS", shared)
    T, C = 21, 300
    q, weights, keys, cand = _inputs(T, 16, 32, C, dtype, p_hidden=0.0, integer=True)
    cand[:] = cand[0]
    count = (40 + 13 * torch.arange(T))[:, None]  # (a prefix a token, 40 .. 300 entries)
    cand[torch.arange(C)[None, :] >= count] = -1
    key_scale = None
    if fp8:
        keys, key_scale = quant_index_keys(keys.float())
    cfg = indexer.ScoreConfig()
    one = indexer._scores(q, weights, keys, cand, cfg, None, key_scale, 0.5)
    both = indexer._scores(q, weights, keys, cand, cfg, None, key_scale, 0.5, shared=shared)
    assert torch.equal(one, both)
    want = ref.index_topk(q, weights, keys, cand, 16, key_scale, 0.5)
    got = indexer.index_topk(q, weights, keys, cand, 16, key_scale, 0.5, one_sequence=True)
    assert torch.equal(got, want)
    # the one list expanded (stride 0) with each token's count instead of the table: the same
    # scores bit for bit, the same picks in the kernel (shared tiles, or the table it builds
    # for one token a program) and in the reference
    one_list, counts = cand[-1:].expand(T, C), count.flatten()
    assert one_list.stride(0) == 0
    counted = indexer._scores(q, weights, keys, one_list, cfg, None, key_scale, 0.5, shared=shared,
                              counts=counts)  # fmt: skip
    assert torch.equal(counted, one)
    for seq in (True, False):
        got = indexer.index_topk(q, weights, keys, one_list, 16, key_scale, 0.5, one_sequence=seq,
                                 counts=counts)  # fmt: skip
        assert torch.equal(got, want), seq
    assert torch.equal(ref.index_topk(q, weights, keys, one_list, 16, key_scale, 0.5,
                                      counts=counts), want)  # fmt: skip


@pytest.mark.parametrize("select", SELECTS)
def test_index_topk_segments(select: str) -> None:
    # C > one select program (4096 keys): segment top-k, then a packed re-selection (levels), or
    # two programs filing into one row (hist)
    q, weights, keys, cand = _inputs(1, 2, 16, 4500, torch.float32, n_keys=5, integer=True)
    _check(q, weights, keys, cand, 16, select=select)


@pytest.mark.parametrize("select", SELECTS)
@pytest.mark.parametrize("integer", [False, True])
def test_index_topk_segment_levels(integer: bool, select: str) -> None:
    # 64-key segments: C=1100 takes two segment levels before the final one; with integer scores
    # the ties cross segment boundaries and must still resolve to the lowest positions
    q, weights, keys, cand = _inputs(
        2, 2, 16, 1100, torch.float32, n_keys=5 if integer else None, integer=integer
    )
    _check(q, weights, keys, cand, 4, segment=64, select=select)


def _path_rows(integer: bool) -> tuple[torch.Tensor, ...]:
    # rows that take each path of the k-th largest search (T=8, C=300). Equal keys must score
    # equal wherever they sit in a tile: the interpreter's dot is the host BLAS, whose rounding can
    # differ by row (an AMD host gave 1-ulp splits), so the distinct-score inputs are multiples of
    # 1/16 too, and every score is exact in fp32 whatever the summation order
    q, weights, keys, cand = _inputs(
        8, 4, 16, 300, torch.float32, p_hidden=0.0, n_keys=7 if integer else None, integer=integer
    )
    if not integer:
        q, weights, keys = ((x * 16).round() / 16 for x in (q, weights, keys))
    cand[1, torch.rand(300, generator=torch.Generator().manual_seed(1)) < 0.3] = -1
    cand[2] = cand[2, 0]  # every score equal: max == min of the visible keys
    cand[3, ::2] = cand[3, 0]  # one score on every other entry, the rest hidden
    cand[3, 1::2] = -1
    cand[4, :-1] = -1  # one visible entry, in the last segment
    cand[5] = -1  # none visible
    cand[6, :200] = -1  # whole segments with no visible entry
    return q, weights, keys, cand


@pytest.mark.parametrize("select", SELECTS)
@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("topk", [1, 16, 64])
def test_index_topk_search_paths(topk: int, integer: bool, select: str) -> None:
    if select.startswith("hist") and topk != 16:
        pytest.skip("test_index_topk_hist_full_bin takes these rows through hist at every k")
    # rows that take each path of the k-th largest search, scores of both signs. Segments of
    # max(64, 4 * padded k) keys: two select levels, three for topk=16; some segment holds exactly
    # k keys (topk=16: the last 16 of the second level's 80, topk=64: the last 44 of C=300).
    # Integer scores: many exact ties, the count jumps past k and the search runs to the last bit;
    # distinct scores: it stops early once exactly k keys are at or above the prefix
    _check(*_path_rows(integer), topk, segment=64, select=select)


@pytest.mark.parametrize("select", ["hist", "hist-unsorted"])
@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("topk", [1, 16, 64])
def test_index_topk_hist_full_bin(topk: int, integer: bool, select: str, monkeypatch) -> None:  # noqa: ANN001
    # the hist select's slow path: winners + threshold-bin candidates past the sort's width (forced
    # here by a width of 2 * padded k), or unsorted, candidates past the ranking's (16), take the
    # bitwise search over the candidates; rows as in test_index_topk_search_paths (all equal, one
    # visible, none visible, ...)
    monkeypatch.setattr(indexer, "HIST_FAST", 32)
    monkeypatch.setattr(indexer, "HIST_CAND", 16)
    _check(*_path_rows(integer), topk, segment=64, select=select)


def test_index_topk_hist_workspace() -> None:
    # the hist select leaves its counts zero (graph replays and later calls rely on it), and rows
    # past HIST_MAX_TOKENS take the levels select by default
    q, weights, keys, cand = _inputs(3, 2, 16, 300, torch.float32)
    _check(q, weights, keys, cand, 64, select="hist")
    for ws in indexer._hist_workspace(q.device):
        assert not ws.any(), ws.nonzero()[:4]
    with pytest.raises(AssertionError, match="hist select"):
        q, weights, keys, cand = _inputs(indexer.HIST_MAX_TOKENS + 1, 2, 16, 8, torch.float32)
        indexer.index_topk(q, weights, keys, cand, 4, select="hist")


@triton.jit
def _kth_largest_probe(u_ptr, n_ptr, kk_ptr, out_ptr, BLOCK: tl.constexpr):
    # one row of BLOCK uint32 keys (as int32 bits) per program: the first n are valid, the rest junk
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    u = tl.load(u_ptr + r * BLOCK + offs).to(tl.uint32, bitcast=True)
    thr, need = indexer._kth_largest(u, offs < tl.load(n_ptr + r), tl.load(kk_ptr + r))
    tl.store(out_ptr + 2 * r, thr.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 2 * r + 1, need)


def test_kth_largest() -> None:
    # the search alone against a sort: random uint32 (top bit set and clear), few distinct values
    # with the extremes 0 and 2^32-1, all equal, a run of consecutive values, k = 1 and k = n
    g = torch.Generator().manual_seed(0)
    B, R = 64, 12
    u = torch.randint(0, 2**32, (R, B), generator=g)
    few = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1])
    u[4:7] = few[torch.randint(0, len(few), (3, B), generator=g)]
    u[7] = 2**31  # hi == lo
    u[8] = 2**31 - 20 + torch.randperm(B, generator=g)  # consecutive: the last bit decides
    u[9, :5] = 2**32 - 1  # the k largest at the top of the range
    n = torch.tensor([B, B, 40, 1, B, B, 33, B, B, B, 17, 2])
    kk = torch.tensor([1, B, 7, 1, 3, 40, 20, 9, 25, 5, 17, 1])
    u[10:] = u[10:] >> 8  # a common top byte: the search starts lower
    out = torch.empty(R, 2, dtype=torch.int32)
    bits = torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)
    _kth_largest_probe[(R,)](bits, n.int(), kk.int(), out, BLOCK=B)
    for r in range(R):
        v = u[r, : n[r]]
        thr = v.sort(descending=True).values[kk[r] - 1]
        need = kk[r] - (v > thr).sum()
        assert out[r, 0].item() & 0xFFFFFFFF == thr and out[r, 1] == need, (r, out[r], thr, need)


# ---------------------------------------------------------------------------------------------
# GPU: Flash shapes (64 indexer heads x 128, top-512, bf16)
# ---------------------------------------------------------------------------------------------


def _ref_scores(q, weights, keys, cand) -> torch.Tensor:  # noqa: ANN001
    k = keys[cand.clamp(min=0)].float()
    s = torch.relu(torch.einsum("thd,tcd->thc", q.float(), k))
    return (s * weights.float().unsqueeze(-1)).sum(1).masked_fill(cand < 0, float("-inf"))


@pytest.mark.gpu
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("T,C", [(1, 4096), (16, 4096), (1, 32768), (16, 32768)])
def test_index_topk_gpu_exact(T: int, C: int, sort: bool) -> None:
    # integer-valued bf16 inputs: fp32 scores are exact whatever the summation order, so the kernel
    # must reproduce the reference bit for bit, tie rule included (sort=False: as a set)
    q, weights, keys, cand = _inputs(
        T, 64, 128, C, torch.bfloat16, p_hidden=0.0, integer=True, device="cuda"
    )
    cand[:, C - C // 8 :] = -1  # the decode layout: visible entries first, then -1
    _check(q, weights, keys, cand, 512, sort=sort)


@pytest.mark.gpu
@pytest.mark.parametrize("T,C", [(1, 4096), (16, 4096), (1, 32768), (16, 32768)])
def test_index_topk_gpu_random(T: int, C: int) -> None:
    # random bf16: tensor-core sums round differently from the reference einsum, so order may differ
    # on near-ties. Every pick must score >= the reference k-th best (minus a rounding tolerance), the
    # picks must be distinct, visible and in non-increasing reference score, and almost all equal.
    q, weights, keys, cand = _inputs(T, 64, 128, C, torch.bfloat16, p_hidden=0.1, device="cuda")
    out = indexer.index_topk(q, weights, keys, cand, 512)
    want = ref.index_topk(q, weights, keys, cand, 512)
    s = _ref_scores(q, weights, keys, cand)
    tol = 1e-4 * s.masked_fill(cand < 0, 0).abs().amax(-1, keepdim=True)
    assert ((out >= 0) == (want >= 0)).all()
    got = s.gather(1, out.clamp(min=0)).masked_fill(out < 0, float("-inf"))
    kth = s.gather(1, want.clamp(min=0)).masked_fill(want < 0, float("-inf")).amin(-1, keepdim=True)
    vis = out >= 0
    assert (got[vis] >= (kth - tol).expand_as(got)[vis]).all()
    assert (got[:, 1:][vis[:, 1:]] <= (got[:, :-1] + tol)[vis[:, 1:]]).all()
    assert all(len(set(r[r >= 0].tolist())) == int((r >= 0).sum()) for r in out)
    differ = int((out != want).sum())
    set_differ = sum(len(set(a.tolist()) ^ set(b.tolist())) for a, b in zip(out, want))
    print(f"T={T} C={C}: {differ} positions differ in order, {set_differ} in the set")
    assert differ <= 0.02 * out.numel(), differ


@pytest.mark.gpu
@pytest.mark.parametrize("one_sequence", [False, True])
def test_index_topk_gpu_prefill(one_sequence: bool) -> None:
    # causal prefill of one sequence: token t sees entries 0..(t+1)//4-1, exact on integer inputs
    # (one_sequence: key tiles shared between tokens)
    T = 1024
    C = T // 4
    q, weights, keys, cand = _inputs(
        T, 64, 128, C, torch.bfloat16, p_hidden=0.0, integer=True, device="cuda"
    )
    cand[:] = cand[0]
    t = torch.arange(T, device="cuda")[:, None]
    cand[torch.arange(C, device="cuda")[None, :] >= (t + 1) // 4] = -1
    _check(q, weights, keys, cand, 512, one_sequence=one_sequence)


@pytest.mark.gpu
@pytest.mark.parametrize("T,C", [(256, 32768), (32, 262144)])  # 128K and 1M context
def test_index_topk_gpu_prefill_counts(T: int, C: int) -> None:
    # a long chunk's slice as the model passes it (`Batch.index_rows`): the sequence's one list
    # of rows, expanded, and each token's count; exact on integer inputs, the picks of the table
    q, weights, keys, cand = _inputs(
        T, 64, 128, C, torch.bfloat16, p_hidden=0.0, integer=True, device="cuda"
    )
    counts = C - 4 * (T - 1) + 4 * torch.arange(T, device="cuda") - 3  # (a slice deep in context)
    table = torch.where(torch.arange(C, device="cuda")[None, :] < counts[:, None], cand[0], -1)
    want = ref.index_topk(q, weights, keys, table, 512)
    one_list = cand[:1].expand(T, C)
    got = indexer.index_topk(q, weights, keys, one_list, 512, one_sequence=True, counts=counts)
    assert torch.equal(got, want)
    scores = indexer._scores(q, weights, keys, table, shared=indexer.SHARED_TOKENS)
    counted = indexer._scores(q, weights, keys, one_list, shared=indexer.SHARED_TOKENS,
                              counts=counts)  # fmt: skip
    assert torch.equal(counted, scores)


@pytest.mark.gpu
@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("integer", [False, True])
def test_index_topk_gpu_hist_graph(T: int, integer: bool, sort: bool) -> None:
    # the hist select replayed in a CUDA graph gives the levels select's positions on every replay
    # (the same score keys; sort=False: the same set, and the same order on every replay), and its
    # workspace is zero after each. Integer scores: the slow path
    q, weights, keys, cand = _inputs(
        T, 64, 128, 32768, torch.bfloat16, p_hidden=0.1, integer=integer, device="cuda"
    )
    want = indexer.index_topk(q, weights, keys, cand, 512, select="levels")
    kw = dict(select="hist", sort=sort)
    first = indexer.index_topk(q, weights, keys, cand, 512, **kw)  # compiled outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = indexer.index_topk(q, weights, keys, cand, 512, **kw)
    for _ in range(3):
        out.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
        got = out if sort else out.sort(-1).values
        bad = int((got != (want if sort else want.sort(-1).values)).sum())
        assert bad == 0, f"{bad} positions differ"
        for ws in indexer._hist_workspace(q.device):
            assert not ws.any(), ws.nonzero()[:4]


@pytest.mark.gpu
def test_gpu_score_compiles_once_across_tile_counts() -> None:
    # the score kernel's tiles per program are a runtime count: decodes at batch sizes and
    # contexts that give 2, 4, 8 or 16 tiles a program meet no Triton compile once one of them ran
    # (late compiles in a served burst, docs/PERF.md thirty-second session: TILES 2, 4, 8)
    import logging

    from dsv4.ops.device import CompileWatch

    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    cases = []
    for tiles in (2, 4, 8, 16):  # T * n_tiles // programs in [tiles, 2 tiles): that many tiles
        T, n_tiles = 16, -(-tiles * programs // 16)
        assert indexer._score_tiles(T, n_tiles, programs) == tiles
        cases.append((T, 64 * n_tiles))
    q, weights, keys, cand = _inputs(16, 64, 128, cases[-1][1], torch.bfloat16, device="cuda")
    w_sc = 0.01
    indexer._scores(q, weights, keys, cand[:, : cases[0][1]], weight_scale=w_sc)
    watch = CompileWatch(logging.getLogger("test.indexer")).install()
    try:
        for _, C in cases[1:]:
            got = indexer._scores(q, weights, keys, cand[:, :C], weight_scale=w_sc)
            want = _ref_scores(q, weights * w_sc, keys, cand[:, :C])
            torch.cuda.synchronize()
            flip = got ^ ((got >> 31) & 0x7FFFFFFF)  # the order-preserving keys back to fp32
            vis = cand[:, :C] >= 0
            torch.testing.assert_close(
                flip.view(torch.float32)[vis], want[vis], rtol=2e-2, atol=1e-3
            )
    finally:
        watch.uninstall()
    assert watch.count == 0, watch.names


@pytest.mark.gpu
@pytest.mark.parametrize("select,C", [("levels", 128), ("hist", 8192)])
def test_gpu_topk_compiles_once_across_candidate_counts(select: str, C: int) -> None:
    # served candidate counts take every value; the model's rows come padded to a multiple of 16
    # (`state.ENTRY_ALIGN`, -1 past the visible ones), so lengths and row strides keep one
    # specialization: counts of one block class meet no Triton compile once one ran (late compiles
    # in a served burst, docs/PERF.md thirty-third session), and stay exact on integer inputs
    import logging

    from dsv4.ops.device import CompileWatch
    from dsv4.state import ENTRY_ALIGN

    q, weights, keys, cand = _inputs(
        4, 64, 128, C, torch.bfloat16, p_hidden=0.1, integer=True, device="cuda"
    )
    topk = 64 if select == "levels" else 512
    _check(q, weights, keys, cand, topk, select=select, sort=False)
    watch = CompileWatch(logging.getLogger("test.indexer")).install()
    try:
        for n in (C - 1, C - 3, C - 8, C - 15, C - 16 - 5):  # not multiples of 16, one class
            width = -(-n // ENTRY_ALIGN) * ENTRY_ALIGN
            rows = cand[:, :width].clone()
            rows[:, n:] = -1
            _check(q, weights, keys, rows, topk, select=select, sort=False)
    finally:
        watch.uninstall()
    assert watch.count == 0, watch.names
