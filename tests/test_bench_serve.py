"""`dsv4 bench serve` against a real `dsv4 serve` process (CPU, tiny model)."""

from __future__ import annotations

import json

import pytest

from dsv4.bench.serve import SPEC, RequestResult, _stats, main, speculative, summarize
from dsv4.tiny import make_tiny, tiny_args
from tests.serving import ServerProcess, scrape


def test_summary_arithmetic():
    rs = [
        RequestResult(True, 8, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestResult(True, 8, output_tokens=3, ttft=0.2, latency=0.4, itl=[0.1, 0.1]),
        RequestResult(False, 8, error="HTTP 500"),
    ]
    s = summarize(rs, duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (16, 8)
    assert s["output_throughput"] == 4.0 and s["request_throughput"] == 1.0
    assert speculative(dict.fromkeys(SPEC, 0.0), dict.fromkeys(SPEC, 0.0)) is None
    sp = speculative(
        dict.fromkeys(SPEC, 1.0), {"drafts": 5, "draft_tokens": 9, "accepted_tokens": 5}
    )
    assert sp["acceptance_rate"] == 0.5 and sp["accept_length"] == 2.0
    assert s["total_token_throughput"] == 12.0
    assert s["tpot"]["mean_ms"] == pytest.approx(1e3 * (0.1 + 0.1) / 2)
    assert s["ttft"]["median_ms"] == pytest.approx(150.0)
    assert _stats([float(i) for i in range(1, 101)])["p99_ms"] == 99e3  # nearest rank


def test_bench_serve_against_the_server(tmp_path, capsys):  # noqa: ANN001
    d = make_tiny(tmp_path / "m", tiny_args(vocab_size=300), seed=1, tokenizer="bytes")
    # (with MTP speculative decoding: the bench reports its acceptance)
    mtp = ("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}')
    srv = ServerProcess(d, tmp_path / "server.log", "--max-seqs", "4", "--max-seq-len", "256", *mtp)
    try:
        out = tmp_path / "bench.json"
        argv = ["--base-url", srv.url, "--num-prompts", "6", "--concurrency", "3"]
        argv += ["--input-len", "8", "--output-len", "4", "--warmup", "2", "--json", str(out)]
        assert main(argv) == 0
        table = capsys.readouterr().out
        m = scrape(srv.url)
        assert main(["--base-url", srv.url, "--model", "nope", "--num-prompts", "1"]) == 2
        assert "does not exist" in capsys.readouterr().err
    finally:
        srv.stop()
    res = json.loads(out.read_text())
    s = res["summary"]
    assert (s["completed"], s["failed"]) == (6, 0)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (48, 24)
    assert s["output_throughput"] == pytest.approx(24 / s["duration_s"])
    assert all(0 < r["ttft"] <= r["latency"] and len(r["itl"]) <= 3 for r in res["requests"])
    assert res["config"]["model_name"] == "m" and res["config"]["request_rate"] is None
    # the server saw exactly the prompts' and outputs' tokens (warm-up included: 8 requests)
    assert m['vllm:prompt_tokens_total{model_name="m",engine="0"}'] == 8 * 8
    assert m['vllm:generation_tokens_total{model_name="m",engine="0"}'] == 8 * 4
    assert "output tokens/s" in table and "TTFT (ms)" in table
    sp = s["speculative"]
    assert sp["drafts"] > 0 and sp["draft_tokens"] <= 2 * sp["drafts"]
    assert 0 <= sp["acceptance_rate"] <= 1 and sp["accept_length"] >= 1
    assert "spec. accept length" in table
    with pytest.raises(SystemExit):
        main(["--concurrency", "0"])
    assert main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_bench_serve_shared_prefix_hits(tmp_path, capsys):  # noqa: ANN001
    # --prefix-len: one shared prefix before every prompt; with the server's prefix caching the
    # bench reports the run's hits (the warm-up request cached the prefix's 256-token block)
    d = make_tiny(tmp_path / "m", tiny_args(vocab_size=300), seed=1, tokenizer="bytes")
    flags = ("--max-seqs", "2", "--max-seq-len", "1024", "--enable-prefix-caching")
    srv = ServerProcess(d, tmp_path / "server.log", *flags)
    try:
        out = tmp_path / "bench.json"
        argv = ["--base-url", srv.url, "--num-prompts", "3", "--concurrency", "1", "--warmup", "1"]
        argv += ["--prefix-len", "260", "--input-len", "8", "--output-len", "2", "--json", str(out)]
        assert main(argv) == 0
        table = capsys.readouterr().out
    finally:
        srv.stop()
    s = json.loads(out.read_text())["summary"]
    assert s["total_input_tokens"] == 3 * 268
    assert s["prefix_cache"] == {"queries": 3 * 268, "hits": 3 * 256, "hit_rate": 256 / 268}
    assert "prefix cache hit rate" in table and "260 shared + 8 in" in table
