"""The launchers' fixed tiles fit the GPUs they are chosen for (sm_90, sm_100, sm_120), checked by
compiling them with Triton for each target on the CPU (tests/ops/compile_tiles.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.ops import sparse_attn as sa
from dsv4.ops.device import shared_memory_of

# opt-in shared memory per program: H100 / H200, B200, RTX PRO 6000 (sm_120)
LIMITS = {arch: shared_memory_of(divmod(arch, 10)) for arch in (90, 100, 120)}
NEED = {  # each fixed tile (by its name in sparse_attn) and what the launcher assumes it takes
    "FEW_TOKENS_TILE": sa.FEW_TOKENS_SHARED,
    "FEW_TOKENS_TILE_FP8": sa.FEW_TOKENS_FP8_SHARED,
    "FP8_MANY_TOKENS_TILE": sa.FP8_MANY_TOKENS_SHARED,
}


def _compile(only: str, arch: list[int]) -> dict:
    # {tile: {arch: bytes}}, compiled outside the interpreter (it replaces Triton's builder)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_tiles.py")
    argv = [sys.executable, str(script), "--only", only, "--arch", *map(str, arch)]
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return {k: {int(a): v for a, v in d.items()} for k, d in json.loads(run.stdout).items()}


@pytest.fixture(scope="module")
def shared() -> dict:
    return _compile("TILE", sorted(LIMITS))


def test_small_shared_tiles_fit_sm120() -> None:
    # FP8 entries on an sm_120 GPU: no other autotuned tile fits its 99 KB
    tiles = _compile("SMALL_SHARED", [120])
    assert len(tiles) == len(sa.SMALL_SHARED_SHAPES)
    for name, by_arch in tiles.items():
        assert by_arch[120] <= LIMITS[120], (name, by_arch)


def test_declared_needs_bound_the_compiled_tiles(shared: dict) -> None:
    # the constants fixed_tile compares with the GPU's shared memory are at least what Triton
    # allocates on every target
    for name, by_arch in shared.items():
        for arch, nbytes in by_arch.items():
            assert nbytes <= NEED[name], f"{name} on sm_{arch}: {nbytes} B > declared {NEED[name]}"


@pytest.mark.parametrize("arch", sorted(LIMITS))
@pytest.mark.parametrize("programs,entries", [(1, False), (1, True), (2, True), (64, True)])
def test_chosen_tiles_fit(shared: dict, arch: int, programs: int, entries: bool) -> None:
    # a tile fixed_tile picks for a GPU with this shared memory fits it there (sm_120:
    # FP8_MANY_TOKENS_TILE does not, so it is autotuned there: its launch would fail)
    tile = sa.fixed_tile(programs, 64, entries, LIMITS[arch])
    if tile is None:
        return
    name = next(n for n in NEED if getattr(sa, n) is tile)
    assert shared[name][arch] <= LIMITS[arch], (name, arch, shared[name][arch])
