"""The indexer on a causal prefill chunk at Flash's shapes (64 heads x 128, top-512): the score
kernel alone and scores + top-k, device µs (CUDA-graph replays, L2 cleared) and the tensor
FLOP rate of the scores (token-key pairs x 64 x 128 x 2). One sequence: a chunk of T tokens at
positions P .. P + T - 1 sees (p + 1) // 4 of the C = (P + T) // 4 entries. Is the prefill
indexer worth a kernel that shares key tiles between tokens? And the model's form (one list of
rows and counts). (The forty-seventh session's Gluon score kernel was measured here; a probe does
not time a kernel as the model runs it: see docs/PERF.md, forty-eighth session.)"""

from __future__ import annotations

import argparse
import statistics

import torch

from dsv4.bench.ops import _graph_us
from dsv4.ops import indexer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="512@131072,2048@131072,64@1048576,2048@8192")
    p.add_argument("--tokens", default="4", help="tokens a score program shares a tile between")
    p.add_argument(
        "--rows",
        choices=("random", "paged"),
        default="random",
        help="the candidates' key rows: a random permutation, or in order (the state's "
        "pages of one sequence, as a prefill step reads them)",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="no L2 clear between calls (a step's slices follow each other)",
    )
    p.add_argument("--only", default="", help="run only the rows whose name holds this text")
    ns = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    form = ns.rows + (", warm" if ns.warm else "")
    tbs = [int(x) for x in ns.tokens.split(",")]
    H, d, k = 64, 128, 512
    for spec in ns.shapes.split(","):
        T, P = (int(x) for x in spec.split("@"))
        C = (P + T) // 4
        keys = torch.randn(C * 5 // 4, d, generator=g, device="cuda").to(torch.bfloat16)
        if ns.rows == "paged":
            rows = torch.arange(C, device="cuda")
        else:
            rows = torch.randperm(keys.shape[0], generator=g, device="cuda")[:C]
        count = (torch.arange(P, P + T, device="cuda") + 1) // 4
        w = torch.arange(C, device="cuda")[None, :]
        cand = torch.where(w < count[:, None], rows[None, :], -1)
        q = torch.randn(T, H, d, generator=g, device="cuda").to(torch.bfloat16)
        weights = torch.randn(T, H, generator=g, device="cuda") * H**-0.5
        pairs = int(count.sum())
        flop = pairs * H * d * 2
        cfg = indexer.ScoreConfig()
        runs = [
            ("scores", lambda: indexer._scores(q, weights, keys, cand)),
            ("index_topk", lambda: indexer.index_topk(q, weights, keys, cand, k, sort=False)),
        ]
        for tb in tbs:
            runs.append((f"scores, {tb} tokens a tile", lambda tb=tb: indexer._scores(
                q, weights, keys, cand, cfg, None, None, 1.0, tb)))  # fmt: skip
        one = rows[None, :].expand(T, C)  # the model's form: one list and counts
        runs.append(("scores, counts", lambda one=one, count=count: indexer._scores(
            q, weights, keys, one, cfg, None, None, 1.0, indexer.SHARED_TOKENS, count)))  # fmt: skip
        runs.append(("index_topk one_sequence", lambda: indexer.index_topk(
            q, weights, keys, cand, k, sort=False, one_sequence=True)))  # fmt: skip
        runs.append(("index_topk counts", lambda one=one, count=count: indexer.index_topk(
            q, weights, keys, one, k, sort=False, one_sequence=True, counts=count)))  # fmt: skip
        base = indexer._scores(q, weights, keys, cand)
        for tb in tbs:
            same = torch.equal(
                base, indexer._scores(q, weights, keys, cand, cfg, None, None, 1.0, tb)
            )
            print(f"T={T} at {P}: {tb} tokens a tile gives the same scores: {same}", flush=True)
        for name, fn in runs:
            if ns.only not in name:
                continue
            us = statistics.median(_graph_us(fn, 3, cold=not ns.warm) or [float("nan")])
            print(
                f"T={T:5d} at {P:8d} (C={C:6d}, {form}): {name:<26} {us:10.1f} us, "
                f"{flop / us / 1e6:7.1f} TFLOP/s of scores, {pairs / us / 1e3:8.2f} G pairs/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
