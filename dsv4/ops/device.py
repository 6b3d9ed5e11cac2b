"""What the launchers ask of the device."""

from __future__ import annotations

import functools
import inspect
import os
import re
import traceback

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsv4.quant import cdiv  # the launchers' grid sizes (re-exported: ops import it from here)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host code (the same values: 0 for n <= 0). Triton's, like
    `triton.cdiv` (here `quant.cdiv`), is a constexpr_function, ~1.6 us a call on the host
    (fourteen of them were ~20 us of every eager FP8 projection, docs/PERF.md)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.cache
def num_sms(device: torch.device, interpreter: int = 4) -> int:
    """Streaming multiprocessors of a CUDA device. On the CPU (the Triton interpreter) `interpreter`
    stands in: small, so the tests exercise the launchers' split heuristics."""
    if device.type != "cuda":
        return interpreter
    return torch.cuda.get_device_properties(device).multi_processor_count


# opt-in shared memory per block by compute capability, where torch does not report it (sm_80
# 163 KB, sm_90 / sm_100 227 KB; sm_86 / sm_89 / sm_120 99 KB, also assumed for any other)
SHARED_MEMORY = {(8, 0): 166912, (9, 0): 232448, (10, 0): 232448, (12, 0): 101376}


def shared_memory_of(capability: tuple[int, int]) -> int:
    """Opt-in shared memory per block of a compute capability (major, minor): SHARED_MEMORY,
    99 KB for any other."""
    return SHARED_MEMORY.get(capability, 101376)


@functools.cache
def shared_memory(device: torch.device) -> int:
    """Shared memory one program may use on a CUDA device, in bytes (the opt-in limit per
    block: 227 KB on sm_90 / sm_100, 99 KB on sm_120 workstation Blackwell). A launcher's fixed
    tile must fit it: Triton does not shrink a config, the launch fails with OutOfResources.
    The CPU (interpreter) has no limit."""
    if device.type != "cuda":
        return 1 << 30
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    return optin or shared_memory_of((props.major, props.minor))


