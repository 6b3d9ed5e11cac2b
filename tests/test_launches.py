"""The torch glue around the ops in a static (CUDA-graph) decode step, and in an eager prefill
chunk, stays small: each extra layer of a kind adds at most what it does today (decode, sixteenth
session: sliding 0, CSA 4, HCA 0, with the compressor's ring write and the MoE's slot sum + shared
expert as one op each; sixth session 1 / 13 / 5; 5 / 89 / 41 before the per-step index lists)."""

from __future__ import annotations

import pytest

from dsv4.bench.launches import count


@pytest.mark.parametrize("kind,most", [("sliding", 0), ("csa", 4), ("hca", 0)])
def test_torch_launches_per_layer(kind: str, most: int) -> None:
    one, two = count(kind), count(f"{kind},{kind}")
    per_layer = two["torch"] - one["torch"]
    assert per_layer <= most, f"{kind}: {per_layer} torch launches per layer ({two['by_name']})"
    assert two["ops"] > one["ops"]  # the counter sees the ops calls


@pytest.mark.parametrize("kind,most", [("sliding", 3), ("csa", 6), ("hca", 3)])
def test_torch_launches_per_layer_of_a_prefill_chunk(kind: str, most: int) -> None:
    # an eager prefill chunk (64 tokens past the start: the rings hold earlier ones) is host-bound
    # at short chunks (docs/PERF.md, twenty-eighth session): each compressor is three ops calls
    # (CSA 84 / HCA 46 torch launches a layer before, 38 / 25 with the ops calls after)
    one, two = count(kind, prefill=64), count(f"{kind},{kind}", prefill=64)
    per_layer = two["torch"] - one["torch"]
    assert per_layer <= most, f"{kind}: {per_layer} torch launches per layer ({two['by_name']})"
    compressors = {"sliding": 0, "csa": 2, "hca": 1}[kind]
    calls = two["by_name"].get("ops.compress_keep", 0) - one["by_name"].get("ops.compress_keep", 0)
    assert calls == 2 * compressors
