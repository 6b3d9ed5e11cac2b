"""Device time of a decode step without host launch cost (`dsv4 bench step --graph`).

The step's Python launches dominate on hosts that pay tens of microseconds per Triton launch, which
hides what the kernels cost. Here one decode step is captured as CUDA graphs the way the engine's
`DecodeGraphs` captures it: the whole step (embedding .. logits) builds its static `Batch` inside
the capture, so every replay pays the per-step index lists (`Batch.prepare`) as the engine does;
and each Block alone, fed the inputs (the prepared batch among them) it saw in an eager pass.
Replaying them back to back times the device work only (L2 warm between replays, as in a real decode loop). The
result has `timing.measure`'s shape, so it projects to the full model the same way: rest = step
minus its layers.

Capture fails where a host sync remains (the torch reference MoE, say); the error is returned.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from dsv4.bench.ops import replay_ms
from dsv4.bench.timing import _stats
from dsv4.model import Transformer
from dsv4.state import Batch, DecodeState


def graph_measure(
    model: Transformer,
    state: DecodeState,
    make_batch: Callable[[], Batch],
    ids: torch.Tensor,
    keys: list[str],
    repeat: int,
    replays: int = 20,
) -> dict:
    """`measure`-shaped timing of a decode step from CUDA graph replays; `make_batch` builds the
    step's static `Batch` (`Batch.build_static`), inside the step's capture."""
    layers = model.layers
    inputs: dict[int, tuple] = {}
    hooks = [
        layer.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a))
        for i, layer in enumerate(layers)
    ]
    try:
        model.logits(model(ids, make_batch(), state))  # the inputs each layer sees; autotuning done
    finally:
        for h in hooks:
            h.remove()
    torch.cuda.synchronize()

    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            fn()
        return g

    step_g = capture(lambda: model.logits(model(ids, make_batch(), state)))
    layer_g = [capture(lambda i=i: layers[i](*inputs[i])) for i in range(len(layers))]

    uniq = list(dict.fromkeys(keys))
    samples: dict = {"layers": {k: [] for k in uniq}, "rest": [], "step": []}
    for _ in range(repeat):
        per_layer = [replay_ms(g, replays) * 1e-3 for g in layer_g]
        step_s = replay_ms(step_g, replays) * 1e-3
        for k in uniq:
            samples["layers"][k].append(
                statistics.mean(t for t, kk in zip(per_layer, keys) if kk == k)
            )
        samples["rest"].append(step_s - sum(per_layer))
        samples["step"].append(step_s)
    del step_g, layer_g
    return {
        "layers": {k: _stats(v) for k, v in samples["layers"].items()},
        "rest": _stats(samples["rest"]),
        "step": _stats(samples["step"]),
        "rest_detail": {},
        "samples": samples,
    }
