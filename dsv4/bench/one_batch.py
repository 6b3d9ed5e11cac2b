"""`dsv4 bench one-batch`: SGLang's bench_one_batch on dsv4's engine. One static batch of random
prompts runs through the real engine (the checkpoint's weights, its state, CUDA graphs where
the engine uses them): the whole batch's prefill in one step, then decode steps until every
sequence has output_len tokens. It prints the lines users of `sglang.bench_one_batch` grep:

  Prefill. latency: 0.12345 s, throughput:   8123.40 token/s
  Decode 0. Batch size: 8, latency: 0.01234 s, throughput:    648.30 token/s
  Decode.  median latency: 0.01230 s, median throughput:    650.41 token/s
  Total. latency:  1.234 s, throughput:   1234.56 token/s

(prefill throughput: batch x input_len / prefill latency; decode: batch / step latency; total:
batch x (input_len + output_len) / total latency), after a warm-up run of the same shapes, and
writes the measurements as JSON lines (--json), one per (batch, input_len) case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

DECODE_LINES = 5  # decode steps printed one by one (as SGLang prints its first ones)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from dsv4.cli import _engine_flags

    p = argparse.ArgumentParser(prog="dsv4 bench one-batch", description=__doc__.split("\n")[0])
    _engine_flags(p)
    p.add_argument(
        "--batch-size", type=int, nargs="+", default=[1], help="sequences (several: a case each)"
    )
    p.add_argument("--input-len", type=int, nargs="+", default=[1024], help="prompt tokens")
    p.add_argument("--output-len", type=int, default=16, help="generated tokens a sequence")
    p.add_argument("--seed", type=int, default=0, help="the random prompts' seed")
    p.add_argument("--json", default=None, help="append the results as JSON lines here")
    a = p.parse_args(argv)
    for name in ("batch_size", "input_len"):
        if min(getattr(a, name)) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.output_len < 1:
        p.error("--output-len must be >= 1")
    # room for the largest case: every sequence in one step, the batch's prefill in one step
    a.max_seqs = max(a.max_seqs, max(a.batch_size))
    a.max_seq_len = max(a.max_seq_len, max(a.input_len) + a.output_len)
    a.max_step_tokens = max(a.max_step_tokens, max(a.batch_size) * max(a.input_len))
    a.chunk_size = max(a.chunk_size or 0, max(a.input_len))
    a.enable_prefix_caching = False  # (the warm-up's prompts would be found again)
    return a


def run_once(llm, batch: int, input_len: int, output_len: int, seed: int, report: bool) -> dict:  # noqa: ANN001
    """One static batch through the engine; the measurements (SGLang's names)."""
    from dsv4.sampling import SamplingParams

    engine, vocab = llm.engine, llm.args.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (batch, input_len), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    pending = {engine.add_request(p, params) for p in prompts}
    t0 = time.perf_counter()
    while pending:  # the prefill: until every sequence has its first token
        pending -= {o.request_id for o in engine.step() if o.token_ids}
    prefill = time.perf_counter() - t0
    decode = []
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - t)
    total = prefill + sum(decode)
    res = {
        "batch_size": batch,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill,
        "prefill_throughput": batch * input_len / prefill,
        "decode_steps": len(decode),
        "total_latency": total,
        "overall_throughput": batch * (input_len + output_len) / total,
    }
    if decode:
        med = statistics.median(decode)
        res["median_decode_latency"], res["median_decode_throughput"] = med, batch / med
    if report:
        print(
            f"Prefill. latency: {prefill:6.5f} s, throughput: {res['prefill_throughput']:9.2f} token/s"
        )
        for i, d in enumerate(decode[:DECODE_LINES]):
            print(
                f"Decode {i}. Batch size: {batch}, latency: {d:6.5f} s, throughput: {batch / d:9.2f} token/s"
            )
        if decode:
            print(
                f"Decode.  median latency: {med:6.5f} s, median throughput: {batch / med:9.2f} token/s"
            )
        print(
            f"Total. latency: {total:6.3f} s, throughput: {res['overall_throughput']:9.2f} token/s"
        )
    return res


def main(argv: list[str]) -> int:
    from dsv4.cli import build_llm

    a = parse_args(argv)
    try:
        llm = build_llm(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"dsv4 bench one-batch: error: {e}", file=sys.stderr)
        return 2
    results = []
    with torch.inference_mode():
        for batch in a.batch_size:
            for input_len in a.input_len:
                print(f"batch {batch}, input {input_len}, output {a.output_len}: warm-up ...")
                run_once(llm, batch, input_len, min(a.output_len, 4), a.seed + 1, report=False)
                print("Benchmark ...")
                results.append(run_once(llm, batch, input_len, a.output_len, a.seed, report=True))
    llm.close()
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        with open(a.json, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return 0
