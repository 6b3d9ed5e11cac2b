"""One prefill chunk at long context: the peak memory (and time) of a T-token chunk whose tokens
start at position P, with the step's [tokens x visible entries] tables built whole (the code
before `state.ENTRY_TABLE_ELEMENTS`) and in slices (now), side by side in one run.

The tables' sizes depend on T and the context, not on the model's width, so a tiny model with
Flash's compression ratios shows them (the state it needs at 1M context is small). Prints one
line per (context, form) and writes JSON with --out."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from dsv4 import state as state_mod
from dsv4.config import CSA, HCA, SLIDING
from dsv4.llm import LLM
from dsv4.state import Batch, DecodeState, context_table_bytes
from dsv4.tiny import make_tiny, tiny_args


def chunk_at(llm: LLM, start: int, tokens: int) -> tuple[float, float, torch.Tensor]:
    """(GiB allocated at the peak beyond what was held before, ms, the last token's hidden
    state) of one forward of `tokens` tokens at positions start .. start + tokens - 1 on a fresh
    one-sequence state."""
    dev = torch.device(llm.config.device)
    st = DecodeState(llm.args, 1, start + tokens + 1, llm.config.torch_dtype, llm.config.device)
    ids = torch.full((tokens,), 5, device=dev)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    held = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        batch = Batch.build([0], [start], [tokens], st)
        h = llm.model(ids, batch, st)
        llm.model.logits(h[-1:])
    torch.cuda.synchronize(dev)
    ms = (time.perf_counter() - t0) * 1e3
    peak = torch.cuda.max_memory_allocated(dev) - held
    last = h[-1].float().cpu()
    del st, batch, h
    torch.cuda.empty_cache()
    return peak / 2**30, ms, last


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", default="131072,1048576", help="positions before the chunk")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--limits", default="", help="ENTRY_TABLE_ELEMENTS values to try as well")
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    contexts = [int(x) for x in ns.context.split(",")]
    args = tiny_args(
        layer_types=(SLIDING, CSA, HCA, CSA),
        csa_ratio=4,
        hca_ratio=128,
        max_position_embeddings=max(contexts) + ns.chunk + 256,
    )
    d = make_tiny(Path(tempfile.mkdtemp()) / "m", args, seed=1, tokenizer="bytes")
    llm = LLM(d, device="cuda", cuda_graphs=False, progress=False, max_seqs=1, max_seq_len=4096)
    default = state_mod.ENTRY_TABLE_ELEMENTS
    rows = []
    for ctx in contexts:
        outs = {}
        forms = [("whole tables", 1 << 62), ("slices", default)]
        forms += [(f"slices {int(x)}", int(x)) for x in ns.limits.split(",") if x]
        for form, limit in forms:
            state_mod.ENTRY_TABLE_ELEMENTS = limit
            try:
                runs = [chunk_at(llm, ctx, ns.chunk) for _ in range(ns.repeat)]
                gib, ms = max(r[0] for r in runs), sorted(r[1] for r in runs)[len(runs) // 2]
                outs[form] = runs[-1][2]
                base = outs.get("whole tables", outs[form])
                diff = float((outs[form] - base).abs().max())
                line = (f"context {ctx:>8}, chunk {ns.chunk}, {form:<16}: peak {gib:7.2f} GiB, "
                        f"{ms:8.1f} ms, max |h - whole tables'| {diff:.3g}")  # fmt: skip
                rows.append({"context": ctx, "chunk": ns.chunk, "form": form, "peak_gib": gib,
                             "ms": ms, "max_diff": diff})  # fmt: skip
            except torch.OutOfMemoryError as e:
                line = (
                    f"context {ctx:>8}, chunk {ns.chunk}, {form:<16}: out of memory ({str(e)[:80]})"
                )
                rows.append({"context": ctx, "chunk": ns.chunk, "form": form, "oom": True})
                torch.cuda.empty_cache()
            finally:
                state_mod.ENTRY_TABLE_ELEMENTS = default
            print(line, flush=True)
        est = context_table_bytes(args, ns.chunk, ctx + ns.chunk) / 2**30
        print(f"context {ctx:>8}: state.context_table_bytes estimates {est:.2f} GiB", flush=True)
    if ns.out:
        Path(ns.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
