"""Per-op-category breakdown of a step from torch.profiler, per layer and for the rest of the step.

While `Labels` is active, every op call through the model's ops namespace and every MoE, Indexer,
Compressor and Block forward runs inside a `record_function` range. A profiled event's time goes to
the innermost category range around it and to the layer range around it ("rest" outside layers):
  - sparse_attn -> attention, index_topk -> indexer+top-k, compress_store -> compressor,
    hc_pre / hc_post / hc_head -> mHC (whatever scope they run in);
  - anything else inside a MoE / Indexer / Compressor forward -> MoE / indexer+top-k / compressor
    (their GEMMs, gate, norms, RoPE, index arithmetic);
  - linear / grouped_linear outside those scopes -> dense GEMMs (wq_a, wq_b, wkv, wo_a, wo_b), and
    the LM head (Transformer.logits);
  - everything else -> other (window/index arithmetic, ring writes, embedding, batch prep, ...).
On a GPU the time is the device time of the kernels each CPU op launched (CUPTI correlation);
kernels that cannot be traced to a CPU op are counted in `unattributed_s` and fall into "other".
On the CPU it is each op's self CPU time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler import record_function

from dsv4.model import Compressor, Indexer, MoE, Transformer
from dsv4.ops import OPS

CATEGORIES = ("attention", "indexer+top-k", "compressor", "mHC", "dense GEMMs", "MoE", "other")
NAMED = CATEGORIES[:-1]
OP_CATEGORY = {
    "sparse_attn": "attention",
    "index_topk": "indexer+top-k",
    "compress_store": "compressor",
    "hc_pre": "mHC",
    "hc_post": "mHC",
    "hc_head": "mHC",
}
SCOPE_CATEGORY = ((MoE, "MoE"), (Indexer, "indexer+top-k"), (Compressor, "compressor"))
_CAT, _LAYER = "dsv4.cat:", "dsv4.layer:"


class Labels:
    """Context manager: record_function labels on the ops namespace (patched in place, restored on
    exit) and on MoE / Indexer / Compressor / Block forwards (hooks, removed on exit)."""

    def __init__(self, model: Transformer) -> None:
        self.model, self.ops = model, model.ops
        self.scopes: list[str] = []  # categories of the enclosing module scopes
        self.ranges: list[record_function] = []
        self.saved: dict[str, object] = {}
        self.hooks: list = []

    def _wrap(self, name: str, fn):  # noqa: ANN001, ANN202
        def call(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            cat = OP_CATEGORY.get(name)
            if cat is None:
                cat = (
                    self.scopes[-1]
                    if self.scopes
                    else ("dense GEMMs" if name in ("linear", "grouped_linear") else "other")
                )
            with record_function(_CAT + cat):
                return fn(*args, **kw)

        return call

    def _enter(self, label: str, scope: str | None):  # noqa: ANN202
        def pre(module, args):  # noqa: ANN001, ANN202
            if scope is not None:
                self.scopes.append(scope)
            r = record_function(label)
            r.__enter__()
            self.ranges.append(r)

        def post(module, args, out):  # noqa: ANN001, ANN202
            self.ranges.pop().__exit__(None, None, None)
            if scope is not None:
                self.scopes.pop()

        return pre, post

    def __enter__(self) -> Labels:
        for name in OPS:
            self.saved[name] = getattr(self.ops, name)
            setattr(self.ops, name, self._wrap(name, self.saved[name]))
        hooked = [(m, _LAYER + str(i), None) for i, m in enumerate(self.model.layers)]
        for m in self.model.modules():
            for cls, cat in SCOPE_CATEGORY:
                if isinstance(m, cls):
                    hooked.append((m, _CAT + cat, cat))
        for m, label, scope in hooked:
            pre, post = self._enter(label, scope)
            self.hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        logits = self.model.logits  # the LM head GEMM is a dense GEMM (hc_head inside stays mHC)

        def labelled_logits(h: torch.Tensor) -> torch.Tensor:
            with record_function(_CAT + "dense GEMMs"):
                return logits(h)

        self.model.logits = labelled_logits
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.saved.items():
            setattr(self.ops, name, fn)
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        del self.model.logits  # back to the class method


def attribute(events, on_device: bool) -> SimpleNamespace:  # noqa: ANN001
    """Seconds per (bucket, category) over all profiled steps; bucket = layer index or "rest".

    Returns time[bucket][cat], top[(cat, name)] (per op / kernel name, for the "other" listing),
    device_total_s and unattributed_s (device only: kernels not traced to a CPU op).
    """
    labels: dict[int, tuple[str | None, int | None]] = {}

    def label(fe) -> tuple[str | None, int | None]:  # noqa: ANN001
        key = id(fe)
        if key not in labels:
            cat = layer = None
            if fe.name.startswith(_CAT):
                cat = fe.name[len(_CAT) :]
            elif fe.name.startswith(_LAYER):
                layer = int(fe.name[len(_LAYER) :])
            if (cat is None or layer is None) and fe.cpu_parent is not None:
                pc, pl = label(fe.cpu_parent)
                cat, layer = cat or pc, layer if layer is not None else pl
            labels[key] = (cat, layer)
        return labels[key]

    time: dict = defaultdict(lambda: defaultdict(float))
    top: dict = defaultdict(float)
    device_total = attributed = 0.0
    for fe in events:
        if fe.device_type != DeviceType.CPU:  # device-side copies of our ranges are not kernels
            if not (getattr(fe, "is_user_annotation", False) or fe.name.startswith("dsv4.")):
                device_total += fe.time_range.elapsed_us() * 1e-6
            continue
        if on_device:
            pieces = [
                (k.name, k.duration * 1e-6) for k in fe.kernels if not k.name.startswith("dsv4.")
            ]
        else:
            pieces = [(fe.name, fe.self_cpu_time_total * 1e-6)]
        if not pieces:
            continue
        cat, layer = label(fe)  # the event tree is shallow: recursion is fine
        cat = cat or "other"
        bucket = "rest" if layer is None else layer
        for name, s in pieces:
            time[bucket][cat] += s
            top[(cat, name)] += s
            attributed += s
    return SimpleNamespace(
        time=time,
        top=top,
        device_total_s=device_total if on_device else None,
        unattributed_s=max(0.0, device_total - attributed) if on_device else 0.0,
    )


def profile_activities(device: torch.device) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def profile(
    model: Transformer, step: Callable[[int], None], n_steps: int, device: torch.device
) -> SimpleNamespace:
    """Run `step(0..n_steps-1)` under the profiler with labels on; attribute its time."""
    with Labels(model), torch.profiler.profile(activities=profile_activities(device)) as prof:
        for j in range(n_steps):
            step(j)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return attribute(prof.events(), on_device=device.type == "cuda")


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
        named = {c: raw.get(c, 0.0) / n_steps for c in NAMED}
        if not on_device:
            profiled = sum(raw.values()) / n_steps
            named = {c: v * total / profiled if profiled else 0.0 for c, v in named.items()}
        elif sum(named.values()) > total:  # kernel time of the profiled step over the median
            named = {c: v * total / sum(named.values()) for c, v in named.items()}
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
        "mode": "device kernel time" if on_device else "host time, scaled to the median",
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
