from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter (must be set before triton is imported)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import inspect  # noqa: E402

import pytest  # noqa: E402


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language (inspect.getmembers over its modules) at every
    device-function call, not only at the launch: over half of an interpreted launch's time in
    this suite (tl.sum is itself one). The patches are the same wrappers each time and the
    launch undoes them at its end, so inside a launch a repeat for modules already patched is
    skipped. The kernels compute the same; only the interpreter's bookkeeping is saved."""
    try:
        from triton.runtime import interpreter as it

        patch, launch, scope, tl = (
            it._patch_lang,
            it.GridExecutor.__call__,
            it._LangPatchScope,
            it.tl,
        )
    except (ImportError, AttributeError):  # another Triton: its interpreter as it is
        return
    patched: set[int] = set()  # the language modules patched in the running launch

    def patch_lang(fn):  # noqa: ANN001, ANN202
        langs = {
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
        }
        if patched and langs <= patched:
            return scope()  # (nothing to undo)
        out = patch(fn)
        patched.update(langs)
        return out

    def run(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    it._patch_lang, it.GridExecutor.__call__ = patch_lang, run


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()

# pytest-xdist workers (`-n`): the cores shared between them, not each worker's torch taking all
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(
        max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    )


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_engine_defaults(request, monkeypatch):  # noqa: ANN001, ANN202
    # the engine's "auto" flags take the GPU when torch sees one (dsv4.config.resolve_engine);
    # tests without the gpu marker test the CPU path on any machine (module-scoped fixtures,
    # set up before this, name device="cpu" themselves)
    if "gpu" not in request.keywords:
        monkeypatch.setattr("dsv4.config.cuda_available", lambda: False)
