"""Prometheus metrics in the text exposition format, under vLLM's names (`vllm:`).

One scheme, vLLM's, because dashboards, routers and benchmark tools read it:
  histograms  vllm:time_to_first_token_seconds      arrival -> first token
              vllm:inter_token_latency_seconds      gap between consecutive tokens of a request
              vllm:time_per_output_token_seconds    the same samples under the older name
              vllm:e2e_request_latency_seconds      arrival -> last token (or abort)
              vllm:request_queue_time_seconds       arrival -> first step that runs it
              vllm:request_prefill_time_seconds     that step -> first token
              vllm:request_decode_time_seconds      first token -> last token
              vllm:request_inference_time_seconds   first step -> last token
              vllm:request_time_per_output_token_seconds  decode time / (tokens - 1), a request
              vllm:request_prompt_tokens, vllm:request_generation_tokens   lengths, a request
              vllm:iteration_tokens_total           tokens an engine step runs
                                                    (the request ones at finish, aborts left out)
  gauges      vllm:num_requests_running, vllm:num_requests_waiting
              vllm:kv_cache_usage_perc              fraction (0..1) of decode-state pages in use
              vllm:gpu_cache_usage_perc             the same, its older name (routers read it)
  counters    vllm:prompt_tokens_total, vllm:generation_tokens_total,
              vllm:request_success_total{finished_reason=stop|length|abort},
              vllm:num_preemptions_total, vllm:prefix_cache_queries_total,
              vllm:prefix_cache_hits_total,
              vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
              vllm:spec_decode_num_accepted_tokens_total,
              vllm:spec_decode_num_accepted_tokens_per_pos_total{position=j}
                                                    (MTP speculative decoding; acceptance rate =
                                                    accepted / draft tokens)
Every series carries model_name and engine ("0": one engine), as vLLM's. Updates happen on the
event loop, so nothing is locked; only vllm:iteration_tokens_total is observed on the engine
thread (`Engine.on_step`), whose counts a scrape may read between two of its increments.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict

from dsv4.engine import EngineStats, RequestOutput

# vLLM's bucket edges (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# the request lengths: 1, 2, 5 steps (vLLM's build_1_2_5_buckets) up to 1M tokens
LENGTH_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                     8192.0, 16384.0)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _labels(labels: dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


class Histogram:
    """Cumulative-bucket histogram."""

    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf only
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: dict[str, str]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for edge, n in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            total += n
            lines.append(f"{self.name}_bucket{_labels({**labels, 'le': edge})} {total}")
        lines.append(f"{self.name}_sum{_labels(labels)} {self.sum!r}")
        lines.append(f"{self.name}_count{_labels(labels)} {self.count}")
        return lines


class ServerMetrics:
    """Per-server latency histograms and token counters; engine gauges read at scrape time."""

    def __init__(self, model_name: str) -> None:
        # vLLM's labels: the model, and the engine (one here: "0")
        self.labels = {"model_name": model_name, "engine": "0"}
        self.late_compiles = None  # the server's device.CompileWatch, once it warmed up
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token in seconds (inter-token latency; older name).",
            ITL_BUCKETS,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            E2E_BUCKETS,
        )
        phases = {
            "queue": "Time from arrival to the first engine step that runs the request.",
            "prefill": "Time from the request's first step to its first token.",
            "decode": "Time from the request's first token to its last.",
            "inference": "Time from the request's first step to its last token.",
        }
        self.phase = {
            k: Histogram(f"vllm:request_{k}_time_seconds", h, E2E_BUCKETS)
            for k, h in phases.items()
        }
        self.request_tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Per request: decode time over its tokens after the first.",
            ITL_BUCKETS,
        )
        self.request_prompt = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a finished request.", LENGTH_BUCKETS
        )
        self.request_generation = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens of a finished request.",
            LENGTH_BUCKETS,
        )
        self.iteration = Histogram(
            "vllm:iteration_tokens_total", "Tokens an engine step runs.", ITERATION_BUCKETS
        )
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = defaultdict(int)  # finished_reason -> requests

    def track(self) -> RequestTrace:
        return RequestTrace(self)

    def render(self, stats: EngineStats | None) -> str:
        lb = _labels(self.labels)
        lines: list[str] = []

        def scalar(kind: str, name: str, help_: str, value: float) -> None:
            base = name.removesuffix("_total") if kind == "counter" else name
            lines.extend(
                [f"# HELP {base} {help_}", f"# TYPE {base} {kind}", f"{name}{lb} {value!r}"]
            )

        if stats is not None:  # None while the model loads
            scalar(
                "gauge",
                "vllm:num_requests_running",
                "Requests in the running batch.",
                stats.num_running,
            )
            scalar(
                "gauge", "vllm:num_requests_waiting", "Requests waiting to run.", stats.num_waiting
            )
            for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                scalar(
                    "gauge", name, "Fraction of decode-state pages in use (0-1).", stats.state_usage
                )
            scalar(
                "counter",
                "vllm:num_preemptions_total",
                "Preemptions (recompute).",
                stats.num_preemptions,
            )
            scalar(
                "counter",
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            )
            scalar(
                "counter",
                "vllm:prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache (not run again).",
                stats.prefix_cache_hits,
            )
            scalar(
                "counter",
                "vllm:spec_decode_num_drafts_total",
                "Speculative verifications (a sequence's drafts of one step).",
                stats.num_drafts,
            )
            scalar(
                "counter",
                "vllm:spec_decode_num_draft_tokens_total",
                "Speculative draft tokens verified.",
                stats.num_draft_tokens,
            )
            scalar(
                "counter",
                "vllm:spec_decode_num_accepted_tokens_total",
                "Speculative draft tokens accepted.",
                stats.num_accepted_tokens,
            )
            if stats.num_accepted_per_pos:
                name = "vllm:spec_decode_num_accepted_tokens_per_pos"
                lines += [f"# HELP {name} Accepted draft tokens by position in the draft.",
                          f"# TYPE {name} counter"]  # fmt: skip
                for j, n in enumerate(stats.num_accepted_per_pos):
                    labels = _labels({**self.labels, "position": str(j)})
                    lines.append(f"{name}_total{labels} {n}")
        if self.late_compiles is not None:  # (a GPU server after its warm-up)
            scalar(
                "counter",
                "dsv4:late_compiles_total",
                "Triton compiles met by served steps after the warm-up (each a stall).",
                self.late_compiles.count,
            )
        scalar(
            "counter", "vllm:prompt_tokens_total", "Prefilled prompt tokens.", self.prompt_tokens
        )
        scalar(
            "counter", "vllm:generation_tokens_total", "Generated tokens.", self.generation_tokens
        )
        lines += [
            "# HELP vllm:request_success Finished requests by finish reason.",
            "# TYPE vllm:request_success counter",
        ]
        for reason in sorted({"stop", "length", "abort"} | set(self.finished)):
            labels = _labels({**self.labels, "finished_reason": reason})
            lines.append(f"vllm:request_success_total{labels} {self.finished[reason]}")
        for h in (self.ttft, self.itl, self.tpot, self.e2e, *self.phase.values(),
                  self.request_tpot, self.request_prompt, self.request_generation, self.iteration):  # fmt: skip
            lines += h.render(self.labels)
        return "\n".join(lines) + "\n"


class RequestTrace:
    """Times one request from arrival: feed it every RequestOutput, close it at the end."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last: float | None = None  # time of the latest token
        self.first: float | None = None  # of the first token
        self.scheduled: float | None = None  # of the first engine step that ran the request
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        m, now = self.metrics, time.monotonic()
        if self.last is None:
            m.ttft.observe(now - self.arrival)
            m.prompt_tokens += len(out.prompt_token_ids)
            self.first = now
            # the engine's clock (time.monotonic, this process); never before the arrival here
            self.scheduled = min(max(out.first_scheduled_time or now, self.arrival), now)
            m.phase["queue"].observe(self.scheduled - self.arrival)
            m.phase["prefill"].observe(now - self.scheduled)
        else:
            m.itl.observe(now - self.last)
            m.tpot.observe(now - self.last)
        m.generation_tokens += len(out.delta_token_ids)
        self.last = now
        if out.finished:
            self._finish(out.finish_reason or "stop", now, out)

    def close(self) -> None:
        """End of the response: a request that never finished was aborted (client gone)."""
        if not self.done:
            self._finish("abort", time.monotonic())

    def _finish(self, reason: str, now: float, out: RequestOutput | None = None) -> None:
        m = self.metrics
        self.done = True
        m.finished[reason] += 1
        m.e2e.observe(now - self.arrival)
        if out is None or self.first is None:  # aborted: no request histograms (as vLLM)
            return
        decode = now - self.first
        m.phase["decode"].observe(decode)
        m.phase["inference"].observe(now - self.scheduled)
        n = len(out.token_ids)
        if n > 1:
            m.request_tpot.observe(decode / (n - 1))
        m.request_prompt.observe(len(out.prompt_token_ids))
        m.request_generation.observe(n)


