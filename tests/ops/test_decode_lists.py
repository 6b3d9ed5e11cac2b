"""`ops.decode_lists`: a static decode step's shared index lists in one launch, entry for entry equal
to `Batch`'s torch builders (the reference)."""

from __future__ import annotations

import pytest
import torch

from dsv4.config import CSA, HCA, SLIDING
from dsv4.ops import decode_lists
from dsv4.state import Batch, DecodeState
from dsv4.tiny import tiny_args


def _state(layer_types: tuple, device: str = "cpu", window: int = 8) -> DecodeState:
    args = tiny_args(vocab_size=300, layer_types=layer_types, window_size=window)
    st = DecodeState(args, 6, 512, torch.float32, device, num_blocks=96, block_size=32)
    # pages in a shuffled order, some logical blocks unallocated (-1)
    g = torch.Generator().manual_seed(0)
    pages = torch.randperm(96, generator=g).view(st.block_table.shape)
    st.block_table.copy_(pages.to(device))
    st.block_table[1, 5:] = -1
    st.block_table[4, 2] = -1
    return st


def _reference(st: DecodeState, slots, starts, graph_len: int) -> dict:  # noqa: ANN001
    b = Batch.build_static(slots, starts, st, graph_len)
    decode_lists_fused, decode_lists.FUSED = decode_lists.FUSED, False
    try:
        b.prepare(st.args)
    finally:
        decode_lists.FUSED = decode_lists_fused
    return b._cache


def _equal(a: object, b: object) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and torch.equal(a.cpu().long(), b.cpu().long())


# slots and positions around the window, ring and page edges: p = 0, a window closing (p + 1 a
# multiple of the ratio), the first position of a page, positions whose pages are unallocated
CASES = [
    ([0], [0]),
    ([3], [3]),
    ([2, 0], [15, 16]),
    ([1, 4, 5, 0, 3], [31, 32, 63, 160, 255]),
    ([5, 2, 1], [200, 7, 127]),
    ([4, 1], [95, 255]),  # entries (and a closing window) on the unallocated pages
]


@pytest.mark.parametrize("layer_types", [(SLIDING, CSA, HCA), (SLIDING, CSA), (HCA,), (SLIDING,)])
@pytest.mark.parametrize("slots,starts", CASES)
@pytest.mark.parametrize("graph_len", [256, 300])
def test_fill_equals_the_builders(
    layer_types: tuple,
    slots: list,
    starts: list,
    graph_len: int,
    monkeypatch,  # noqa: ANN001
):
    # (the entry lists in chunks of 32 entries, 16 a step: 2-3 programs a token for the CSA lists)
    monkeypatch.setattr(decode_lists, "BLOCK", 16)
    monkeypatch.setattr(decode_lists, "CHUNK", 32)
    st = _state(layer_types)
    s, p = torch.tensor(slots), torch.tensor(starts)
    want = _reference(st, s, p, graph_len)
    b = Batch.build_static(s, p, st, graph_len)
    a = st.args
    ratios = {True: a.csa_ratio if CSA in layer_types else None,
              False: a.hca_ratio if HCA in layer_types else None}  # fmt: skip
    base = st.max_seqs * a.window_size
    b.file_lists(decode_lists.fill(b, a.window_size, ratios[True], ratios[False], base), base)
    got = {k: v for k, v in b._cache.items() if k[0] != "tok"}
    # every list the builders memoize, but the HCA entry list that attention_idxs builds on the way
    want = {
        k: v for k, v in want.items() if k[0] != "tok" and k != ("entries", a.hca_ratio, base)
    }  # fmt: skip
    assert set(got) == set(want), (sorted(map(str, got)), sorted(map(str, want)))
    for key in want:
        assert _equal(got[key], want[key]), key


