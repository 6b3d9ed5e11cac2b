"""Piecewise CUDA graphs of the steps a decode graph cannot serve: those with a prefill chunk.

Such a step runs eagerly, and an eager step is bound by the host: ~25 launches a layer, each
tens of microseconds of Python (docs/PERF.md: a Flash-width layer at batch 1 took 4.3 ms of host
time for ~0.16 ms of GPU work). Most of a layer reads no index list: the hyper-connections, the
projections, the MoE. Those parts are captured once per token bucket and replayed; what reads the
step's lists -- the compressor, the indexer, sparse attention and the ring writes
(`Attention.attend`) -- runs eagerly between them. vLLM's piecewise graphs split the same way
(attention outside, keyed by the token count).

A step of T tokens pads to the next bucket Tp (BUCKETS, up to max_tokens). Its pieces, for a
model of L layers, read and write static buffers of max_tokens rows:
  piece 0:      embed, RoPE tables, layer 0's hc_pre, `qkv` and `side_projections`;
  piece l:      layer l-1's output projection and FFN (`out`, `ffn_out`), layer l's
                hc_post_pre, `qkv` and `side_projections` (the compressor's and the indexer's
                projections)                      (1 <= l < L);
  piece L:      layer L-1's output projection, FFN and the last hc_post -> the streams h.
Between piece l and l+1, layer l's `attend` runs eagerly on the first T rows. Rows past T carry
token id 0 at position 0; every op of a piece treats rows independently, so they change no real
row (they cost GPU time: at most a bucket step's worth).

Only steps that are not pure decode steps (Batch.decode is False). Tensor parallel: every rank
runs the same steps (rank 0's schedule), so they pad to the same bucket and replay alike; the
pieces' all-reduces are captured as the decode graphs' are, and a bucket that fails to capture
on one rank runs eagerly on all. `capture=False` runs the same pieces eagerly through the same
buffers: that path is what the CPU tests check against the model's forward.
"""

from __future__ import annotations

import logging

import torch

from dsv4.model import Transformer
from dsv4.state import Batch, DecodeState

log = logging.getLogger("dsv4.piecewise")

# token buckets: steps of ~1.5x, so a step pads by at most half (the padded rows are GPU work)
BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# the engine's steps up to this many tokens (more: eager). H200, 3 Flash layers, eager ->
# pieces: 16 tokens 15.96 -> 8.38 ms, 256: 21.83 -> 10.70, 1024: 21.51 -> 15.30, 2048: 19.89 ->
# 19.39 (the GPU's work hides the launches there; docs/PERF.md)
PIECEWISE_MAX_TOKENS = 1024


def bucket(T: int, max_tokens: int) -> int | None:
    """The smallest bucket >= T within max_tokens, or None (the step runs eagerly)."""
    return next((b for b in BUCKETS if T <= b <= max_tokens), None)


