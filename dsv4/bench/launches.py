"""How many kernels one decode step (or prefill chunk) launches, counted on the CPU: every call
into the ops interface is one, every other torch op the model runs around them is one (pure views
and allocations are none). A proxy for the GPU trace, for the small launches of index glue that
dominate a batch-1 step and, on the host, an eager prefill of short chunks.

  python3 -m dsv4.bench.launches [--layers sliding,csa,hca] [--batch 1] [--eager] [--prefill N]
"""

from __future__ import annotations

import argparse
import collections
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.bench.step import _layer_list, bench_args
from dsv4.bench.weights import fill_state_, init_random_
from dsv4.model import Transformer
from dsv4.ops import OPS, select
from dsv4.state import Batch, DecodeState

# ops that only make a new view of the same memory: no kernel
VIEWS = frozenset(
    "view unsqueeze squeeze expand t as_strided detach slice select _reshape_alias alias permute "
    "transpose _unsafe_view reshape split unbind lift_fresh".split()
    + "empty empty_like empty_strided".split()  # allocations: no kernel either
)


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.inside_op = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if not self.inside_op and name not in VIEWS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


PREFILL_START = 256  # where a counted prefill chunk starts: the rings hold earlier tokens


def count(
    layers: str = "sliding,csa,hca", batch: int = 1, static: bool = True, prefill: int = 0
) -> dict:
    """Launches of one decode step of a tiny model with `layers`: {"ops": n, "torch": n, ...}.
    static: the CUDA-graph form of the step (every compressor window pooled, stores masked);
    prefill > 0: instead a prefill chunk of that many tokens a sequence, from PREFILL_START."""
    counter = _Counter()
    ref = select("ref")

    def counted(name: str):  # noqa: ANN202
        fn = getattr(ref, name)

        def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if counter.inside_op == 0:
                counter.counts["ops." + name] += 1
            counter.inside_op += 1
            try:
                return fn(*a, **k)
            finally:
                counter.inside_op -= 1

        return call

    ops = SimpleNamespace(name="counted", **{n: counted(n) for n in OPS})
    args, _ = bench_args("tiny", _layer_list(layers))
    model = Transformer(args, torch.float32, quantized=True, ops=ops).eval()
    init_random_(model, 0)
    state = DecodeState(args, batch, 512, torch.float32, "cpu")
    fill_state_(state, 0)
    ids = torch.zeros(batch * max(prefill, 1), dtype=torch.long)
    pos = 301
    if prefill:
        assert PREFILL_START + prefill <= 512, f"prefill {prefill} past the counted state"
        b = Batch.build(list(range(batch)), [PREFILL_START] * batch, [prefill] * batch, state)
    elif static:
        b = Batch.build_static(torch.arange(batch), torch.full((batch,), pos), state, 512)
    else:
        b = Batch.build(list(range(batch)), [pos] * batch, [1] * batch, state)
    b.prepare(args)  # the step's shared index lists, as the bench builds them
    counter.counts.clear()
    with torch.no_grad(), counter:
        model(ids, b, state)
    c = counter.counts
    n_ops = sum(v for k, v in c.items() if k.startswith("ops."))
    return {"ops": n_ops, "torch": sum(c.values()) - n_ops, "by_name": dict(c.most_common())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="sliding,csa,hca")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="a dynamic (not CUDA-graph) step")
    p.add_argument("--prefill", type=int, default=0, help="a prefill chunk of N tokens instead")
    a = p.parse_args()
    r = count(a.layers, a.batch, not a.eager, a.prefill)
    print(f"{r['ops'] + r['torch']} launches: {r['ops']} ops calls, {r['torch']} torch ops")
    for name, n in r["by_name"].items():
        print(f"{n:6d}  {name}")


if __name__ == "__main__":
    main()
