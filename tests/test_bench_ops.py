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


def test_the_summary_names_cases_not_faster_on_device_time(capsys):  # noqa: ANN001
    from dsv4.bench.ops import _print

    timed = dict(us=1.0, ref_us=2.0, speedup=2.0, gbps=1.0, pct_copy_bw=1.0, graph_us=1.0,
                 graph_pct_copy_bw=1.0, rel_err=0.0)  # fmt: skip
    rows = [
        dict(op="fast", shape="T=1", graph_speedup=3.0, **timed),
        dict(op="slow", shape="T=64", graph_speedup=0.8, **timed),
        dict(op="untimed", shape="cpu", rel_err=0.0),
    ]
    _print(4e12, rows)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("device time vs reference: 1 of 2 cases faster (least x0.8: slow T=64)")
    assert last.endswith("not faster: slow T=64")
