"""Which tiles/splits should the kernel heuristics pick on this GPU? Times alternatives of the
sparse attention, indexer and hc_pre launchers at the issue's target shapes (do_bench, L2 cleared,
median) and prints the best per shape. Usage: python3 bench/sweep_kernels.py [--json FILE]"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from dsv4.bench.cases_indexer import _inputs as index_inputs
from dsv4.bench.ops import _graph_us
from dsv4.ops import indexer, mhc, ref, sparse_attn


def t_us(fn) -> float:  # noqa: ANN001
    # device time (CUDA graph, L2 cleared); do_bench where the op cannot be captured
    g = _graph_us(fn, 1)
    return g[0] if g else do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def sweep_attn(rows: list) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    H, D = 64, 512
    pool = torch.randn(64 * 32768, D, device="cuda", dtype=torch.bfloat16, generator=g)
    ring = torch.randn(64 * 128, D, device="cuda", dtype=torch.bfloat16, generator=g)
    sink = torch.randn(H, device="cuda", generator=g)
    for T in (1, 16, 64):
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        new = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
        win = torch.randint(0, ring.shape[0], (T, 128), device="cuda", generator=g)
        sel = torch.randint(0, pool.shape[0], (T, 512), device="cuda", generator=g)
        idx = torch.cat([win, sel + ring.shape[0] + T], 1)
        kv = (ring, new, pool)
        nbytes = T * 640 * D * 2 + 2 * q.numel() * 2
        want = ref.sparse_attn(q, kv, sink, idx, D**-0.5).float()
        for cfg in sparse_attn._configs():
            c = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            for splits in (1, 2, 4, 5, 8, 10, 20, 40):
                if T * splits > 1024:
                    continue

                def run(c=c, splits=splits):  # noqa: ANN001, ANN202
                    return sparse_attn.sparse_attn(
                        q, kv, sink, idx, D**-0.5, num_splits=splits, config=c
                    )

                try:
                    err = float((run().float() - want).norm() / want.norm())
                    us = t_us(run)
                except Exception as e:  # noqa: BLE001  (a config that does not fit)
                    rows.append(
                        {
                            "op": "sparse_attn",
                            "T": T,
                            "cfg": c,
                            "splits": splits,
                            "error": str(e)[:80],
                        }
                    )
                    continue
                rows.append(
                    {
                        "op": "sparse_attn",
                        "T": T,
                        "cfg": c,
                        "splits": splits,
                        "us": us,
                        "gbps": nbytes / us / 1e3,
                        "err": err,
                    }
                )


def sweep_indexer(rows: list) -> None:
    Hi, d, C = 64, 128, 32768
    for T in (1, 16, 64):
        q, w, keys, cand = index_inputs(T, Hi, d, C, False, "cuda", True)  # engine's paging
        nbytes = T * C * d * 2
        for block_n, keys_on_m in ((64, True), (128, True)):
            for stages in (3, 4):
                for warps in (4, 8):
                    for pps in (1, 2):
                        cfg = indexer.ScoreConfig(block_n, warps, stages, pps, keys_on_m)
                        row = {"op": "index_scores", "T": T, "cfg": cfg._asdict()}
                        try:
                            us = t_us(lambda: indexer._scores(q, w, keys, cand, cfg))  # noqa: B023
                        except Exception as e:  # noqa: BLE001
                            rows.append(row | {"error": str(e)[:80]})
                            continue
                        rows.append(row | {"us": us, "gbps": nbytes / us / 1e3})
        rows.append(
            {
                "op": "index_topk(default)",
                "T": T,
                "us": t_us(lambda: indexer.index_topk(q, w, keys, cand, 512)),
                "gbps": None,
            }
        )


def sweep_index_stages(rows: list) -> None:
    # the model's decode form (unsorted top-512 with the hist select) per score-kernel pipeline
    # depth: Triton's pipeliner waits for every copy in flight each tile at 3 stages (the next
    # tile's index copy is committed after this tile's gather), so only deeper rings keep a
    # gather in flight while a tile is scored
    Hi, d, C = 64, 128, 32768
    for T in (16, 64):
        q, w, keys, cand = index_inputs(T, Hi, d, C, False, "cuda", True)  # engine's paging
        want = indexer.index_topk(q, w, keys, cand, 512, sort=False)
        for stages in (3, 4, 5, 6):
            for warps in (4, 8):
                for pps in (1, 2, 4):
                    cfg = indexer.ScoreConfig(64, warps, stages, pps, True)
                    row = {"op": "index_topk(stages)", "T": T, "cfg": cfg._asdict()}
                    try:
                        got = indexer.index_topk(
                            q, w, keys, cand, 512, sort=False, score_config=cfg
                        )
                        row["same"] = bool(torch.equal(got, want))
                        row["us"] = t_us(
                            lambda cfg=cfg: indexer.index_topk(
                                q, w, keys, cand, 512, sort=False, score_config=cfg
                            )
                        )
                        row["scores_us"] = t_us(
                            lambda cfg=cfg: indexer._scores(q, w, keys, cand, cfg)
                        )
                    except Exception as e:  # noqa: BLE001
                        row["error"] = str(e)[:80]
                    rows.append(row)
                    print(
                        f"T={T} stages {stages} warps {warps} per-SM {pps}: "
                        + (
                            row["error"]
                            if "error" in row
                            else f"{row['us']:.2f} us (scores {row['scores_us']:.2f}) same {row['same']}"
                        ),
                        flush=True,
                    )


def sweep_hc_pre(rows: list) -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    n, D = 4, 4096
    fn = torch.randn(24, n * D, device="cuda", generator=g) * 0.01
    scale = torch.rand(3, device="cuda", generator=g)
    base = torch.randn(24, device="cuda", generator=g) * 0.1
    for T in (1, 16, 64):
        x = torch.randn(T, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
        nbytes = x.numel() * 2 + fn.numel() * 4 + T * D * 2
        for programs in (64, 128, 256, 512, 1024):
            cfg = mhc._mix_config(T, 24, n * D, D, programs)

            def run(cfg=cfg):  # noqa: ANN001, ANN202
                return mhc._hc_collapse(x, fn, scale, base, 1e-6, 1e-6, 20, True, cfg=cfg)

            try:
                us = t_us(run)
            except Exception as e:  # noqa: BLE001
                rows.append({"op": "hc_pre", "T": T, "programs": programs, "error": str(e)[:80]})
                continue
            rows.append(
                {
                    "op": "hc_pre",
                    "T": T,
                    "programs": programs,
                    "cfg": str(cfg),
                    "us": us,
                    "gbps": nbytes / us / 1e3,
                }
            )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--only", default="attn,indexer,hc_pre")
    ns = p.parse_args()
    rows: list = []
    parts = {
        "attn": sweep_attn,
        "indexer": sweep_indexer,
        "hc_pre": sweep_hc_pre,
        "stages": sweep_index_stages,
    }
    for name in ns.only.split(","):
        parts[name](rows)
        best: dict = {}
        for r in rows:
            if "us" in r and r["op"].startswith(("sparse", "index_scores", "hc_pre")):
                key = (r["op"], r["T"])
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
        for (op, T), r in sorted(best.items()):
            if op.startswith(
                {"attn": "sparse", "indexer": "index", "hc_pre": "hc_pre", "stages": "-"}[name]
            ):
                print(f"best {op} T={T}: {r['us']:.2f} us {r.get('gbps') or 0:.0f} GB/s {r}")
        for r in rows:
            if r["op"] == "index_topk(default)":
                print(f"{r['op']} T={r['T']}: {r['us']:.2f} us")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
