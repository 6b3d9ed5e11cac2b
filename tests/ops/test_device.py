"""dsv4.ops.device: the launchers' split heuristic and the shared zeroed arrays."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from dsv4.ops import device


@pytest.mark.parametrize(
    "length,block,programs,target,most",
    [(4096, 128, 4, 132, 16), (100, 32, 1, 8, 8), (64, 64, 200, 132, 4)],
)
def test_split_reduction(length: int, block: int, programs: int, target: int, most: int) -> None:
    # every split a multiple of block, together covering length, none empty, at most `most`
    per, splits = device.split_reduction(length, block, programs, target, most)
    assert per % block == 0 and 1 <= splits <= most
    assert (splits - 1) * per < length <= splits * per


def test_arrival_counts_shared() -> None:
    # one zeroed array per (owner, device, size), handed out again on every call
    a = device.arrival_counts("test", torch.device("cpu"), 8)
    assert a.dtype == torch.int32 and not a.any()
    assert device.arrival_counts("test", torch.device("cpu"), 8) is a
    assert device.arrival_counts("other", torch.device("cpu"), 8) is not a


@pytest.mark.gpu
def test_arrival_counts_cuda_index() -> None:
    # "cuda" and "cuda:<current>" name the same array: a kernel's counts and its reset must meet
    a = device.arrival_counts("test", torch.device("cuda"), 8)
    b = device.arrival_counts("test", torch.device("cuda", torch.cuda.current_device()), 8)
    assert a is b


def test_shared_memory_cpu_unbounded() -> None:
    # the interpreter has no shared-memory limit: launchers keep their fixed tiles there
    assert device.shared_memory(torch.device("cpu")) >= 1 << 30


@pytest.mark.gpu
def test_shared_memory_of_the_gpu() -> None:
    # the opt-in limit per block: 227 KB on sm_90 / sm_100, 99 KB on sm_120
    props = torch.cuda.get_device_properties(0)
    got = device.shared_memory(torch.device("cuda"))
    assert got == device.SHARED_MEMORY.get((props.major, props.minor), got), (props.major, got)


def test_is_sm90_cpu() -> None:
    # the Gluon kernels' device check: never on the CPU (no CUDA call made)
    assert not device.is_sm90(torch.device("cpu"))


def test_chain_off_on_the_cpu() -> None:
    # the interpreter has no griddepcontrol: no PDL constexpr, no PDL launch
    assert device.chain(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


def _kernels() -> list[tuple[str, ast.FunctionDef]]:
    out = []
    for path in sorted(Path(device.__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            decorators = getattr(node, "decorator_list", [])  # (@triton.jit or @triton.jit(...))
            jit = any(
                ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith(".jit")
                for d in decorators
            )
            if jit and node.name.endswith("_kernel"):
                out.append((path.name, node))
    return out


def test_every_kernel_is_chained() -> None:
    # every kernel takes the PDL constexpr and waits for its predecessor (griddepcontrol.wait,
    # directly or through chain_start), and writes nothing before that: a chained kernel runs
    # beside its predecessor until the wait (it may read only what no kernel writes: weights)
    kernels = _kernels()
    assert len(kernels) >= 20, [n.name for _, n in kernels]
    for fname, node in kernels:
        args = [a.arg for a in node.args.args]
        assert "PDL" in args, f"{fname}: {node.name} has no PDL parameter"
        body = "\n".join(ast.unparse(s) for s in node.body)
        waits = [i for i in (body.find("chain_start(PDL)"), body.find("gdc_wait()")) if i >= 0]
        assert waits, f"{fname}: {node.name} does not wait for its predecessor"
        head = body[: min(waits)]
        for write in ("store(", "atomic_", "async_copy_shared_to_global"):
            assert write not in head, f"{fname}: {node.name} writes ({write}) before its wait"


def test_compile_watch_counts_and_restores() -> None:
    import logging

    before = triton.knobs.runtime.jit_cache_hook
    watch = device.CompileWatch(logging.getLogger("test")).install()
    try:
        assert triton.knobs.runtime.jit_cache_hook is watch
        # Triton's call: keyword arguments only, and False lets the compile go on
        assert watch(key=(), repr="k[num_warps=4]()", fn=None, compile={}) is False
        assert watch.count == 1
    finally:
        watch.uninstall()
    assert triton.knobs.runtime.jit_cache_hook is before


@triton.jit
def _watched_kernel(x_ptr, N: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, N), tl.arange(0, N).to(tl.float32))


@pytest.mark.gpu
def test_compile_watch_sees_a_compile_gpu() -> None:
    import logging

    x = torch.empty(32, device="cuda")
    _watched_kernel[(1,)](x, 16)  # compiled before the watch: not counted
    said = []
    log = logging.getLogger("test.compile_watch")
    log.warning = lambda msg, *a: said.append(msg % a)
    watch = device.CompileWatch(log).install()
    try:
        _watched_kernel[(1,)](x, 16)
        _watched_kernel[(1,)](x, 32)  # a new specialization
    finally:
        watch.uninstall()
    assert watch.count == 1 and watch.names == {"_watched_kernel": 1}, watch.names
    assert said[0].count("N: ") == 1 and "32" in said[0] and "was" in said[0], said
    assert torch.equal(x, torch.arange(32, dtype=torch.float32, device="cuda"))


def test_specialization_change_names_the_argument() -> None:
    class Fn:  # a JITFunction's cache as Triton keys it: str(specialization) + str(options)
        arg_names = ["x_ptr", "n_rows", "BLOCK"]
        device_caches = {
            0: ({"[('*bf16', 'D'), ('i32', ''), ('constexpr', 64)]{'num_warps': 4}": 0}, None)
        }

    said = device.specialization_change(
        Fn, "[('*bf16', 'D'), ('i32', 1), ('constexpr', 64)]{'num_warps': 4}"
    )
    assert said == "n_rows: ('i32', 1) (was ('i32', '')); never before: n_rows=('i32', 1)"
    Fn.device_caches[0][0]["[('*bf16', 'D'), ('i32', 1), ('constexpr', 16)]{'num_warps': 4}"] = 0
    said = device.specialization_change(
        Fn, "[('*bf16', 'D'), ('i32', 1), ('constexpr', 64)]{'num_warps': 4}"
    )  # (nearest: either held key; new is only the combination)
    assert said.endswith("(was ('i32', ''))") or said.endswith("(was ('constexpr', 16))"), said
    said = device.specialization_change(
        Fn, "[('*bf16', 'D'), ('i32', 1), ('constexpr', 16)]{'num_warps': 8}"
    )  # the same arguments, another launch option
    assert said == "(same arguments, other options: num_warps=8 (was 4))", said
    Fn.device_caches = {}
    assert device.specialization_change(Fn, "[('*bf16', 'D')]") == "(its first compile)"


def test_autotuned_kernels_keep_their_picks() -> None:
    # the autotuners write their picks beside the compiled kernels (where Triton can)
    import inspect

    from dsv4.ops import moe, sparse_attn

    can = "cache_results" in inspect.signature(triton.autotune).parameters
    for tuned in (sparse_attn._sparse_attn_tuned, moe._gate_up_tuned, moe._down_tuned):
        assert tuned.cache_results is can or (can and triton.knobs.runtime.interpret)


def test_call_site_names_the_package_frames() -> None:
    import os

    import dsv4

    assert device.call_site() == "?"  # no frame of the package (this test calls it)
    ns = {"call_site": device.call_site}
    model = os.path.join(os.path.dirname(dsv4.__file__), "model.py")
    exec(compile("\n\ndef forward():\n    return call_site()\n", model, "exec"), ns)  # noqa: S102
    assert ns["forward"]() == "model.py:4 forward"


def test_host_cdiv_and_next_power_of_2_equal_triton() -> None:
    # the ops' launchers size grids with these plain functions: Triton's are constexpr_functions,
    # ~1.6 us a call on the host (docs/PERF.md, thirty-fourth session); same values required
    import triton

    from dsv4.ops.device import cdiv, next_power_of_2

    assert [next_power_of_2(n) for n in range(-2, 4100)] == [
        triton.next_power_of_2(n) for n in range(-2, 4100)
    ]
    pairs = [(a, b) for a in range(0, 700, 7) for b in (1, 2, 3, 16, 64, 128, 4096)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]