def split_reduction(
    length: int, block: int, programs: int, target: int, most: int
) -> tuple[int, int]:
    """(elements per split, splits) of a reduction over `length` taken `block` at a time, so that
    `programs` output tiles times the splits approach `target` programs: at most `most` splits,
    each a multiple of `block`, none empty."""
    blocks = cdiv(length, block)
    splits = max(1, min(blocks, most, target // programs))
    per_split = cdiv(blocks, splits) * block
    return per_split, cdiv(length, per_split)


def arrival_counts(owner: str, device: torch.device, size: int) -> torch.Tensor:
    """int32 arrival counts for kernels whose last-arriving program finishes a reduction (split-K
    fixups): zero between launches, since the last program of each group resets its count, so
    launches on one stream and CUDA-graph replays share them. One array per owner (kernels of
    different ops may overlap under PDL); two streams running the same op at once would each
    need their own (the engine runs the model on one stream). "cuda" and "cuda:0" name one array."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _zeros(owner, device, size)


@functools.cache
def _zeros(owner: str, device: torch.device, size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.int32, device=device)


def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device ("cuda" is the current one), (0, 0) for the CPU.
    Asked on every launcher call, so it is looked up once per device."""
    if device.type != "cuda":
        return (0, 0)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _capability(device)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def is_sm90(device: torch.device) -> bool:
    """A Hopper GPU (compute capability 9.0), where the Gluon kernels of `*_sm90` run."""
    return capability(device) == (9, 0)


def pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (sm_90+): a kernel launched with it may start while its
    predecessor runs (once every predecessor program has called gdc_launch_dependents) and waits in
    gdc_wait until the predecessor's writes are visible. Hides a launch between two dependent
    kernels; kernels take it as the PDL constexpr (the interpreter has no griddepcontrol)."""
    return capability(device)[0] >= 9


# Every decode kernel launches with PDL behind the stream's previous kernel: its programs take
# their SM slots while that kernel runs, wait in griddepcontrol.wait for it to finish, then let the
# next kernel launch in turn. At most two kernels are live, and a kernel's launch latency hides
# behind its predecessor. A bench switch (False: only the second kernels of hc_pre, sparse_attn
# and index_topk launch early, as before the chain).
CHAIN = True


def chain(device: torch.device) -> dict:
    """Launch options of a kernel in the chain: its PDL constexpr (wait at the start, then let the
    next kernel launch: `chain_start`) and `launch_pdl`."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on and CHAIN}


@triton.jit
def chain_start(PDL: tl.constexpr):
    # first thing in a chained kernel (Triton or Gluon), before it touches memory an earlier kernel
    # writes or reads: wait until the previous kernel has finished (its writes visible), then let
    # the next launch
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


class CompileWatch:
    """Counts (and logs) the Triton specializations first met after a server's warm-up: each is
    a JIT compile (seconds with a cold cache) and, for an autotuned kernel, a benchmark of its
    configs, inside a served step. `install` hooks Triton's JIT cache-miss callback; `uninstall`
    restores the previous one."""

    def __init__(self, log) -> None:  # noqa: ANN001
        self.log, self.count, self.names, self._prev = log, 0, {}, None

    def __call__(self, **kw: object) -> bool:
        self.count += 1
        fn = kw.get("fn")
        name = getattr(fn, "name", "?")
        self.names[name] = self.names.get(name, 0) + 1
        key = str(kw.get("key"))
        try:
            what = specialization_change(fn.jit_function, key)
            # the whole specialization of the scalars and constexprs (pointers left out)
            whole = ", ".join(
                f"{n}={a}" for n, a in zip(fn.jit_function.arg_names,
                                           re.findall(r"\('[^']*', [^()]*\)", key))
                if not a.startswith("('*")
            )  # fmt: skip
        except Exception:  # noqa: BLE001 (a Triton version that keys its cache otherwise)
            what, whole = str(kw.get("repr", name)), "?"
        self.log.warning("late compile #%d: %s %s (a shape the warm-up missed) [%s] from %s",
                         self.count, name, what, whole, call_site())  # fmt: skip
        return False  # (True would skip the compile)

    def install(self) -> CompileWatch:
        self._prev = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = self
        return self

    def uninstall(self) -> None:
        if triton.knobs.runtime.jit_cache_hook is self:
            triton.knobs.runtime.jit_cache_hook = self._prev


def call_site(depth: int = 4) -> str:
    """Where the running launch came from: the innermost `depth` frames of the dsv4 package
    outside this module, innermost first ("model.py:312 forward < engine.py:90 step")."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the dsv4 package
    frames = [
        f for f in traceback.extract_stack()
        if f.filename.startswith(here) and os.path.abspath(f.filename) != os.path.abspath(__file__)
    ]  # fmt: skip
    return (
        " < ".join(
            f"{os.path.relpath(f.filename, here)}:{f.lineno} {f.name}" for f in frames[::-1][:depth]
        )
        or "?"
    )


def specialization_change(jit_function, key: str) -> str:  # noqa: ANN001
    """What sets a new compile's key apart from the nearest one a JIT function already holds:
    "arg: new (was old)" for each argument whose type or specialization (int == 1, divisible by
    16, pointer alignment, a constexpr value) differs."""

    def args(k: str) -> list[str]:
        return re.findall(r"\('[^']*', [^()]*\)", k)

    def name(i: int) -> str:
        return jit_function.arg_names[i] if i < len(jit_function.arg_names) else str(i)

    def options(k: str) -> dict[str, str]:  # the launch options after the arguments
        return dict(re.findall(r"'(\w+)': ([^,{}]+)", k[k.rfind("]") + 1 :]))

    new = args(key)
    held = [(args(k), k) for cache in jit_function.device_caches.values() for k in cache[0]]
    held = [(h, k) for h, k in held if len(h) == len(new)]
    if not held:
        return "(its first compile)"
    near, near_key = min(held, key=lambda hk: sum(a != b for a, b in zip(hk[0], new)))
    change = ", ".join(
        f"{name(i)}: {b} (was {a})" for i, (a, b) in enumerate(zip(near, new)) if a != b
    )
    if not change:  # the same arguments: which launch options differ
        was, now = options(near_key), options(key)
        diff = [f"{o}={now.get(o)} (was {was.get(o)})" for o in sorted(set(was) | set(now))
                if was.get(o) != now.get(o)]  # fmt: skip
        change = f"(same arguments, other options: {', '.join(diff) or '?'})"
    # values no held compile had (the nearest key can tie with others)
    unseen = [f"{name(i)}={b}" for i, b in enumerate(new) if all(h[i] != b for h, _ in held)]
    return change + (f"; never before: {', '.join(unseen)}" if unseen else "")


_AUTOTUNE_PARAMS = inspect.signature(triton.autotune).parameters


def autotune(configs: list, key: list[str], early_config_prune) -> object:  # noqa: ANN001
    """triton.autotune with its picks kept on disk beside the compiled kernels (cache_results,
    where this Triton has it): a restarted server does not benchmark every config of each new
    key again inside its first served steps (~0.7 s each on an H200, docs/PERF.md 2026-12-01)."""
    extra = {"cache_results": True} if "cache_results" in _AUTOTUNE_PARAMS else {}
    return triton.autotune(
        configs=configs, key=key, prune_configs_by={"early_config_prune": early_config_prune},
        **extra,
    )  # fmt: skip