class StatsLogger:
    """vLLM's periodic engine line, from the server's token counters and the engine's stats:
    "Engine 000: Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s,
    Running: N reqs, Waiting: M reqs, GPU KV cache usage: Z%, Prefix cache hit rate: H%" (the
    rates over the interval; prompt tokens: those of the requests that started in it), then,
    with speculative decoding, a "SpecDecoding metrics" line. Nothing for an idle interval."""

    def __init__(self, metrics: ServerMetrics, now: float | None = None) -> None:
        self.metrics = metrics
        self._at = time.monotonic() if now is None else now
        self._tokens = (metrics.prompt_tokens, metrics.generation_tokens)
        self._stats: EngineStats | None = None

    def lines(self, stats: EngineStats, now: float) -> list[str]:
        m, (p0, g0), prev = self.metrics, self._tokens, self._stats
        dt = max(now - self._at, 1e-9)
        p, g = m.prompt_tokens, m.generation_tokens
        self._at, self._tokens, self._stats = now, (p, g), stats
        if p == p0 and g == g0 and not stats.num_running and not stats.num_waiting:
            return []

        def delta(name: str) -> float:
            return getattr(stats, name) - (getattr(prev, name) if prev is not None else 0)

        queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
        out = [
            f"Engine 000: Avg prompt throughput: {(p - p0) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {(g - g0) / dt:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"GPU KV cache usage: {100 * stats.state_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"
        ]
        drafts, drafted = delta("num_drafts"), delta("num_draft_tokens")
        if drafts:
            accepted = delta("num_accepted_tokens")
            before = prev.num_accepted_per_pos if prev is not None else ()
            per_pos = ", ".join(
                f"{(n - (before[j] if j < len(before) else 0)) / drafts:.3f}"
                for j, n in enumerate(stats.num_accepted_per_pos)
            )
            out.append(
                f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted: {accepted:.0f} tokens, Drafted: {drafted:.0f} tokens, "
                f"Acceptance rate: {100 * accepted / drafted:.1f}%"
                + (f", Per-position acceptance rate: {per_pos}" if per_pos else "")
            )
        return out
