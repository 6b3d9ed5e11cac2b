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
    """Storages whose memory is given back: those of `keep` with their bytes waiting in host
    memory (pinned for a GPU) to come back with them, those of `drop` to come back zeroed."""

    def __init__(
        self, keep: list[torch.UntypedStorage], drop: list[torch.UntypedStorage] = ()
    ) -> None:
        self.items: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        for st in keep:
            n = st.nbytes()
            host = torch.empty(n, dtype=torch.uint8, pin_memory=st.device.type == "cuda")
            self.items.append((st, n, host.copy_(_bytes(st, n))))
        kept = {(str(st.device), st.data_ptr()) for st in keep}
        self.items += [
            (st, st.nbytes(), None) for st in drop if (str(st.device), st.data_ptr()) not in kept
        ]
        for st, _, _ in self.items:
            st.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.items)

    def restore(self) -> None:
        for st, n, host in self.items:
            st.resize_(n)
            b = _bytes(st, n)
            if host is None:
                b.zero_()
            else:
                b.copy_(host)
        self.items = []
