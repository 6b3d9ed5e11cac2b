"""The torch glue around the ops in a static (CUDA-graph) decode step stays small: each extra layer
of a kind adds at most what it does today (sixteenth session: sliding 0, CSA 4, HCA 0, with the
compressor's ring write and the MoE's slot sum + shared expert as one op each; sixth session
1 / 13 / 5; 5 / 89 / 41 before the per-step index lists)."""

from __future__ import annotations

import pytest

from dsv4.bench.launches import count


@pytest.mark.parametrize("kind,most", [("sliding", 0), ("csa", 4), ("hca", 0)])
def test_torch_launches_per_layer(kind: str, most: int) -> None:
    one, two = count(kind), count(f"{kind},{kind}")
    per_layer = two["torch"] - one["torch"]
    assert per_layer <= most, f"{kind}: {per_layer} torch launches per layer ({two['by_name']})"
    assert two["ops"] > one["ops"]  # the counter sees the ops calls
