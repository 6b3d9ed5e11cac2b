"""The periodic engine line (`StatsLogger`, vLLM's format) and the server task that logs it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from dsv4 import server as server_mod
from dsv4.engine import EngineStats
from dsv4.metrics import ServerMetrics, StatsLogger
from dsv4.tiny import make_tiny, tiny_args
from tests.serving import in_process


def _stats(**kw) -> EngineStats:  # noqa: ANN003
    base = dict(num_running=2, num_waiting=1, num_pages=10, num_free_pages=6, num_preemptions=0)
    return EngineStats(**(base | kw))


def test_the_line_from_counters_and_stats() -> None:
    m = ServerMetrics("m")
    logger = StatsLogger(m, now=0.0)
    m.prompt_tokens, m.generation_tokens = 1000, 50
    lines = logger.lines(
        _stats(prefix_cache_queries=1000, prefix_cache_hits=250, num_drafts=10,
               num_draft_tokens=20, num_accepted_tokens=5, num_accepted_per_pos=(4, 1)),
        now=5.0,
    )  # fmt: skip
    assert lines == [
        "Engine 000: Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: 10.0 "
        "tokens/s, Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 40.0%, Prefix cache hit "
        "rate: 25.0%",
        "SpecDecoding metrics: Mean acceptance length: 1.50, Accepted: 5 tokens, Drafted: 20 "
        "tokens, Acceptance rate: 25.0%, Per-position acceptance rate: 0.400, 0.100",
    ]
    # the next interval counts from here: nothing new and nothing running -> no line
    assert logger.lines(_stats(num_running=0, num_waiting=0, num_drafts=10), now=10.0) == []
    m.generation_tokens += 30
    st = _stats(
        num_drafts=10, num_draft_tokens=20, num_accepted_tokens=5, num_accepted_per_pos=(4, 1)
    )
    (line,) = logger.lines(st, 13.0)
    # an interval's per-position rates count its own drafts only
    st = _stats(
        num_drafts=20, num_draft_tokens=40, num_accepted_tokens=11, num_accepted_per_pos=(9, 2)
    )
    assert logger.lines(st, 14.0)[1].endswith("Per-position acceptance rate: 0.500, 0.100")
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 10.0" in line
    assert "Prefix cache hit rate: 0.0%" in line


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:  # noqa: ANN001
    return make_tiny(tmp_path_factory.mktemp("m"), tiny_args(vocab_size=300))


def test_server_logs_the_line_while_busy(model_dir: Path, monkeypatch, caplog) -> None:  # noqa: ANN001
    monkeypatch.setattr(server_mod, "STATS_INTERVAL", 0.05)
    server, ac = in_process(model_dir, max_seqs=2)
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}

    async def go() -> tuple[int, int]:
        async with ac:
            task = asyncio.create_task(server_mod.log_stats(server))
            status = (await ac.post("/v1/completions", json=body)).status_code
            during = len(_lines(caplog))
            await asyncio.sleep(0.3)  # six intervals, idle after the first
            task.cancel()
            return status, during

    with caplog.at_level(logging.INFO, logger="dsv4"):
        try:
            status, during = asyncio.run(go())
        finally:
            server.shutdown()
    lines = _lines(caplog)
    # at most the interval the request finished in, then nothing (idle intervals log no line)
    assert status == 200 and lines and len(lines) - during <= 1
    assert "Avg generation throughput" in lines[-1] and "Running: 0 reqs" in lines[-1]
    assert sum(float(ln.split("generation throughput: ")[1].split()[0]) for ln in lines) > 0


def _lines(caplog) -> list[str]:  # noqa: ANN001
    return [r.getMessage() for r in caplog.records if "Engine 000" in r.getMessage()]


def test_request_phase_histograms(monkeypatch) -> None:  # noqa: ANN001
    # vLLM's request histograms from one traced request on a fake clock: queued 0.5 s, first
    # token 0.2 s after its first step, 3 tokens over 0.6 s more; an abort records none of them
    from dsv4 import metrics as metrics_mod
    from dsv4.engine import RequestOutput

    clock = iter([10.0, 10.7, 11.0, 11.3])
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: next(clock))
    m = ServerMetrics("m")
    trace = m.track()  # arrival 10.0
    out = RequestOutput("r", [1] * 7, token_ids=[5], delta_token_ids=[5])
    out.first_scheduled_time = 10.5
    trace.observe(out)  # 10.7: first token
    out.token_ids, out.delta_token_ids = [5, 6], [6]
    trace.observe(out)  # 11.0
    out.token_ids, out.delta_token_ids, out.finish_reason = [5, 6, 7], [7], "length"
    trace.observe(out)  # 11.3: last

    def one(h) -> float:  # noqa: ANN001
        assert h.count == 1
        return h.sum

    assert one(m.phase["queue"]) == pytest.approx(0.5)
    assert one(m.phase["prefill"]) == pytest.approx(0.2)
    assert one(m.phase["decode"]) == pytest.approx(0.6)
    assert one(m.phase["inference"]) == pytest.approx(0.8)
    assert one(m.request_tpot) == pytest.approx(0.3)
    assert one(m.request_prompt) == 7 and one(m.request_generation) == 3
    text = m.render(_stats())
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "iteration_tokens_total"):  # fmt: skip
        assert f"# TYPE vllm:{name} histogram" in text
    assert 'vllm:request_prompt_tokens_bucket{model_name="m",engine="0",le="5.0"} 0' in text
    assert 'vllm:request_prompt_tokens_bucket{model_name="m",engine="0",le="10.0"} 1' in text
    assert 'vllm:gpu_cache_usage_perc{model_name="m",engine="0"} 0.4' in text
    clock = iter([20.0, 20.5])
    m.track().close()  # aborted before a token
    assert m.phase["queue"].count == 1 and m.finished["abort"] == 1


def test_served_steps_fill_the_iteration_histogram(model_dir: Path) -> None:
    # the server hands the engine its iteration histogram: every step's token count
    server, ac = in_process(model_dir, max_seqs=2)
    body = {"prompt": [3, 4, 5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def go() -> tuple[int, str]:
        async with ac:
            status = (await ac.post("/v1/completions", json=body)).status_code
            return status, (await ac.get("/metrics")).text

    try:
        status, text = asyncio.run(go())
    finally:
        server.shutdown()
    h = server.metrics.iteration
    assert status == 200 and h.count == 4 and h.sum == 5 + 3  # the prompt, then a token a step
    assert server.metrics.phase["decode"].count == 1 and server.metrics.request_generation.sum == 4
    assert (
        "vllm:iteration_tokens_total_count" in text
        and "vllm:request_queue_time_seconds_sum" in text
    )


def test_late_compiles_counter() -> None:
    # a GPU server's compile watch is rendered as a counter; without one (CPU, or loading) none
    from dsv4.ops.device import CompileWatch

    m = ServerMetrics("m")
    assert "dsv4:late_compiles" not in m.render(None)
    m.late_compiles = CompileWatch(logging.getLogger("test"))
    m.late_compiles(fn=None, key="", repr="k")
    text = m.render(None)
    assert "# TYPE dsv4:late_compiles counter" in text
    assert 'dsv4:late_compiles_total{model_name="m",engine="0"} 1' in text
