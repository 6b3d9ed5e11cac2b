"""Timing of one step by layer (marks at Block forward hooks) and its projection to a full model.

A step's marks: "start", ("pre", i) / ("post", i) around Block i (summed over calls: prefill chunks
call each layer several times), optional "batch" (after batch prep), and the last mark ends it.
"rest" is the step minus its layers. The projection to a target schedule (Flash: 43 layers) is
rest + sum over the target's layers of the median time of the measured key standing for each.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch


class Clock:
    """Marks within one step: CUDA events on the current stream, or the host clock on the CPU.
    Block i's forward hooks mark ("pre", i) and ("post", i)."""

    def __init__(self, device: torch.device, layers: torch.nn.ModuleList) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.paused = False  # no marks (a CUDA graph capture runs the hooks too)
        self.hooks = []
        for i, layer in enumerate(layers):
            self.hooks.append(
                layer.register_forward_pre_hook(lambda m, a, i=i: self.mark(("pre", i)))
            )
            self.hooks.append(
                layer.register_forward_hook(lambda m, a, o, i=i: self.mark(("post", i)))
            )

    def mark(self, name: object) -> None:
        if self.paused:
            return
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append((name, e))
        else:
            self.marks.append((name, time.perf_counter()))

    def read(self, n_layers: int) -> tuple[list[float], float, dict[str, float]]:
        """(seconds per layer, summed over its calls; step seconds; named gaps) of the marks."""
        if self.cuda:
            torch.cuda.synchronize()
            e0 = self.marks[0][1]
            stamps = [(n, e0.elapsed_time(e) * 1e-3) for n, e in self.marks]
        else:
            t0 = self.marks[0][1]
            stamps = [(n, t - t0) for n, t in self.marks]
        self.marks = []
        layer_s, opened = [0.0] * n_layers, {}
        for name, t in stamps:
            if isinstance(name, tuple) and name[0] == "pre":
                opened[name[1]] = t
            elif isinstance(name, tuple):
                layer_s[name[1]] += t - opened.pop(name[1])
        at = {n: t for n, t in stamps if isinstance(n, str)}
        layer_marks = [t for n, t in stamps if isinstance(n, tuple)]
        gaps = {}
        if "batch" in at and layer_marks:
            gaps = {
                "batch_prep_s": at["batch"],
                "embed_s": layer_marks[0] - at["batch"],
                "head_s": stamps[-1][1] - layer_marks[-1],
            }
        return layer_s, stamps[-1][1], gaps

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def _stats(samples: list[float]) -> dict:
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "samples": samples,
    }


def measure(
    step: Callable[[int], None], clock: Clock, keys: list[str], warmup: int, repeat: int, cycle: int
) -> dict:
    """Warm up, then `repeat` timed samples (each the mean over `cycle` consecutive steps)."""
    clock.marks = []
    for w in range(warmup):
        step(w % cycle)
        clock.marks = []
    uniq = list(dict.fromkeys(keys))
    samples: dict = {"layers": {k: [] for k in uniq}, "rest": [], "step": [], "gaps": {}}
    for _ in range(repeat):
        acc_layers = dict.fromkeys(uniq, 0.0)
        acc_step = 0.0
        acc_gaps: Counter = Counter()
        for j in range(cycle):
            step(j)
            layer_s, step_s, gaps = clock.read(len(keys))
            for k in uniq:
                ts = [t for t, kk in zip(layer_s, keys) if kk == k]
                acc_layers[k] += sum(ts) / len(ts) / cycle
            acc_step += step_s / cycle
            acc_gaps.update({g: v / cycle for g, v in gaps.items()})
        for k in uniq:
            samples["layers"][k].append(acc_layers[k])
        # rest: the step minus every benchmarked layer (each at its own time, not its type's mean)
        samples["rest"].append(acc_step - sum(acc_layers[k] * keys.count(k) for k in uniq))
        samples["step"].append(acc_step)
        for g, v in acc_gaps.items():
            samples["gaps"].setdefault(g, []).append(v)
    return {
        "layers": {k: _stats(v) for k, v in samples["layers"].items()},
        "rest": _stats(samples["rest"]),
        "step": _stats(samples["step"]),
        "rest_detail": {g: statistics.median(v) for g, v in samples["gaps"].items()},
        "samples": samples,
    }


def with_projection(t: dict, counts: dict | None, tokens: int) -> dict:
    """`measure`'s result plus projected_s, its spread over the repeats and tok/s (raw samples
    stay in the STATS entries)."""
    med = {k: v["median_s"] for k, v in t["layers"].items()}
    proj = project(med, t["rest"]["median_s"], counts)
    per_repeat = [
        project({k: t["samples"]["layers"][k][r] for k in med}, t["samples"]["rest"][r], counts)
        for r in range(len(t["samples"]["rest"]))
    ]
    t["projected_s"] = proj
    t["projected_spread"] = (
        None if proj is None else {"min_s": min(per_repeat), "max_s": max(per_repeat)}
    )
    t["tok_per_s"] = None if proj is None else tokens / proj
    del t["samples"]
    return t


def projection_plan(measured: list[str], target: list[str]) -> dict:
    """How many layers of the target schedule each measured key stands for: the same key, else
    the same layer type with the other MoE ("csa" for "csa:hash"). counts None if a type is
    missing."""
    have = set(measured)
    counts: Counter = Counter()
    subs: Counter = Counter()
    missing = []
    for want in target:
        use = (
            want
            if want in have
            else next((k for k in sorted(have) if k.split(":")[0] == want.split(":")[0]), None)
        )
        if use is None:
            missing.append(want)
            continue
        counts[use] += 1
        if use != want:
            subs[f"{want} <- {use}"] += 1
    return {
        "n_layers": len(target),
        "target": dict(Counter(target)),
        "counts": dict(counts) if not missing else None,
        "substitutions": dict(subs),
        "missing": sorted(set(missing)),
    }


def project(
    layer_s: dict[str, float], rest_s: float, counts: dict[str, int] | None
) -> float | None:
    """rest + sum over the full model's layers of the time of their (measured) type."""
    if counts is None:
        return None
    return rest_s + sum(n * layer_s[k] for k, n in counts.items())
