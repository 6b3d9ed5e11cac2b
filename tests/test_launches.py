"""The torch glue around the ops in a static (CUDA-graph) decode step stays small: each extra layer
of a kind adds at most what it does today (sixth session: sliding 1, CSA 13, HCA 5; it was
5 / 89 / 41 before the per-step index lists)."""

from __future__ import annotations

import pytest

from dsv4.bench.launches import count


@pytest.mark.parametrize("kind,most", [("sliding", 1), ("csa", 13), ("hca", 5)])
def test_torch_launches_per_layer(kind: str, most: int) -> None:
    one, two = count(kind), count(f"{kind},{kind}")
    per_layer = two["torch"] - one["torch"]
    assert per_layer <= most, f"{kind}: {per_layer} torch launches per layer ({two['by_name']})"
    assert two["ops"] > one["ops"]  # the counter sees the ops calls
