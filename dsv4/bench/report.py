"""The fixed-width report of `dsv4 bench step` and the environment it records."""

from __future__ import annotations

import platform
import subprocess
import time
from pathlib import Path

import torch

from dsv4.bench.breakdown import CATEGORIES


def environment(device: torch.device) -> dict:
    def version(mod: str) -> str | None:
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001
            return None

    try:
        sha = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=10,
            ).stdout.strip()
            or None
        )
    except Exception:  # noqa: BLE001
        sha = None
    return {
        "git_sha": sha,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": version("triton"),
        "transformers": version("transformers"),
        "python": platform.python_version(),
    }


def _ms(s: float | None, width: int = 9) -> str:
    return f"{'-':>{width}}" if s is None else f"{s * 1e3:>{width}.2f}"


def _print_prefill(label: str, t: dict, cols: list[str]) -> None:
    per = ", ".join(f"{k} {_ms(t['layers'][k]['median_s'], 0).strip()}" for k in cols)
    proj = t["projected_s"]
    print(
        f"{label}: {_ms(t['step']['median_s'], 0).strip()} ms measured ({per}; rest "
        f"{_ms(t['rest']['median_s'], 0).strip()}) -> projected "
        + ("-" if proj is None else f"{proj * 1e3:.1f} ms, {t['tok_per_s']:.0f} tok/s")
    )


def _print_breakdown(run: dict, keys: list[str], what: str) -> None:
    b = run["breakdown"]
    cols = list(dict.fromkeys(keys))
    print(f"\nbreakdown: {what} (ms per step; {b['mode']}; projected = full model)")
    w = {k: max(12, len(k) + 2) for k in cols}
    print(
        f"{'category':<15}" + "".join(f"{k:>{w[k]}}" for k in cols) + f"{'rest':>10}"
        f"{'projected':>11}{'%':>6}"
    )
    proj = b["projected"]
    total = run["projected_s"]
    for c in CATEGORIES:
        line = f"{c:<15}" + "".join(_ms(b["per_layer"][k][c], w[k]) for k in cols)
        line += _ms(b["rest"][c], 10)
        if proj is not None:
            line += _ms(proj[c], 11) + f"{100 * proj[c] / total:>6.1f}"
        print(line)
    line = f"{'total':<15}" + "".join(_ms(run["layers"][k]["median_s"], w[k]) for k in cols)
    line += _ms(run["rest"]["median_s"], 10) + (_ms(total, 11) if proj is not None else "")
    print(line)
    if b["unattributed_s"]:
        print(f"  kernels not traced to an op (in 'other'): {b['unattributed_s'] * 1e3:.2f} ms")
    if b["other_top"]:
        top = ", ".join(f"{name[:48]} {s * 1e3:.2f}" for name, s in b["other_top"][:4])
        print(f"  largest in 'other' (profiled ms per step): {top}")


