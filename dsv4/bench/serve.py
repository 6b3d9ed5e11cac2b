"""`dsv4 bench serve`: load on a running OpenAI-compatible server, as `vllm bench serve` and
`sglang.bench_serving` do it.

Prompts are slices of `--input-len` token ids cut from the server's own tokenization of a random
word text (`POST /tokenize`), so every prompt is exactly that many tokens for any tokenizer. Each
request streams `--output-len` tokens (greedy, ignore_eos) from /v1/completions, at most
`--concurrency` in flight, sent at once or at a Poisson `--request-rate`. A warm-up round at full
concurrency goes first and is not counted (the server's own warm-up covers the first position
bound; the decode graphs of later bounds are captured on first use).

Per request: TTFT (send to the first streamed token chunk), ITL (gaps between token chunks), E2E
latency, and TPOT = (E2E - TTFT) / (output tokens - 1) with the token count from the stream's usage
chunk. With speculative decoding on the server, the run's acceptance rate and accept length;
with prefix caching, its hit rate (from its /metrics counters). `--prefix-len` puts one shared
prefix before every prompt (vLLM's --random-prefix-len). Printed as a short table; `--json`
writes the summary and the per-request rows.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field


class BenchError(RuntimeError):
    """The server cannot be benchmarked (unreachable, refuses the workload)."""


@dataclass
class RequestResult:
    ok: bool
    input_tokens: int
    output_tokens: int = 0  # completion_tokens from the usage chunk
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


class Client:
    """Plain HTTP/1.1 (one connection per request) against `base_url`."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        u = urllib.parse.urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise BenchError(f"--base-url must be http(s)://host[:port], got {base_url!r}")
        self.https, self.host, self.port = u.scheme == "https", u.hostname, u.port
        self.prefix, self.timeout = u.path.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def open(self, method: str, path: str, body: dict | None = None):  # noqa: ANN201
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        data = json.dumps(body) if body is not None else None
        conn.request(method, self.prefix + path, data, self.headers)
        return conn, conn.getresponse()

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        return json.loads(self.text(method, path, body))

    def text(self, method: str, path: str, body: dict | None = None) -> str:
        try:
            conn, resp = self.open(method, path, body)
        except (OSError, http.client.HTTPException) as e:
            raise BenchError(f"cannot reach the server at {self.prefix or '/'} ({e})") from e
        try:
            text = resp.read().decode()
        finally:
            conn.close()
        if resp.status != 200:
            raise BenchError(f"{method} {path}: HTTP {resp.status}: {text[:300]}")
        return text


SPEC = ("drafts", "draft_tokens", "accepted_tokens")
# the counters read before and after the run: key -> vLLM's /metrics name
COUNTERS = {name: f"vllm:spec_decode_num_{name}_total" for name in SPEC} | {
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
}


def counters(client: Client) -> dict[str, float]:
    """The server's speculative-decoding and prefix-cache counters (0 where absent)."""
    got = dict.fromkeys(COUNTERS, 0.0)
    for line in client.text("GET", "/metrics").splitlines():
        for key, name in COUNTERS.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                got[key] += float(line.rsplit(" ", 1)[1])
    return got


def prefix_cache(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """The run's prefix-cache lookups (prompt tokens), or None where the server cached nothing."""
    queries = after["prefix_queries"] - before["prefix_queries"]
    if not queries:
        return None
    hits = after["prefix_hits"] - before["prefix_hits"]
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries}


