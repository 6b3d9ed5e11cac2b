"""Sleep mode: the memory of the weights and of the decode state given back and taken again
(vLLM's `LLM.sleep` / `wake_up`, SGLang's `release_memory_occupation` /
`resume_memory_occupation`), so that another process on the GPU (an RL trainer beside the
engine) can use it in between.

A released tensor keeps its Python object, shape and views: its storage is resized to nothing
(the caching allocator gets the block back; `torch.cuda.empty_cache` returns it to the driver)
and later resized back, at a new address, with its bytes copied back from the host or zeroed.
Whatever captured the old addresses (CUDA graphs) must be made again."""

from __future__ import annotations

from collections.abc import Iterable

import torch

TAGS = ("weights", "kv_cache")  # what can sleep, by the peers' names


def check_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """The tags asked for (None: all), in TAGS order; ValueError naming an unknown one."""
    if tags is None:
        return TAGS
    asked = list(tags)
    bad = [t for t in asked if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}: the tags are {list(TAGS)}")
    return tuple(t for t in TAGS if t in asked)


def storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages behind `tensors` (views share one), empty ones left out."""
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            seen.setdefault((str(st.device), st.data_ptr()), st)
    return list(seen.values())


def _bytes(st: torch.UntypedStorage, n: int) -> torch.Tensor:
    # the storage's n bytes as a uint8 tensor
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (n,), (1,))


class Released:
    """Storages whose memory is given back: those of `keep` with their bytes waiting in one host
    buffer (pinned for a GPU: one allocation and asynchronous copies, not one per tensor; Flash
    has ~66K expert tensors) to come back with them, those of `drop` to come back zeroed."""

    def __init__(
        self,
        keep: list[torch.UntypedStorage],
        drop: list[torch.UntypedStorage] = (),
        pin: bool | None = None,
        host: torch.Tensor | None = None,
    ) -> None:
        kept = {(str(st.device), st.data_ptr()) for st in keep}
        drop = [st for st in drop if (str(st.device), st.data_ptr()) not in kept]
        self.items = [(st, st.nbytes()) for st in [*keep, *drop]]
        self.num_kept = len(keep)
        total = sum(n for _, n in self.items[: self.num_kept])
        if pin is None:  # (pinned: the copies run at PCIe speed, but pinning itself takes time)
            pin = any(st.device.type == "cuda" for st in keep)
        # `host`: a buffer of an earlier release, reused when it fits (pinning 1 GB takes ~0.5 s
        # on the H200 host; the copies ~25 ms: docs/PERF.md, thirty-ninth session)
        fits = host is not None and host.numel() >= total and host.is_pinned() == pin
        self.host = host if fits else torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        for (st, n), at in zip(self.items, self._offsets()):
            self.host[at : at + n].copy_(_bytes(st, n), non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        for st, _ in self.items:
            st.resize_(0)

    def _offsets(self) -> list[int]:
        # where each kept storage's bytes lie in the host buffer
        out, at = [], 0
        for _, n in self.items[: self.num_kept]:
            out.append(at)
            at += n
        return out

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.items)

    def restore(self) -> None:
        pin = self.host.is_pinned()
        for st, n in self.items:
            st.resize_(n)
        for (st, n), at in zip(self.items, self._offsets()):
            _bytes(st, n).copy_(self.host[at : at + n], non_blocking=pin)
        for st, n in self.items[self.num_kept :]:
            _bytes(st, n).zero_()
        if pin:
            torch.cuda.synchronize()
        self.items = []