def print_report(res: dict) -> None:
    cfg, keys = res["config"], res["config"]["layer_keys"]
    cols = list(dict.fromkeys(keys))
    plan = res["projection"]
    target = " + ".join(f"{n} {k}" for k, n in plan["target"].items())
    print(
        f"dsv4 bench step: preset {cfg['preset']}, layers {', '.join(keys)}, ops {cfg['ops']}, "
        f"{cfg['dtype']}, {res['env']['device']} ({res['env']['device_name']})"
        + (
            f", tensor parallel {cfg['tensor_parallel_size']} (rank 0's times)"
            if cfg.get("tensor_parallel_size", 1) > 1
            else ""
        )
    )
    print(
        f"projection: {plan['n_layers']} layers = {target}, + rest (batch prep, embedding, "
        f"hc_head, head)"
        + (
            "; stand-ins: " + ", ".join(f"{n} {k}" for k, n in plan["substitutions"].items())
            if plan["substitutions"]
            else ""
        )
        + (f"; missing {plan['missing']}" if plan["missing"] else "")
    )
    pf = res["prefill"]
    if pf is not None:
        _print_prefill(
            f"prefill {pf['tokens']} tokens in {pf['chunks']} chunk(s) of {pf['chunk']}", pf, cols
        )
    for pa in res.get("prefill_at", []):
        label = (
            f"prefill chunk of {pa.get('tokens', cfg['chunk'])} tokens at context {pa['context']}"
        )
        if "error" in pa:
            print(f"{label}: {pa['error']}")
        else:
            _print_prefill(label, pa, cols)
    if pf is not None and pf.get("breakdown"):
        _print_breakdown(pf, keys, f"prefill of {pf['tokens']} tokens in chunks of {pf['chunk']}")
    for run in res["runs"]:
        if run.get("breakdown"):
            _print_breakdown(run, keys, f"batch {run['batch']}, context {run['context']}")
    hf = cfg["hf"]
    k = cfg.get("draft_tokens", 0)
    print(
        f"\ndecode step, ms (median of {cfg['repeat']}); floor: dsv4 roofline on {cfg['floor_gpu']}"
        + (
            f"\nverify steps (speculative decoding): {1 + k} tokens a sequence; tok/s counts one "
            f"a sequence (each accepted draft adds one); floor of batch x {1 + k} tokens"
            if k
            else ""
        )
    )
    w = {k: max(10, len(k) + 2) for k in cols}
    head = (
        f"{'batch':>5}{'context':>8}"
        + "".join(f"{k:>{w[k]}}" for k in cols)
        + f"{'rest':>8}{'proj.':>10}{'tok/s':>9}{'floor':>9}{'x floor':>9}{'GB/s':>8}"
    )
    if hf:
        head += f"{'hf proj.':>10}{'hf ctx':>8}{'ours/hf':>8}"
    print(head)
    for run in res["runs"]:
        line = f"{run['batch']:>5}{run['context']:>8}"
        if "error" in run:
            print(line + f"  error: {run['error']}")
            continue
        line += "".join(_ms(run["layers"][k]["median_s"], w[k]) for k in cols)
        line += _ms(run["rest"]["median_s"], 8) + _ms(run["projected_s"], 10)
        fl = run["floor"]
        line += f"{run['tok_per_s']:>9.1f}" if run["tok_per_s"] else f"{'-':>9}"
        line += f" {fl['floor_s'] * 1e3:>8.3g}" + (
            f" {run['projected_s'] / fl['floor_s']:>8.3g} {fl['gbps']:>7.3g}"
            if run["projected_s"]
            else f" {'-':>8} {'-':>7}"
        )
        h = run.get("hf")
        if hf and h and "projected_s" in h:
            ratio = h["ratio_ours_over_hf"]
            line += (
                _ms(h["projected_s"], 10)
                + f"{h['context']:>8}"
                + (f"{ratio:>8.2f}" if ratio else f"{'-':>8}")
            )
        elif hf and h:
            line += f"  hf: {h.get('error') or h.get('skipped')}"
        print(line)
    graphs = [r for r in res["runs"] if r.get("graph")]
    if graphs:
        print("\ndecode step as CUDA graphs, ms (device time only, no host launch cost)")
        print(
            f"{'batch':>5}{'context':>8}" + "".join(f"{k:>{w[k]}}" for k in cols)
            + f"{'rest':>8}{'proj.':>10}{'tok/s':>9}{'x floor':>9}{'eager/graph':>12}"
        )  # fmt: skip
        for run in graphs:
            g, line = run["graph"], f"{run['batch']:>5}{run['context']:>8}"
            if "layers" not in g:
                print(line + f"  {g.get('error') or g.get('skipped')}")
                continue
            line += "".join(_ms(g["layers"][k]["median_s"], w[k]) for k in cols)
            line += _ms(g["rest"]["median_s"], 8) + _ms(g["projected_s"], 10)
            if g["projected_s"]:
                line += f"{g['tok_per_s']:>9.1f}{g['x_floor']:>9.3g}"
                line += f"{run['projected_s'] / g['projected_s']:>12.1f}"
            print(line)
    if hf and any((r.get("hf") or {}).get("note") for r in res["runs"]):
        print(
            "hf ctx < context: transformers ran at a smaller context (see --hf-max-gb); "
            "ours/hf then compares different contexts"
        )
