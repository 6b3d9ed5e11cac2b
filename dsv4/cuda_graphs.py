"""CUDA graphs of decode steps: the engine's pure-decode steps replayed without host launch cost.

A decode step launches ~40 kernels per layer; on hosts that pay tens of microseconds per launch the
GPU waits on Python. `DecodeGraphs` captures the whole step (embedding .. logits) once per
(batch bucket, position bound) and replays it with the step's slots, positions and token ids
written into static buffers:
  - batch buckets 1, 2, 4, .. up to max_seqs; a step of n sequences pads to the next bucket with
    copies of its first sequence (same inputs, so the same state writes);
  - the position bound L is the next of four steps per octave (2^k, 1.25, 1.5, 1.75 x 2^k) above
    the step's last position (at least 256, at most max_seq_len): the index lists of a static
    `Batch` (`Batch.build_static`) are shaped by B and L only, entries past a sequence's own count
    are -1, and the indexer and HCA attention walk all of them, so a bound at most 25% past the
    position (power-of-two bounds: up to 100%) keeps that waste small for a few more graphs.
Capture needs a forward without host syncs: the Triton ops (the torch references sync in the
experts and the compressor's store). Before a capture the step runs once eagerly (autotuning,
lazy tables); running it twice is harmless, every state write of a decode step is idempotent
(a slot's ring row is overwritten with the same value, the closed window's entry too).
Speculative decoding verifies q = 1 + k tokens per sequence (the pending token and its drafts):
those steps are graphs too, keyed by q as well, and keep the streams before hc_head (`out_h`) for
the MTP layer. A q-token step writes its ring rows after attention (a chunk's ring slots still
hold its earlier tokens' windows), so it is not idempotent: the rows it writes are saved before
the eager run and put back before the capture.
Graphs share one memory pool and replay one at a time. Each graph ends by copying its logits into
one buffer outside the pool (`out`, [max_batch, vocab] fp32), so the pool keeps no output per
graph: with four bounds an octave a long generation captures dozens of graphs per bucket, and a
logits tensor kept by each (B x vocab x 4 bytes) came to ~3 GB over all buckets up to 1M positions.
The eager run before each capture uses one side stream for all of them (cuBLAS keeps a 32 MiB
workspace for every stream it has run on).
"""

from __future__ import annotations

import logging

import torch

from dsv4.model import Transformer
from dsv4.state import Batch, DecodeState

log = logging.getLogger("dsv4.cuda_graphs")

MIN_LEN = 256  # smallest position bound: fewer graphs for short contexts
STEPS = 4  # position bounds per octave


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _bound_at_least(n: int) -> int:
    # the smallest half * (1 + i / STEPS) >= n, i in 1..STEPS, half = 2^k < n (n >= MIN_LEN)
    half = _pow2_at_least(n) // 2
    bound = half
    while bound < n:
        bound += half // STEPS
    return bound


def position_bounds(max_seq_len: int) -> list[int]:
    """Every position bound a decode step can take (graph_key's), smallest first."""
    bounds = [min(_bound_at_least(MIN_LEN), max_seq_len)]
    while bounds[-1] < max_seq_len:
        bounds.append(min(_bound_at_least(bounds[-1] + 1), max_seq_len))
    return bounds


def graph_key(n: int, last_pos: int, max_seq_len: int) -> tuple[int, int]:
    """(batch bucket, position bound) of a decode step of n sequences, largest position last_pos."""
    return _pow2_at_least(n), min(_bound_at_least(max(last_pos + 1, MIN_LEN)), max_seq_len)


