"""Per-op-category breakdown of a step: the step's timeline cut at every op and scope boundary.

While `Labels` is active, every op call through the model's ops namespace and every MoE, Indexer,
Compressor and Block forward marks the timeline when it begins and ends (a CUDA event on the
stream on a GPU, the host clock on the CPU). Each interval between two marks belongs to the
innermost category and layer open at its start ("rest" outside layers):
  - sparse_attn -> attention, index_topk -> indexer+top-k, compress_store -> compressor,
    hc_pre / hc_post / hc_post_pre / hc_head -> mHC (whatever scope they run in);
  - anything else inside a MoE / Indexer / Compressor forward -> MoE / indexer+top-k / compressor
    (their GEMMs, gate, norms, RoPE, index arithmetic, host syncs);
  - linear / grouped_linear outside those scopes -> dense GEMMs (wq_a, wq_b, wkv, wo_a, wo_b), and
    the LM head (Transformer.logits);
  - everything else -> other (window/index arithmetic, ring writes, embedding, batch prep, ...).
The intervals partition the step, so the categories sum to it; device idle time waiting for the
host lands in the category whose code was running. (A first version attributed torch.profiler
kernel times through their launching CPU ops: Triton launches have none, so attention and mHC
read 0 on the H200. `dsv4 bench step --trace FILE` still writes a profiler trace for drilling in.)
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace

import torch

from dsv4.model import Compressor, Indexer, MoE, Transformer
from dsv4.ops import OPS

CATEGORIES = ("attention", "indexer+top-k", "compressor", "mHC", "dense GEMMs", "MoE", "other")
NAMED = CATEGORIES[:-1]
OP_CATEGORY = {
    "sparse_attn": "attention",
    "index_topk": "indexer+top-k",
    "compress_store": "compressor",
    "compress_keep": "compressor",
    "hc_pre": "mHC",
    "hc_post": "mHC",
    "hc_post_pre": "mHC",
    "hc_head": "mHC",
}
SCOPE_CATEGORY = ((MoE, "MoE"), (Indexer, "indexer+top-k"), (Compressor, "compressor"))


class Labels:
    """Context manager: timeline marks on the ops namespace (patched in place, restored on exit)
    and on MoE / Indexer / Compressor / Block forwards (hooks, removed on exit)."""

    def __init__(self, model: Transformer, device: torch.device) -> None:
        self.model, self.ops, self.cuda = model, model.ops, device.type == "cuda"
        self.stack: list[tuple[str, int | None, str]] = [("other", None, "")]  # (cat, layer, op)
        self.marks: list = []  # (event | host seconds, cat, layer, op) from here on
        self.saved: dict[str, object] = {}
        self.hooks: list = []

    def mark(self) -> None:
        if self.cuda:
            stamp = torch.cuda.Event(enable_timing=True)
            stamp.record()
        else:
            stamp = time.perf_counter()
        self.marks.append((stamp, *self.stack[-1]))

    def push(self, cat: str | None = None, layer: int | None = None, op: str = "") -> None:
        top_cat, top_layer, top_op = self.stack[-1]
        layer = top_layer if layer is None else layer
        self.stack.append((cat or top_cat, layer, op or top_op))
        self.mark()

    def pop(self) -> None:
        self.stack.pop()
        self.mark()

    def _wrap(self, name: str, fn):  # noqa: ANN001, ANN202
        def call(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            cat = OP_CATEGORY.get(name)
            if cat is None:
                scope = self.stack[-1][0]
                cat = (
                    scope
                    if scope != "other"
                    else ("dense GEMMs" if name in ("linear", "grouped_linear") else "other")
                )
            self.push(cat, op=name)
            try:
                return fn(*args, **kw)
            finally:
                self.pop()

        return call

    def _hooks(self, cat: str | None, layer: int | None):  # noqa: ANN202
        def pre(module, args):  # noqa: ANN001, ANN202
            self.push(cat, layer, type(module).__name__)

        def post(module, args, out):  # noqa: ANN001, ANN202
            self.pop()

        return pre, post

    def __enter__(self) -> Labels:
        for name in OPS:
            self.saved[name] = getattr(self.ops, name)
            setattr(self.ops, name, self._wrap(name, self.saved[name]))
        hooked = [(m, None, i) for i, m in enumerate(self.model.layers)]
        for m in self.model.modules():
            for cls, cat in SCOPE_CATEGORY:
                if isinstance(m, cls):
                    hooked.append((m, cat, None))
        for m, cat, layer in hooked:
            pre, post = self._hooks(cat, layer)
            self.hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        logits = self.model.logits  # the LM head GEMM is a dense GEMM (hc_head inside stays mHC)

        def labelled_logits(h: torch.Tensor) -> torch.Tensor:
            self.push("dense GEMMs", op="logits")
            try:
                return logits(h)
            finally:
                self.pop()

        self.model.logits = labelled_logits
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(self.ops, name, fn)
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        del self.model.logits  # back to the class method


def profile_activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def attribute(marks: list, on_device: bool) -> SimpleNamespace:
    """Seconds per (bucket, category) between consecutive marks of one step; bucket = layer
    index or "rest". Also top[(cat, op)] for the "other" listing."""
    spent: dict = defaultdict(lambda: defaultdict(float))
    top: dict = defaultdict(float)
    for (t0, cat, layer, op), (t1, *_) in zip(marks, marks[1:]):
        s = t0.elapsed_time(t1) * 1e-3 if on_device else t1 - t0
        spent["rest" if layer is None else layer][cat] += s
        top[(cat, op or "(between ops)")] += s
    return SimpleNamespace(time=spent, top=top, device_total_s=None, unattributed_s=0.0)


def profile(
    model: Transformer, step: Callable[[int], None], n_steps: int, device: torch.device
) -> SimpleNamespace:
    """Run `step(0..n_steps-1)` with timeline marks; attribute each step's intervals."""
    total: dict = defaultdict(lambda: defaultdict(float))
    top: dict = defaultdict(float)
    with Labels(model, device) as labels:
        for j in range(n_steps):
            labels.marks = []
            labels.mark()
            step(j)
            labels.mark()
            if device.type == "cuda":
                torch.cuda.synchronize()
            a = attribute(labels.marks, device.type == "cuda")
            for bucket, cats in a.time.items():
                for cat, s in cats.items():
                    total[bucket][cat] += s
            for key, s in a.top.items():
                top[key] += s
    return SimpleNamespace(time=total, top=top, device_total_s=None, unattributed_s=0.0)


