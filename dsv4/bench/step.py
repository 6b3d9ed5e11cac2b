"""`dsv4 bench step`: decode step and prefill of a random-weight model at real width, by layer.

Builds a few layers (default: one sliding, one CSA, one HCA) with packed release-format weights
(FP8 128x128 UE8M0 projections, MXFP4 experts) filled with random bytes on the device, fills a
static-paged DecodeState with random entries as if `context` tokens were already held, and times
one decode step of `batch` sequences at position `context` (`context` tokens in the state, the new
one makes context + 1). Each layer is timed by marks at its Block's forward hooks (CUDA events on
a GPU, the host clock on the CPU); "rest" is the step minus its layers: batch prep (Batch.build and
the index lists every layer shares), embedding, hc_head, norm, head and logits. The projection to
the full model is rest + sum over the target schedule (Flash: 43 layers) of the median time of each
layer's type. MoE: layers are top-k routed unless asked for as `name:hash`; a target layer whose
exact (type, MoE) was not measured uses the same type with the other MoE (listed in the JSON).
Prefill: one sequence, chunked like the engine (--chunk, default 2048; 0 = one chunk).
--prefill-context L: one chunk of --chunk tokens of a sequence already holding L tokens (the state
filled at random, as a decode run's): what a long prompt's late chunks cost, whose indexer sees
L/4 entries a token (sliced past `state.ENTRY_TABLE_ELEMENTS`).
Speculative decoding (--draft-tokens K): each sequence runs 1 + K tokens a step, the pending
token and K drafts, as the engine's verify step; tok/s counts one token a sequence (no draft
accepted: each accepted draft adds one), and the floor is that of batch x (1 + K) tokens.

JSON (--json); times in seconds, STATS = {median_s, min_s, max_s, samples}:
  schema "dsv4.bench.step/1"; env {git_sha, date, device, device_name, torch, triton, transformers}
  config {preset, layer_keys, batch, context, prefill, chunk, ops, dtype, repeat, warmup, cycle,
          profile, profile_steps, hf, hf_max_gb, seed, model_args, floor_gpu, hf_weights, ...}
  projection {n_layers, target {key: n}, counts {measured key: n} | null, substitutions, missing}
  prefill TIMING + {tokens, chunk, chunks} | null
  prefill_at [TIMING + {context, tokens}]       (--prefill-context; a failed one: {context, error})
  runs [TIMING + {batch, context, positions, distinct_experts {key: n},
                  floor {gpu, floor_s, total_bytes, gbps}, roofline {step_s, components?},
                  breakdown?, hf?, graph?}]        (a failed run: {batch, context, error})
  graph = TIMING + {x_floor} (--graph: CUDA graphs of the step and of each layer, device time
          only, dsv4/bench/graph.py) | {error} | {skipped}
  TIMING = {layers {key: STATS}, rest STATS, step STATS, rest_detail {batch_prep_s, embed_s,
            head_s}, projected_s, projected_spread {min_s, max_s}, tok_per_s}
  breakdown = {per_layer {key: {category: s}}, rest {category: s}, projected {category: s},
               roofline {component: s}, mode, unattributed_s, other_top [[name, s]]}
  hf = TIMING + {context, prefilled, note, experts_implementation, ratio_ours_over_hf} | {error}
`dsv4 roofline --batch B --context L --bench FILE` reads runs[(B, L)].roofline.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from dsv4.bench import breakdown as bd
from dsv4.bench.report import environment, print_report
from dsv4.bench.timing import Clock, measure, projection_plan, with_projection
from dsv4.config import CSA, HASH_MOE, HCA, KV_CACHE_DTYPES, MOE, SLIDING, ModelArgs, flash_args
from dsv4.model import Transformer
from dsv4.state import Batch, DecodeState

LAYER_NAMES = {"sliding": SLIDING, "csa": CSA, "hca": HCA}
TYPE_NAMES = {v: k for k, v in LAYER_NAMES.items()}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PRESET_DEFAULTS = {  # batch, context, prefill
    "flash": ("1,16,64", "4096,131072", 4096),
    "tiny": ("1,4", "64,256", 64),
}
FLOOR_GPU = "H200"


# ---- arguments ------------------------------------------------------------------------------


def _layer_list(text: str) -> tuple[tuple[str, str], ...]:
    if text == "all":  # Flash's own 43-layer schedule: the whole model, nothing projected
        f = flash_args()
        return tuple(zip(f.layer_types, f.mlp_layer_types))
    out = []
    for item in text.split(","):
        name, _, mlp = item.strip().partition(":")
        if name not in LAYER_NAMES or mlp not in ("", "moe", "hash"):
            raise argparse.ArgumentTypeError(
                f"unknown layer {item!r}: use sliding, csa or hca, optionally with :hash or :moe"
            )
        out.append((LAYER_NAMES[name], HASH_MOE if mlp == "hash" else MOE))
    return tuple(out)


def _int_list(what: str, low: int):  # noqa: ANN202
    def parse(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{what} must be comma-separated ints, got {text!r}"
            ) from None
        bad = [v for v in vals if v < low]
        if bad:
            raise argparse.ArgumentTypeError(f"{what} must be >= {low}, got {bad}")
        return vals

    return parse


def _int_at_least(what: str, low: int):  # noqa: ANN202
    def parse(text: str) -> int:
        (v,) = _int_list(what, low)(text)
        return v

    return parse


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="dsv4 bench step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESET_DEFAULTS),
        default="flash",
        help="flash: real DeepSeek-V4-Flash width; tiny: dsv4.tiny shapes (CPU/CI)",
    )
    p.add_argument(
        "--layers",
        type=_layer_list,
        default=_layer_list("sliding,csa,hca"),
        help="layers to build, e.g. sliding,csa,hca or sliding:hash,csa,hca; all: Flash's 43",
    )
    p.add_argument("--batch", type=_int_list("batch sizes", 1), help="e.g. 1,16,64")
    p.add_argument(
        "--context", type=_int_list("contexts", 1), help="tokens already held, e.g. 4096"
    )
    p.add_argument(
        "--prefill",
        type=_int_at_least("--prefill", 0),
        help="prefill tokens of one sequence (0: skip)",
    )
    p.add_argument(
        "--prefill-context",
        type=_int_list("contexts", 0),
        default=[],
        help="also time one chunk of --chunk tokens of a sequence already holding this many "
        "tokens, e.g. 131072,1048576 (a long prompt's late chunks)",
    )
    p.add_argument(
        "--chunk",
        type=_int_at_least("--chunk", 0),
        default=2048,
        help="prefill chunk (the engine's default: its step budget, 2048; 0: one chunk)",
    )
    p.add_argument("--ops", choices=["ref", "triton"], default="ref")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="attention state: the compute dtype, or FP8 entries (584 B at Flash width)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--repeat",
        type=_int_at_least("--repeat", 1),
        default=5,
        help="timed steps (median, min, max reported)",
    )
    p.add_argument("--warmup", type=_int_at_least("--warmup", 1), default=2)
    p.add_argument(
        "--cycle",
        type=_int_at_least("--cycle", 1),
        default=1,
        help="average each timed step over positions context..context+cycle-1 "
        "(4: CSA windows close on one step in four, as in real decode)",
    )
    p.add_argument(
        "--profile", action="store_true", help="per-op-category breakdown (decode and prefill)"
    )
    p.add_argument(
        "--graph",
        action="store_true",
        help="also time the decode step as CUDA graphs (device time, no host launch cost; GPU)",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="also write a torch.profiler chrome trace of one step per run (FILE.bB.cL.json)",
    )
    p.add_argument(
        "--profile-steps",
        type=_int_at_least("--profile-steps", 1),
        default=1,
        help="profiled steps per (batch, context), averaged",
    )
    p.add_argument(
        "--draft-tokens",
        type=_int_at_least("--draft-tokens", 0),
        default=0,
        help="speculative decoding's verify step: 1 + K tokens per sequence (default 0: decode)",
    )
    p.add_argument("--hf", action="store_true", help="also time transformers' DeepseekV4")
    p.add_argument(
        "--hf-max-gb",
        type=float,
        default=48.0,
        help="halve transformers' context until its decode transient fits (GB)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=_int_at_least("--tensor-parallel-size", 1),
        default=1,
        help="ranks (one GPU each, started here): each times its part of the step with the "
        "all-reduces; rank 0 reports",
    )
    p.add_argument("--json", help="write all results here")
    a = p.parse_args(argv)
    if a.tensor_parallel_size > 1 and (a.hf or a.profile or a.trace):
        p.error("--tensor-parallel-size times our step only: no --hf, --profile or --trace")
    if a.prefill_context and not a.chunk:
        p.error("--prefill-context times one chunk: give --chunk > 0")
    if a.draft_tokens and a.hf:
        p.error("--draft-tokens times our verify step only: no --hf")
    batch, context, prefill = PRESET_DEFAULTS[a.preset]
    a.batch = a.batch or _int_list("batch sizes", 1)(batch)
    a.context = a.context or _int_list("contexts", 1)(context)
    a.prefill = prefill if a.prefill is None else a.prefill
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: CUDA is not available on this machine")
    if a.ops == "triton" and a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--ops triton on the CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return a


# ---- model ----------------------------------------------------------------------------------


def layer_key(kind: str, mlp: str) -> str:
    return TYPE_NAMES[kind] + (":hash" if mlp == HASH_MOE else "")


def bench_args(
    preset: str, layers: tuple[tuple[str, str], ...], tp: int = 1
) -> tuple[ModelArgs, ModelArgs]:
    """(the benchmarked layers, the full model they are projected to: Flash's 43-layer schedule).
    Tiny shapes split over ranks keep bf16 projections: their parts are not whole FP8 blocks."""
    flash = flash_args().replace(n_mtp_layers=0)
    if preset == "flash":
        base = flash
    else:
        from dsv4.tiny import tiny_args

        base = tiny_args(vocab_size=1024, n_mtp_layers=0)
        if tp > 1:
            base = base.replace(weight_dtype="bf16")
    kinds, mlps = zip(*layers)
    bench = base.replace(n_layers=len(layers), layer_types=kinds, mlp_layer_types=mlps)
    full = base.replace(
        n_layers=flash.n_layers,
        layer_types=flash.layer_types,
        mlp_layer_types=flash.mlp_layer_types,
    )
    return bench, full


# ---- our model ------------------------------------------------------------------------------


class NonFinite(RuntimeError):
    """Random-weight activations overflowed: the timing would not be representative."""


def _check_finite(logits: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(logits).all()):
        bad = int((~torch.isfinite(logits)).sum())
        raise NonFinite(f"{what}: {bad} of {logits.numel()} logits are not finite")


def decode_stepper(
    model: Transformer,
    state: DecodeState,
    batch: int,
    context: int,
    ids: torch.Tensor,
    clock: Clock,
    q: int = 1,
):  # noqa: ANN201
    """One step of `batch` sequences, q tokens each (1: decode; more: a verify step)."""
    args, checked = model.args, []

    def step(j: int) -> None:
        clock.mark("start")
        b = Batch.build(list(range(batch)), [context + j] * batch, [q] * batch, state)
        b.prepare(args)  # the shared index lists: their cost lands in 'rest'
        clock.mark("batch")
        logits = model.logits(model(ids, b, state))
        clock.mark("end")
        if not checked:
            _check_finite(logits, f"decode batch={batch} context={context}")
            checked.append(True)

    return step


def prefill_stepper(
    model: Transformer, state: DecodeState, ids: torch.Tensor, chunk: int, clock: Clock
):  # noqa: ANN201
    n, checked = ids.numel(), []

    def step(j: int) -> None:
        clock.mark("start")
        for s in range(0, n, chunk):
            b = Batch.build([0], [s], [min(chunk, n - s)], state)
            h = model(ids[s : s + chunk], b, state)
        logits = model.logits(h[-1:])
        clock.mark("end")
        if not checked:
            _check_finite(logits, f"prefill of {n} tokens")
            checked.append(True)

    return step


def distinct_experts(model: Transformer, step, keys: list[str]) -> dict[str, float]:  # noqa: ANN001
    """Mean distinct routed experts per layer of each key in one step (a sync; not timed)."""
    seen: dict[int, int] = {}
    hooks = [
        layer.ffn.gate.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(i, int(out[1].unique().numel()))
        )
        for i, layer in enumerate(model.layers)
    ]
    try:
        step(0)
    finally:
        for h in hooks:
            h.remove()
    return {
        k: statistics.mean(seen[i] for i, kk in enumerate(keys) if kk == k)
        for k in dict.fromkeys(keys)
    }


# ---- main -----------------------------------------------------------------------------------


class Bench:
    """Our model (and transformers', with --hf), built once; runs prefill and decode cases."""

    def __init__(self, a: argparse.Namespace) -> None:
        from dsv4 import parallel
        from dsv4.bench.weights import init_random_
        from dsv4.ops import select

        self.par = parallel.from_env() if a.tensor_parallel_size > 1 else parallel.Parallel()
        device = parallel.init(self.par, a.device)  # cuda -> cuda:<rank>
        self.a, self.device, self.dtype = a, torch.device(device), DTYPES[a.dtype]
        self.args, self.full = bench_args(a.preset, a.layers, a.tensor_parallel_size)
        self.keys = [layer_key(k, m) for k, m in a.layers]
        target = [layer_key(k, m) for k, m in zip(self.full.layer_types, self.full.mlp_layer_types)]
        self.plan = projection_plan(self.keys, target)
        self.counts = self.plan["counts"]
        ops = select(a.ops)
        t0 = time.perf_counter()
        with torch.device(self.device):
            self.model = Transformer(
                self.args, self.dtype, quantized=True, ops=ops, par=self.par
            ).eval()
        # one seed on every rank: the replicated weights (router, indexer, embedding, ...) agree,
        # so every rank routes and selects as the others do
        init_random_(self.model, a.seed)
        self.build_s = time.perf_counter() - t0
        self.hf = None
        if a.hf:
            from dsv4.bench.hf import build_hf

            self.hf = build_hf(self.args, self.dtype, self.device, self.model)
        self.clock = Clock(self.device, self.model.layers)
        self.g = torch.Generator(device=self.device).manual_seed(a.seed)

    def prefill(self) -> dict:
        """One sequence of --prefill tokens in chunks of --chunk (the engine's default 2048)."""
        a = self.a
        chunk = a.chunk or a.prefill
        state = DecodeState(
            self.args, 1, a.prefill + 1, self.dtype, self.device, kv_format=a.kv_cache_dtype
        )
        ids = torch.randint(
            0, self.args.vocab_size, (a.prefill,), device=self.device, generator=self.g
        )
        step = prefill_stepper(self.model, state, ids, chunk, self.clock)
        t = measure(step, self.clock, self.keys, 1, a.repeat, 1)
        t = with_projection(t, self.counts, a.prefill)
        t |= {"tokens": a.prefill, "chunk": chunk, "chunks": -(-a.prefill // chunk)}
        if a.profile:  # the same categories as a decode step's, over the whole prefill
            t["breakdown"] = self.breakdown(step, t)
        return t

    def prefill_at(self, context: int) -> dict:
        """One chunk of --chunk tokens of a sequence already holding `context` tokens."""
        from dsv4.bench.weights import fill_state_

        a, n = self.a, self.a.chunk
        state = DecodeState(
            self.args, 1, context + n, self.dtype, self.device, kv_format=a.kv_cache_dtype
        )
        fill_state_(state, a.seed)
        ids = torch.randint(0, self.args.vocab_size, (n,), device=self.device, generator=self.g)
        step = decode_stepper(self.model, state, 1, context, ids, self.clock, n)
        t = measure(step, self.clock, self.keys, a.warmup, a.repeat, 1)
        return with_projection(t, self.counts, n) | {"context": context, "tokens": n}

    def breakdown(self, step, timing: dict) -> dict:  # noqa: ANN001
        """Per-op-category seconds of `step` (timeline marks), scaled to `timing`'s medians."""
        a = self.a

        def profiled(j: int) -> None:
            step(j % a.cycle)
            self.clock.marks.clear()

        attr = bd.profile(self.model, profiled, a.profile_steps, self.device)
        on_device = self.device.type == "cuda"
        return bd.summarize(attr, self.keys, timing, self.counts, a.profile_steps, on_device)

    def decode(self, batch: int, context: int) -> dict:
        """`batch` sequences holding `context` tokens each, one new token each."""
        from dsv4.bench.weights import fill_state_
        from dsv4.roofline import GPUS, roofline

        a, on_device = self.a, self.device.type == "cuda"
        q = 1 + a.draft_tokens  # tokens per sequence
        run: dict = {
            "batch": batch,
            "context": context,
            "positions": [context, context + a.cycle - 1],
            "tokens_per_seq": q,
        }
        state = DecodeState(
            self.args,
            batch,
            context + a.cycle + q - 1,
            self.dtype,
            self.device,
            kv_format=a.kv_cache_dtype,
            step_rows=batch * q if q > 1 else 0,
        )  # fmt: skip (the engine's: compressor rows for a verify step's tokens)
        fill_state_(state, a.seed)
        n = batch * q
        ids = torch.randint(0, self.args.vocab_size, (n,), device=self.device, generator=self.g)
        step = decode_stepper(self.model, state, batch, context, ids, self.clock, q)
        t = measure(step, self.clock, self.keys, a.warmup, a.repeat, a.cycle)
        run.update(with_projection(t, self.counts, batch))
        run["distinct_experts"] = distinct_experts(self.model, step, self.keys)
        # fp8: 584-B entries and 132-B FP8 indexer keys, as the state
        state_dtype = "fp8" if a.kv_cache_dtype == "fp8" else "bf16"
        fl = roofline(
            self.full,
            n,
            context + q,
            GPUS[FLOOR_GPU],
            state_dtype=state_dtype,
            tp=self.par.world_size,
        )  # fmt: skip (a verify step: as many independent tokens, their state counted each)
        proj = run["projected_s"]
        run["floor"] = {
            "gpu": FLOOR_GPU,
            "floor_s": fl.floor_s,
            "total_bytes": fl.total_bytes,
            "gbps": fl.total_bytes / proj / 1e9 if proj else None,
        }
        run["roofline"] = {"step_s": proj}  # what `dsv4 roofline --bench` reads
        if a.graph:
            run["graph"] = self.decode_graph(state, batch, context, ids, fl.floor_s, q)
        if a.profile:
            run["breakdown"] = b = self.breakdown(step, run)
            if b["roofline"] is not None:
                run["roofline"]["components"] = b["roofline"]
        if a.trace:  # one step under torch.profiler, for drilling into kernels
            path = Path(a.trace).with_suffix(f".b{batch}.c{context}.json")
            with torch.profiler.profile(activities=bd.profile_activities(self.device)) as prof:
                step(0)
                if on_device:
                    torch.cuda.synchronize()
            prof.export_chrome_trace(str(path))
            run["trace"] = str(path)
        return run

    def decode_graph(
        self,
        state: DecodeState,
        batch: int,
        context: int,
        ids: torch.Tensor,
        floor_s: float,
        q: int = 1,
    ) -> dict:
        """The step at position `context` as CUDA graphs: device time without launch cost."""
        from dsv4.bench.graph import graph_measure
        from dsv4.cuda_graphs import graph_key

        if self.device.type != "cuda":
            return {"skipped": "CUDA graphs need a GPU"}
        # the engine's static batch (cuda_graphs.DecodeGraphs), its lists built in the graph
        slots = torch.arange(batch, device=self.device)
        starts = torch.full((batch,), context, device=self.device)
        bound = graph_key(batch, context + q - 1, state.max_seq_len)[1]
        self.clock.paused = True
        try:
            t = graph_measure(
                self.model,
                state,
                lambda: Batch.build_static(slots, starts, state, bound, q),
                ids,
                self.keys,
                self.a.repeat,
            )
        except Exception as e:  # noqa: BLE001  (a host sync left in the forward: not capturable)
            torch.cuda.synchronize()
            return {"error": f"{type(e).__name__}: {e}"[:300]}
        finally:
            self.clock.paused = False
            self.clock.marks.clear()
        t = with_projection(t, self.counts, batch)
        proj = t["projected_s"]
        return t | {"x_floor": proj / floor_s if proj else None}

    def decode_hf(self, run: dict) -> dict:
        from dsv4.bench.hf import time_decode

        a = self.a
        h = time_decode(
            self.hf,
            self.args,
            self.keys,
            self.counts,
            run["batch"],
            run["context"],
            warmup=a.warmup,
            repeat=a.repeat,
            max_gb=a.hf_max_gb,
            seed=a.seed + 1,
        )
        hp, ours = h["projected_s"], run["projected_s"]
        return h | {"ratio_ours_over_hf": ours / hp if hp and ours else None}

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.tensor_parallel_size > 1 and "WORLD_SIZE" not in os.environ:
        import torch.multiprocessing as mp

        from dsv4.parallel import spawn

        try:  # every rank runs this main; rank 0 reports
            spawn(a.tensor_parallel_size, main, argv)
        except mp.ProcessExitedException as e:  # a rank returned nonzero (it printed why)
            return e.exit_code or 1
        return 0
    try:
        bench = Bench(a)
    except Exception as e:  # noqa: BLE001  (--ops triton: import failures, no driver)
        if a.ops != "triton":
            raise
        print(
            f"dsv4 bench step: error: --ops triton is not available: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 2
    res: dict = {
        "schema": "dsv4.bench.step/1",
        "env": environment(bench.device),
        "config": _config(a, bench),
        "projection": bench.plan,
        "prefill": None,
        "prefill_at": [],
        "runs": [],
    }
    failed = []
    try:
        with torch.inference_mode():
            if a.prefill:
                res["prefill"] = bench.prefill()
                bench.free()
            for context in a.prefill_context:
                try:
                    res["prefill_at"].append(bench.prefill_at(context))
                except torch.OutOfMemoryError as e:
                    msg = f"out of memory: {str(e).splitlines()[0]}"
                    res["prefill_at"].append({"context": context, "error": msg})
                    failed.append(f"prefill chunk at context {context}: {msg}")
                bench.free()
            for batch in a.batch:
                for context in a.context:
                    try:
                        run = bench.decode(batch, context)
                    except torch.OutOfMemoryError as e:
                        run = {
                            "batch": batch,
                            "context": context,
                            "error": f"out of memory: {str(e).splitlines()[0]}",
                        }
                        failed.append(f"batch {batch} context {context}: {run['error']}")
                    res["runs"].append(run)
                    bench.free()
                    if bench.hf is not None and "error" not in run:
                        try:
                            run["hf"] = bench.decode_hf(run)
                        except Exception as e:  # noqa: BLE001  (ours is measured: report, go on)
                            run["hf"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                            failed.append(
                                f"hf batch {batch} context {context}: {run['hf']['error']}"
                            )
                        bench.free()
    except NonFinite as e:
        print(f"dsv4 bench step: error: {e}", file=sys.stderr)
        return 1
    finally:
        bench.clock.close()
    if bench.par.rank:  # rank 0 reports
        return 1 if failed else 0
    print_report(res)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    for msg in failed:
        print(f"dsv4 bench step: error: {msg}", file=sys.stderr)
    return 1 if failed else 0


def _config(a: argparse.Namespace, bench: Bench) -> dict:
    keep = (
        "preset",
        "batch",
        "context",
        "prefill",
        "prefill_context",
        "chunk",
        "ops",
        "dtype",
        "repeat",
        "warmup",
        "cycle",
        "profile",
        "graph",
        "trace",
        "profile_steps",
        "hf",
        "hf_max_gb",
        "seed",
        "tensor_parallel_size",
        "draft_tokens",
    )
    return {k: getattr(a, k) for k in keep} | {
        "layer_keys": bench.keys,
        "quantized": True,
        "weight_dtype": bench.args.weight_dtype,
        "expert_dtype": bench.args.expert_dtype,
        "model_args": bench.args.to_dict(),
        "build_s": bench.build_s,
        "floor_gpu": FLOOR_GPU,
        "hf_weights": "transformers' own random init; hash tables copied from ours"
        if a.hf
        else None,
    }
