"""Lightning indexer + top-k cases: decode over a paged key pool (T = 1, 16, 64 at 128K context,
T = 16 at 4K; T = 1, 16 at 128K over FP8 indexer keys) and a causal prefill of one sequence
(T = 4096). The decode cases run sorted and unsorted (the model's form, compared as sets).

Decode candidates are laid out as the engine's state lays them out: pages of PAGE_ENTRIES
contiguous key rows (a 256-token block at ratio 4) in a random page order; one case also reads
rows scattered one by one (the worst case for the gather)."""

from __future__ import annotations

import torch

from dsv4.bench.ops import Case
from dsv4.ops import indexer, ref
from dsv4.quant import quant_index_keys

RATIO = 4  # CSA compression: one indexer key per 4 tokens
PAGE_ENTRIES = 64  # entries of one layer in a page: dsv4.state.default_block_size (256) / RATIO


def _inputs(
    T: int, Hi: int, d: int, C: int, causal: bool, device: str, paged: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # keys: a pool 25% larger than the T*C rows read ; cand: distinct pages (or rows) of it, or
    # for the prefill one row set shared by all tokens with token t seeing entries 0..(t+1)//4-1
    g = torch.Generator(device=device).manual_seed(T * 1000 + C)
    N = (T if not causal else 1) * C * 5 // 4
    keys = torch.randn(N, d, generator=g, device=device).to(torch.bfloat16)
    q = torch.randn(T, Hi, d, generator=g, device=device).to(torch.bfloat16)
    weights = torch.randn(T, Hi, generator=g, device=device) * Hi**-0.5
    if causal:
        cand = torch.randperm(N, generator=g, device=device)[:C].expand(T, C).clone()
        t = torch.arange(T, device=device)[:, None]
        cand[torch.arange(C, device=device)[None, :] >= (t + 1) // RATIO] = -1
    elif paged and C % PAGE_ENTRIES == 0:
        pages = torch.randperm(N // PAGE_ENTRIES, generator=g, device=device)
        rows = pages[: T * C // PAGE_ENTRIES, None] * PAGE_ENTRIES
        cand = (rows + torch.arange(PAGE_ENTRIES, device=device)).view(T, C)
    else:
        cand = torch.randperm(N, generator=g, device=device)[: T * C].view(T, C)
    return q, weights, keys, cand


def cases(device: str, quick: bool) -> list[Case]:
    Hi, d, topk = (4, 16, 16) if quick else (64, 128, 512)
    # (T, C, causal, paged, fp8): C = context / 4 ; the prefill sees C = T // 4 entries at the
    # last token ; fp8: FP8 indexer keys (`--kv-cache-dtype fp8`)
    shapes = (
        [(1, 300, False, False, False), (5, 256, False, True, False), (24, 6, True, False, False),
         (5, 256, False, True, True)]
        if quick
        else [(1, 32768, False, True, False), (16, 32768, False, True, False),
              (16, 32768, False, False, False), (64, 32768, False, True, False),
              (16, 1024, False, True, False), (4096, 1024, True, False, False),
              (1, 32768, False, True, True), (16, 32768, False, True, True)]
    )  # fmt: skip
    # the model's form (sort=False: the entries as a set) of the decode cases but the scattered rows
    shapes = [(*s, True) for s in shapes] + [
        (*s, False) for s in shapes if not s[2] and (s[3] or quick)
    ]
    out: list[Case] = []
    for T, C, causal, paged, fp8, sort in shapes:
        q, weights, keys, cand = _inputs(T, Hi, d, C, causal, device, paged)
        key_scale = None
        if fp8:
            keys, key_scale = quant_index_keys(keys)
        visible = int((cand >= 0).sum())
        K = min(topk, C)
        # read the visible key rows (fp8: codes + scale) + q + weights ; write [T, K] int64
        # (cand_idxs, 8 B per key row, is not counted)
        key_bytes = d * keys.element_size() + (4 if fp8 else 0)
        nbytes = (
            visible * key_bytes
            + q.numel() * q.element_size()
            + weights.numel() * weights.element_size()
            + T * K * 8
        )
        args = (q, weights, keys, cand, topk, key_scale)
        ctx = f"{C * RATIO // 1024}K" if C * RATIO >= 1024 else str(C * RATIO)
        target = (T, C, paged, fp8) == (16, 32768, True, False) and not quick
        out.append(Case(
            "index_topk",
            f"{'prefill' if causal else 'decode'} T={T} C={C} ({ctx})"
            + ("" if causal or paged else " rows")
            + (" fp8 keys" if fp8 else "")
            + ("" if sort else " unsorted"),
            # (a causal prefill is one sequence's: the model's form shares key tiles)
            run=lambda a=args, s=sort, c=causal: indexer.index_topk(*a, sort=s, one_sequence=c),
            ref=lambda a=args: ref.index_topk(*a),
            bytes=nbytes,
            target_bw=0.6 if target else None,
            canon=None if sort else (lambda r: r.sort(-1).values),
        ))  # fmt: skip
    return out
