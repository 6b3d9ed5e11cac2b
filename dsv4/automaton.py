"""The byte automaton every structured output compiles to (`dsv4.json_schema`, `dsv4.regex`,
`dsv4.ebnf`, `dsv4.dsml_grammar`).

  Automaton.step(state, byte) -> state    0 = dead; Automaton.START; Automaton.accepts(state)

A graph of nodes joined by byte edges (a 256-bit set each), empty moves, and calls: subroutines
($ref, free-form JSON, grammar rules) make recursion work, up to MAX_DEPTH calls deep. A state is
the set of threads (node, stack of return nodes) alive after the bytes so far, numbered as it is
met, and its transitions are computed on first use, all 256 at once (`row`).
"""

from __future__ import annotations

import numpy as np

MAX_DEPTH = 64  # nested calls ($ref, free-form JSON) at most
MAX_NODES = 200_000  # a schema whose graph is larger is refused (counts expand into copies)
MAX_COUNT = 1024  # minItems / maxItems / minLength / maxLength above this are refused


class SchemaError(ValueError):
    """A schema this compiler cannot constrain to (the message names the keyword and where)."""


def _bits(data: bytes | range) -> int:
    out = 0
    for b in data:
        out |= 1 << b
    return out


WS = _bits(b" \t\n\r")


class Automaton:
    """The graph and its states. Nodes: byte edges (mask, target), empty moves, calls (entry,
    return) and returns; FINAL accepts with an empty stack."""

    def __init__(self) -> None:
        self.edges: list[list[tuple[int, int]]] = []
        self.eps: list[list[int]] = []
        self.call: dict[int, tuple[int, int]] = {}
        self.ret: set[int] = set()
        self.final = -1
        # states: 0 is dead (no thread); rows of the transition table computed on first use
        self._sets: list[frozenset] = [frozenset()]
        self._ids: dict[frozenset, int] = {frozenset(): 0}
        self.table = np.zeros((64, 256), dtype=np.int32)
        self.done = np.zeros(64, dtype=bool)
        self.done[0] = True  # dead stays dead
        self.START = 0

    # ---- building -------------------------------------------------------------------------------
    def node(self) -> int:
        if len(self.edges) >= MAX_NODES:
            raise SchemaError(f"the schema is too large to compile (over {MAX_NODES} nodes)")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def empty(self) -> tuple[int, int]:
        a = self.node()
        return a, a

    def byte_set(self, mask: int) -> tuple[int, int]:
        a, b = self.node(), self.node()
        self.edges[a].append((mask, b))
        return a, b

    def seq(self, *parts: tuple[int, int]) -> tuple[int, int]:
        for (_, x), (y, _) in zip(parts, parts[1:]):
            self.eps[x].append(y)
        return parts[0][0], parts[-1][1]

    def lit(self, data: bytes) -> tuple[int, int]:
        return self.seq(*(self.byte_set(1 << b) for b in data)) if data else self.empty()

    def alt(self, *parts: tuple[int, int]) -> tuple[int, int]:
        a, b = self.node(), self.node()
        for x, y in parts:
            self.eps[a].append(x)
            self.eps[y].append(b)
        return a, b

    def star(self, part: tuple[int, int]) -> tuple[int, int]:
        a = self.node()
        self.eps[a].append(part[0])
        self.eps[part[1]].append(a)
        return a, a

    def opt(self, part: tuple[int, int]) -> tuple[int, int]:
        return self.alt(part, self.empty())

    def repeat(self, make, lo: int, hi: int | None, sep=None) -> tuple[int, int]:  # noqa: ANN001
        """lo..hi pieces from make() (hi None: no end), a piece from sep() between two."""
        if hi == 0:
            return self.empty()

        def item(first: bool) -> tuple[int, int]:
            return make() if first or sep is None else self.seq(sep(), make())

        parts = [item(i == 0) for i in range(lo)]
        if hi is None:
            tail = (
                self.star(item(False))
                if lo
                else self.opt(self.seq(item(True), self.star(item(False))))
            )
            parts.append(tail)
        else:
            rest = self.empty()  # nested options: copy j is there only if copy j - 1 is
            for j in reversed(range(lo, hi)):
                rest = self.opt(self.seq(item(j == 0), rest))
            parts.append(rest)
        return self.seq(*parts) if parts else self.empty()

    def calls(self, entry: int) -> tuple[int, int]:
        a, b = self.node(), self.node()
        self.call[a] = (entry, b)
        return a, b

    def ws(self) -> tuple[int, int]:
        return self.star(self.byte_set(WS))

    def finish(self, top: tuple[int, int], ws: bool = True) -> None:
        """The document: top (with whitespace around it, ws), then FINAL."""
        self.final = self.node()
        start = self.node()
        parts = (self.ws(), top, self.ws()) if ws else (top,)
        self.seq((start, start), *parts, (self.final, self.final))
        self.START = self._intern(self._closure([(start, ())]))

    # ---- running --------------------------------------------------------------------------------
    def _closure(self, threads: list[tuple[int, tuple]]) -> frozenset:
        # the threads that wait on a byte (or accept) after every empty move, call and return
        seen, todo, out = set(), list(threads), set()
        while todo:
            th = todo.pop()
            if th in seen:
                continue
            seen.add(th)
            node, stack = th
            if self.edges[node] or (node == self.final and not stack):
                out.add(th)
            todo.extend((n, stack) for n in self.eps[node])
            if node in self.call and len(stack) < MAX_DEPTH:
                entry, back = self.call[node]
                todo.append((entry, (*stack, back)))
            if node in self.ret and stack:
                todo.append((stack[-1], stack[:-1]))
        return frozenset(out)

    def _intern(self, threads: frozenset) -> int:
        sid = self._ids.get(threads)
        if sid is None:
            sid = self._ids[threads] = len(self._sets)
            self._sets.append(threads)
            if sid >= len(self.done):  # grow the table
                self.table = np.concatenate([self.table, np.zeros_like(self.table)])
                self.done = np.concatenate([self.done, np.zeros_like(self.done)])
        return sid

    def row(self, sid: int) -> None:
        """Compute state sid's 256 transitions (all at once: an edge's closure serves every byte
        of its set)."""
        by_byte: dict[int, set] = {}
        for node, stack in self._sets[sid]:
            for mask, target in self.edges[node]:
                after = self._closure([(target, stack)])
                m, b = mask, 0
                while m:
                    if m & 1:
                        by_byte.setdefault(b, set()).update(after)
                    m >>= 1
                    b += 1
        row = np.zeros(256, dtype=np.int32)
        for b, threads in by_byte.items():
            row[b] = self._intern(frozenset(threads))
        self.table[sid] = row
        self.done[sid] = True

    def rows(self, sids: np.ndarray) -> None:
        """Make sure the rows of these states are computed."""
        missing = sids[~self.done[sids]]
        for sid in np.unique(missing).tolist():
            self.row(sid)

    def step(self, sid: int, byte: int) -> int:
        if not self.done[sid]:
            self.row(sid)
        return int(self.table[sid, byte])

    def advance(self, sid: int, data: bytes | None) -> int:
        """The state after data (0: dead; None data, a special token: dead)."""
        if data is None:
            return 0
        for b in data:
            if sid == 0:
                return 0
            sid = self.step(sid, b)
        return sid

    def accepts(self, sid: int) -> bool:
        return any(node == self.final and not stack for node, stack in self._sets[sid])

    @property
    def num_states(self) -> int:
        return len(self._sets)
