"""`dsv4 bench ops --quick`: every kernel case runs (interpreter on CPU) and agrees with its reference."""

from __future__ import annotations

import json

import torch

from dsv4.bench.ops import CASE_MODULES, Case, main, run_cases


def test_quick_cases_run_and_match(tmp_path):  # noqa: ANN001
    out = tmp_path / "ops.json"
    assert main(["--quick", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"].split(".")[0] for r in rows} and len(rows) >= len(CASE_MODULES)
    assert all(r["rel_err"] <= 2e-2 for r in rows)


def test_a_wrong_kernel_is_reported():
    x = torch.randn(64)
    bad = Case("neg", "n=64", run=lambda: -x, ref=lambda: x, bytes=512)
    _, rows = run_cases([bad], "cpu", repeat=1)
    assert rows[0]["rel_err"] > 1.0