def summarize(
    attr: SimpleNamespace,
    keys: list[str],
    timing: dict,
    counts: dict | None,
    n_steps: int,
    on_device: bool,
) -> dict:
    """Seconds per category per layer key, for 'rest', and projected; each sums to its measured
    median (named categories from the profile, 'other' the remainder). On the CPU the profiled
    shares are scaled to the unprofiled median (profiling inflates host time)."""

    def finish(raw: dict[str, float], total: float) -> dict[str, float]:
        # the marks add a little time of their own: shares are scaled to the unmarked median
        named = {c: raw.get(c, 0.0) / n_steps for c in NAMED}
        marked = sum(raw.values()) / n_steps
        named = {c: v * total / marked if marked else 0.0 for c, v in named.items()}
        return named | {"other": total - sum(named.values())}

    per_key = {}
    for k in dict.fromkeys(keys):
        idx = [i for i, kk in enumerate(keys) if kk == k]
        raw = {c: sum(attr.time[i].get(c, 0.0) for i in idx) / len(idx) for c in CATEGORIES}
        per_key[k] = finish(raw, timing["layers"][k]["median_s"])
    rest = finish(dict(attr.time["rest"]), timing["rest"]["median_s"])
    out = {
        "per_layer": per_key,
        "rest": rest,
        "projected": None,
        "roofline": None,
        "mode": "timeline "
        + ("(CUDA events)" if on_device else "(host clock)")
        + ", scaled to the unmarked median",
        "unattributed_s": attr.unattributed_s / n_steps,
        "other_top": [
            [name, s / n_steps]
            for (cat, name), s in sorted(attr.top.items(), key=lambda x: -x[1])
            if cat == "other"
        ][:8],
    }
    if counts is not None:
        proj = {c: rest[c] + sum(n * per_key[k][c] for k, n in counts.items()) for c in NAMED}
        proj["other"] = timing["projected_s"] - sum(proj.values())
        out["projected"] = proj
        layers = {c: sum(n * per_key[k][c] for k, n in counts.items()) for c in CATEGORIES}
        out["roofline"] = {  # `dsv4 roofline --bench` component names
            "attention": proj["attention"],
            # roofline counts the indexer's projections under "compressor": compare the pair
            "compressor+indexer": proj["compressor"] + proj["indexer+top-k"],
            "mhc": proj["mHC"],
            "attn_proj": layers["dense GEMMs"],
            "experts+shared_expert+router": proj["MoE"],
            "head": rest["dense GEMMs"],  # the LM head (Transformer.logits)
            "other": layers["other"] + rest["other"],
        }
    return out