@pytest.mark.parametrize("T,C,K", [(1, 5, 4), (3, 40, 7), (4, 300, 200)])
def test_selected_rows_equal_the_builder(T: int, C: int, K: int) -> None:
    # the CSA layers' key rows: the window rows, then the picked entries' rows (-1 picks -1)
    g = torch.Generator().manual_seed(C)
    W = 8
    win = torch.randint(-1, 1000, (T, W), generator=g)
    ent_rows = torch.cat([torch.randint(-1, 5000, (T, C), generator=g), -torch.ones(T, 1)], 1)
    ent_rows = ent_rows.long()
    ent = torch.randint(0, C, (T, K), generator=g)
    ent[:, -1] = -1  # none picked
    ent[0, : min(K, 2)] = C - 1  # the last visible column
    want = torch.cat([win, ent_rows.gather(1, ent.remainder(C + 1))], dim=1)
    assert torch.equal(decode_lists.selected_rows(win, ent_rows, ent), want)


def test_prepare_takes_the_fused_form_only_for_a_static_gpu_step(monkeypatch):  # noqa: ANN001
    # on the CPU (or for an eager batch) prepare keeps the builders even when FUSED is on
    st = _state((SLIDING, CSA, HCA))
    called = []
    monkeypatch.setattr(decode_lists, "FUSED", True)
    monkeypatch.setattr(decode_lists, "fill", lambda *a: called.append(a))
    b = Batch.build_static(torch.tensor([0]), torch.tensor([9]), st, 64)
    b.prepare(st.args)
    assert not called and ("win", st.args.window_size, True) in b._cache


def test_fill_needs_a_static_decode_batch():
    st = _state((SLIDING, CSA, HCA))
    b = Batch.build([0], [9], [2], st)
    with pytest.raises(AssertionError, match="static decode"):
        decode_lists.fill(b, 8, 4, 16, 48)


@pytest.mark.gpu
@pytest.mark.parametrize("graph_len", [256, 512])
def test_gpu_fill_equals_the_builders(graph_len: int):
    st = _state((SLIDING, CSA, HCA), "cuda")
    s, p = torch.tensor([1, 4, 5, 0, 3], device="cuda"), torch.tensor([31, 32, 63, 160, 255])
    p = p.cuda()
    want = _reference(st, s, p, graph_len)
    b = Batch.build_static(s, p, st, graph_len)
    a = st.args
    base = st.max_seqs * a.window_size
    b.file_lists(decode_lists.fill(b, a.window_size, a.csa_ratio, a.hca_ratio, base), base)
    # (not the HCA entry list that attention_idxs builds on the way)
    for key in (k for k in want if k[0] != "tok" and k != ("entries", a.hca_ratio, base)):
        assert _equal(b._cache[key], want[key]), key
    # the CSA layers' selected rows, the picks -1 included
    ent = torch.randint(-1, 8, (5, 6), device="cuda")
    rows = b._cache[("entries", a.csa_ratio, base)]
    win = b._cache[("win", a.window_size, True)]
    want_sel = torch.cat([win, rows.gather(1, ent.remainder(rows.shape[1]))], dim=1)
    assert torch.equal(decode_lists.selected_rows(win, rows, ent), want_sel)


@pytest.mark.gpu
def test_gpu_fill_compiles_once_for_every_bound():
    # the lists' widths (a graph's position bound / ratio) are not constexprs: the bounds a
    # growing context captures graphs at meet no Triton compile after the first
    import logging

    from dsv4.ops.device import CompileWatch

    st = _state((SLIDING, CSA, HCA), "cuda")
    a = st.args
    s, p = torch.tensor([1, 4], device="cuda"), torch.tensor([31, 200], device="cuda")
    b = Batch.build_static(s, p, st, 256)
    decode_lists.fill(b, a.window_size, a.csa_ratio, a.hca_ratio, 0)
    watch = CompileWatch(logging.getLogger("test.decode_lists")).install()
    try:
        for bound in (320, 384, 448, 512):
            b = Batch.build_static(s, p, st, bound)
            decode_lists.fill(b, a.window_size, a.csa_ratio, a.hca_ratio, 0)
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert watch.count == 0, watch.names