class PiecewiseGraphs:
    """Pieces of the non-decode steps of `model` over `state`, captured per token bucket."""

    def __init__(
        self, model: Transformer, state: DecodeState, max_tokens: int, capture: bool = True
    ) -> None:
        dev = state.block_table.device
        if capture and dev.type != "cuda":
            raise ValueError("CUDA graphs need the model and state on a CUDA device")
        self.model, self.state, self.capture = model, state, capture
        # buffers for the bucket that holds max_tokens (steps up to it are served)
        self.max_tokens = bucket(max_tokens, BUCKETS[-1]) or BUCKETS[-1]
        a, n, dt = model.args, model.args.hc_mult, model.dtype
        attn = model.layers[0].attn
        H, hd, R = attn.n_heads, attn.head_dim, model.freqs_main.numel()
        fp8 = state.layers[0].window.dtype == torch.uint8
        self.fp8_rows = state.layers[0].window.shape[1] if fp8 else 0
        M = self.max_tokens

        def buf(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        f32 = torch.float32
        self.buf = {
            "ids": buf(M, dtype=torch.long),
            "pos": buf(M, dtype=torch.long),
            "x": buf(M, n, a.dim),  # the streams (after the layer's hc_post of attention's input)
            "post": buf(M, n, dtype=f32),
            "comb": buf(M, n, n, dtype=f32),
            "y": buf(M, a.dim),  # attention's input
            "qr": buf(M, a.q_lora_rank),
            "q": buf(M, H, hd),
            "kv": buf(M, self.fp8_rows, dtype=torch.uint8) if fp8 else buf(M, hd),
            "o": buf(M, H, hd),  # attention's output (the eager part writes it)
            "h": buf(M, n, a.dim),  # the streams after the last layer
            "cos_main": buf(M, R, dtype=f32),
            "sin_main": buf(M, R, dtype=f32),
            "cos_compress": buf(M, R, dtype=f32),
            "sin_compress": buf(M, R, dtype=f32),
        }
        # each layer kind's `side_projections` go to buffers "<kind>_side<j>", made from the
        # first piece that returns them (its eager run, before any capture)
        self.side_names: dict[str, list[str]] = {}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.failed: set[int] = set()
        self.pool = None
        self.side = torch.cuda.Stream(dev) if capture else None

    # ---- the pieces ------------------------------------------------------------------------

    def _rope(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        kind, _ = self.model.rope_kind(layer)
        return self.buf[f"cos_{kind}"][:rows], self.buf[f"sin_{kind}"][:rows]

    def _piece(self, i: int, Tp: int) -> None:
        """Piece i over the first Tp rows of the buffers (reads them, then writes its outputs)."""
        m, b = self.model, {k: v[:Tp] for k, v in self.buf.items()}
        L = len(m.layers)
        if i == 0:
            h = m.streams(b["ids"])
            for kind, (cos, sin) in m.ropes(b["pos"]).items():
                b[f"cos_{kind}"].copy_(cos)
                b[f"sin_{kind}"].copy_(sin)
        else:
            prev = m.layers[i - 1]
            y = prev.attn.out(b["o"])
            h = prev.ffn_out(y, b["x"], b["post"], b["comb"], b["ids"])
            if i == L:
                b["h"].copy_(m.ops.hc_post(*h))
                return
        layer = m.layers[i]
        x, y, post, comb = layer.attn_in(h)
        rope = self._rope(i, Tp)
        qr, q, kv = layer.attn.qkv(y, rope, None, self.fp8_rows)
        for name, t in (("x", x), ("post", post), ("comb", comb), ("y", y), ("qr", qr),
                        ("q", q), ("kv", kv)):  # fmt: skip
            b[name].copy_(t)
        side = layer.attn.side_projections(y, qr, rope)
        names = self.side_names.setdefault(
            layer.attn.kind, [f"{layer.attn.kind}_side{j}" for j in range(len(side))]
        )
        for name, t in zip(names, side):
            if name not in self.buf:
                self.buf[name] = t.new_zeros((self.max_tokens, *t.shape[1:]))
            self.buf[name][:Tp].copy_(t)

    def _side(self, kind: str, rows: int) -> tuple[torch.Tensor, ...]:
        # a layer kind's side projections over `rows` rows
        return tuple(self.buf[name][:rows] for name in self.side_names.get(kind, []))

    def _attend(self, i: int, batch: Batch, T: int) -> None:
        # layer i's eager part on the step's T rows -> its output rows of "o"
        m, b = self.model, self.buf
        layer = m.layers[i]
        o = layer.attn.attend(
            b["y"][:T], b["qr"][:T], b["q"][:T], b["kv"][:T], batch, self.state.layers[i],
            self._rope(i, T), m.rope_kind(i)[1], self._side(layer.attn.kind, T),
        )  # fmt: skip
        b["o"][:T].copy_(o)

    # ---- the step --------------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """The model's forward over a non-decode step (input_ids [T], `batch`) -> the streams
        before hc_head [T, n, D] (a view, valid until the next run), or None where no piece
        serves it (a decode step, more tokens than the largest bucket, a failed capture): the
        caller runs the model eagerly."""
        T = input_ids.numel()
        Tp = bucket(T, self.max_tokens)
        if batch.decode or Tp is None or Tp in self.failed:
            return None
        batch.prepare(self.model.args)
        b = self.buf
        b["ids"][:T].copy_(input_ids)
        b["pos"][:T].copy_(batch.positions)
        if Tp > T:  # token 0 at position 0 (the rows of a shorter step in the same bucket)
            b["ids"][T:Tp].zero_()
            b["pos"][T:Tp].zero_()
        pieces = None
        if self.capture:
            pieces = self.graphs.get(Tp) or self._capture(Tp)
            if pieces is None:
                return None
        for i in range(len(self.model.layers) + 1):
            if i:
                self._attend(i - 1, batch, T)
            if pieces is None:
                self._piece(i, Tp)
            else:
                pieces[i].replay()
        return b["h"][:T]

    def _capture(self, Tp: int) -> list[torch.cuda.CUDAGraph] | None:
        # each piece once eagerly (compiles, autotuning, lazy tables), then captured; the pieces
        # share one memory pool and replay one after another
        pieces = []
        try:
            for i in range(len(self.model.layers) + 1):
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    self._piece(i, Tp)
                torch.cuda.current_stream().wait_stream(self.side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._piece(i, Tp)
                self.pool = graph.pool()
                pieces.append(graph)
        except Exception as e:  # noqa: BLE001  (a host sync in a piece: run eagerly)
            torch.cuda.synchronize()
            log.warning("piecewise graphs for %d tokens not captured: %s", Tp, e, exc_info=True)
            pieces = None
        # tensor parallel: every rank replays or every rank runs eagerly (their all-reduces
        # would not match); one rank's failure fails all
        if self.model.par.least(int(pieces is not None)) == 0:
            self.failed.add(Tp)
            return None
        self.graphs[Tp] = pieces
        log.info("captured %d pieces for steps of up to %d tokens", len(pieces), Tp)
        return pieces