def speculative(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """The run's drafts as vLLM's bench reports them, or None without speculative decoding."""
    d = {k: after[k] - before[k] for k in SPEC}
    if not d["drafts"]:
        return None
    return d | {
        "acceptance_rate": d["accepted_tokens"] / d["draft_tokens"],
        "accept_length": 1 + d["accepted_tokens"] / d["drafts"],  # tokens a verification yields
    }


def make_prompts(
    client: Client, model: str, n: int, input_len: int, seed: int, prefix_len: int = 0
) -> list[list[int]]:
    """n prompts of exactly prefix_len + input_len token ids: windows of the server's
    tokenization of random words (seeded), each after one shared window of prefix_len."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    n_words = 4 * max(input_len, prefix_len)
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(n_words)]
    ids = client.json("POST", "/tokenize", {"model": model, "prompt": " ".join(words)})["tokens"]
    if len(ids) < max(input_len, prefix_len) + 1:
        raise BenchError(f"the text tokenized to {len(ids)} ids, fewer than the lengths asked")
    start = rng.randrange(0, len(ids) - prefix_len) if prefix_len else 0
    prefix = ids[start : start + prefix_len]
    starts = [rng.randrange(0, len(ids) - input_len) for _ in range(n)]
    return [prefix + ids[s : s + input_len] for s in starts]


def one_request(client: Client, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(ok=False, input_tokens=len(prompt))
    t0 = time.perf_counter()
    try:
        conn, resp = client.open("POST", "/v1/completions", body)
    except (OSError, http.client.HTTPException) as e:
        res.error = f"connection: {e}"
        return res
    try:
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read().decode()[:300]}"
            return res
        last = None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[len("data: ") :])
            if ev.get("usage"):
                res.output_tokens = ev["usage"]["completion_tokens"]
            if ev.get("choices"):  # a chunk that carries tokens
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - t0
        res.ok = last is not None and res.output_tokens > 0
        if not res.ok:
            res.error = "the stream carried no tokens or no usage chunk"
    except (OSError, ValueError, http.client.HTTPException) as e:  # a cut or malformed stream
        res.error = f"stream: {e!r}"
    finally:
        conn.close()
    return res


def run(
    client: Client,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    request_rate: float,
    seed: int,
) -> tuple[list[RequestResult], float]:
    """All prompts through the server, at most `concurrency` in flight; (results, seconds)."""
    rng = random.Random(seed + 1)
    gate = threading.Semaphore(concurrency)

    def task(p: list[int]) -> RequestResult:
        try:
            return one_request(client, model, p, output_len)
        finally:
            gate.release()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = []
        for p in prompts:
            gate.acquire()
            futures.append(pool.submit(task, p))
            if request_rate != float("inf"):
                time.sleep(rng.expovariate(request_rate))
        results = [f.result() for f in futures]
    return results, time.perf_counter() - t0


def _stats(xs: list[float]) -> dict[str, float]:
    """mean / median / p99 in milliseconds (nearest-rank p99)."""
    if not xs:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    s = sorted(xs)
    p99 = s[min(len(s) - 1, max(0, -(-99 * len(s) // 100) - 1))]
    return {
        "mean_ms": 1e3 * statistics.fmean(s),
        "median_ms": 1e3 * statistics.median(s),
        "p99_ms": 1e3 * p99,
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.input_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": _stats([r.ttft for r in done]),
        "tpot": _stats(tpot),
        "itl": _stats([g for r in done for g in r.itl]),
        "e2e": _stats([r.latency for r in done]),
    }


def report(s: dict, args: argparse.Namespace) -> str:
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    lines = [
        f"model {args.model_name}, {args.num_prompts} prompts x ("
        + (f"{args.prefix_len} shared + " if args.prefix_len else "")
        + f"{args.input_len} in, "
        f"{args.output_len} out), concurrency {args.concurrency}, request rate {rate}",
        f"{'completed / failed':<28}{s['completed']} / {s['failed']}",
        f"{'duration (s)':<28}{s['duration_s']:.2f}",
        f"{'requests/s':<28}{s['request_throughput']:.2f}",
        f"{'output tokens/s':<28}{s['output_throughput']:.1f}",
        f"{'total tokens/s':<28}{s['total_token_throughput']:.1f}",
        f"{'':<28}{'mean':>10}{'median':>10}{'p99':>10}",
    ]
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E latency"}
    for key, name in names.items():
        v = s[key]
        lines.append(
            f"{name + ' (ms)':<28}{v['mean_ms']:>10.2f}{v['median_ms']:>10.2f}{v['p99_ms']:>10.2f}"
        )
    sp = s.get("speculative")
    if sp:
        lines += [
            f"{'spec. acceptance rate':<28}{100 * sp['acceptance_rate']:.1f}% "
            f"({sp['accepted_tokens']:.0f} of {sp['draft_tokens']:.0f} draft tokens)",
            f"{'spec. accept length':<28}{sp['accept_length']:.2f} tokens a verification",
        ]
    pc = s.get("prefix_cache")
    if pc:
        lines.append(
            f"{'prefix cache hit rate':<28}{100 * pc['hit_rate']:.1f}% "
            f"({pc['hits']:.0f} of {pc['queries']:.0f} prompt tokens)"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsv4 bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", dest="model_name", default=None, help="default: the served model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson, requests/s")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--prefix-len",
        "--random-prefix-len",
        type=int,
        default=0,
        help="a shared prefix of this many tokens before every prompt (vLLM's --random-prefix-len)",
    )
    p.add_argument("--warmup", type=int, default=None, help="requests first (default: concurrency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default=None, help="write the summary and per-request rows here")
    a = p.parse_args(argv)
    for name in ("num_prompts", "concurrency", "input_len", "output_len"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if a.request_rate <= 0:
        p.error("--request-rate must be > 0")
    if a.prefix_len < 0:
        p.error("--prefix-len must be >= 0")
    return a


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    client = Client(args.base_url, args.api_key, args.timeout)
    try:
        if args.model_name is None:
            args.model_name = client.json("GET", "/v1/models")["data"][0]["id"]
        warmup = args.concurrency if args.warmup is None else args.warmup
        prompts = make_prompts(client, args.model_name, warmup + args.num_prompts,
                               args.input_len, args.seed, args.prefix_len)  # fmt: skip
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if warmup:
        first, _ = run(client, args.model_name, prompts[:warmup], args.output_len,
                       args.concurrency, float("inf"), args.seed)  # fmt: skip
        bad = [r.error for r in first if not r.ok]
        if bad:
            print(f"error: warm-up requests failed: {bad[0]}", file=sys.stderr)
            return 2
    try:
        before = counters(client)
        results, duration = run(client, args.model_name, prompts[warmup:], args.output_len,
                                args.concurrency, args.request_rate, args.seed)  # fmt: skip
        after = counters(client)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(results, duration) | {
        "speculative": speculative(before, after),
        "prefix_cache": prefix_cache(before, after),
    }
    print(report(summary, args))
    errors = sorted({r.error for r in results if not r.ok})
    for e in errors[:5]:
        print(f"failed: {e}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            conf = {k: v for k, v in vars(args).items() if k != "api_key"}
            if conf["request_rate"] == float("inf"):
                conf["request_rate"] = None  # all at once (strict JSON has no Infinity)
            rows = [asdict(r) for r in results]
            json.dump({"config": conf, "summary": summary, "requests": rows}, fh, indent=1)
    return 0 if not errors else 1