class DecodeGraphs:
    """Captured decode steps of `model` over `state`, keyed by (batch bucket, position bound,
    tokens per sequence)."""

    def __init__(
        self, model: Transformer, state: DecodeState, max_batch: int, tokens_per_seq: int = 1
    ) -> None:
        if state.block_table.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and state on a CUDA device")
        self.model, self.state = model, state
        self.max_batch = _pow2_at_least(max_batch)
        rows = self.max_batch * tokens_per_seq
        dev = state.block_table.device
        self.slots = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.starts = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.out = torch.empty(rows, model.head.weight.shape[0], dtype=torch.float32, device=dev)
        self.out_h = None  # verify steps (tokens_per_seq > 1): the streams for the MTP layer
        if tokens_per_seq > 1:
            a = model.args
            self.out_h = torch.empty(rows, a.hc_mult, a.dim, dtype=model.dtype, device=dev)
        # the eager run before each capture: one stream for all (cuBLAS keeps a 32 MiB workspace
        # per stream it has run on, so a new stream per capture kept 32 MiB per graph)
        self.side = torch.cuda.Stream(dev)
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.failed: set[tuple[int, int, int]] = set()
        self.pool = None
        self.q = tokens_per_seq

    def key(self, n: int, last_pos: int, q: int = 1) -> tuple[int, int, int]:
        return (*graph_key(n, last_pos, self.state.max_seq_len), q)

    def run(
        self, slots: list[int], starts: list[int], ids: list[list[int]]
    ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """The step's q tokens per sequence (ids[i]: tokens at starts[i] ..) -> (streams before
        hc_head [n*q, hc, D] for q > 1, else None; fp32 logits [n*q, vocab]), views valid until
        the next run; or None where no graph serves this step (more sequences than the largest
        bucket, more tokens than it was built for, or a capture that failed): the caller runs it
        eagerly."""
        n, q = len(slots), len(ids[0])
        if not 0 < n <= self.max_batch or q * self.max_batch > self.ids.shape[0]:
            return None
        key = self.key(n, max(starts) + q - 1, q)
        if key in self.failed:
            return None
        B = key[0]
        pad = B - n
        slots, starts, ids = slots + slots[:1] * pad, starts + starts[:1] * pad, ids + ids[:1] * pad
        flat = [t for x in ids for t in x]
        host = torch.tensor(slots + starts + flat, dtype=torch.long, pin_memory=True)
        self.slots[:B].copy_(host[:B], non_blocking=True)
        self.starts[:B].copy_(host[B : 2 * B], non_blocking=True)
        self.ids[: B * q].copy_(host[2 * B :], non_blocking=True)
        graph = self.graphs.get(key) or self._capture(key, slots, starts)
        if graph is None:
            return None
        graph.replay()
        return (None if q == 1 else self.out_h[: n * q]), self.out[: n * q]

    @torch.inference_mode()
    def compile_all(self, slot: int) -> int:
        """Run the forward of every step a graph can serve (each batch bucket at each position
        bound) once eagerly on `slot` at position 0, uncaptured: the Triton specializations the
        bounds take (the indexer's tiles and select blocks per context octave, the attention's
        splits) compile here, at the server's warm-up, not inside the capture that first meets
        a bound mid-serving (docs/PERF.md, 2026-12-01). The slot's ring rows and first window
        are overwritten: call it with no sequence in the slot and no cached block in its table.
        Returns the number of steps run."""
        buckets = [1 << k for k in range(self.max_batch.bit_length())]
        bounds = position_bounds(self.state.max_seq_len)
        self.slots.fill_(slot)
        self.starts.zero_()
        self.ids.zero_()
        for bound in bounds:
            for B in buckets:
                self._forward((B, bound, self.q))
        torch.cuda.synchronize()
        return len(bounds) * len(buckets)

    def _forward(self, key: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        B, bound, q = key
        batch = Batch.build_static(self.slots[:B], self.starts[:B], self.state, bound, q)
        h = self.model(self.ids[: B * q], batch, self.state)
        return h, self.model.logits(h)

    def _capture(
        self, key: tuple[int, int, int], slots: list[int], starts: list[int]
    ) -> torch.cuda.CUDAGraph | None:
        B, _, q = key
        # a q-token step is not idempotent: the eager run's ring writes are put back
        saved = (
            self.state.save_rows(
                range(self.model.args.n_layers),
                [s for s in slots for _ in range(q)],
                [p + j for p in starts for j in range(q)],
            )
            if q > 1
            else []
        )
        try:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                self._forward(key)  # eager once: autotuning and lazy tables outside the capture
            torch.cuda.current_stream().wait_stream(self.side)
            self.state.restore_rows(saved, [True] * (B * q))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                h, logits = self._forward(key)
                self.out[: B * q].copy_(logits)
                if q > 1:
                    self.out_h[: B * q].copy_(h)
        except Exception as e:  # noqa: BLE001  (a host sync in the forward: run eagerly)
            torch.cuda.synchronize()
            self.state.restore_rows(saved, [True] * (B * q))
            log.warning("decode step %s not captured, running eagerly: %s", key, e, exc_info=True)
            graph = None
        # tensor parallel: a graph pads the batch, so every rank must replay or every rank run
        # eagerly (their all-reduces would differ in size); one rank's failure fails all
        if self.model.par.least(int(graph is not None)) == 0:
            self.failed.add(key)
            return None
        self.pool = graph.pool()
        self.graphs[key] = graph
        free = torch.cuda.mem_get_info()[0] / 2**30
        log.info(
            "captured decode step: batch %d, positions < %d, %d token(s) each (%.2f GiB free)",
            *key, free,
        )  # fmt: skip
        return graph
