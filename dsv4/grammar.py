"""Constrained decoding: JSON mode (response_format {"type": "json_object"}) and the token masks
of structured outputs (a `dsv4.json_schema` automaton: response_format json_schema, choices).

The output is kept a prefix of one JSON object (RFC 8259 syntax; whitespace around it), and the
end-of-sentence token is allowed only once the object is complete. Each step masks the tokens
whose bytes would leave the language:

  JsonGrammar(tokenizer, vocab_size)   shared: every token's bytes, per-mode masks (cached)
  JsonState(grammar)                   one sequence: the parser state after its output so far
  JsonState.mask(output_ids) -> bool [vocab_size]   the tokens allowed next

The parser is a pushdown automaton over bytes. Its state is (mode, stack): the mode carries
the innermost container's kind, the stack the kinds of the containers around it. For a byte that
is not a bracket the next mode depends on the mode alone, so the tokens without brackets are
checked for all of the vocabulary at once from a table (mode x byte -> mode), one mask per mode,
vectorized and cached. Tokens with a bracket (a few thousand of ~129K) are run through the exact
automaton from the full state, cached per state. Special tokens never match; bytes >= 0x80 only
inside strings (the UTF-8 of a character may be split across tokens). Strings are not checked
as UTF-8: an invalid sequence reaches the text as U+FFFD, which is still a JSON string character.

Structured outputs (`SchemaGrammar`, `SchemaState`) run every token through the schema's
automaton the same way, column by column over the vocabulary (`TokenMatrix.run`), its
transition rows computed on first use; masks are cached per automaton state.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

MAX_DEPTH = 64  # nested containers at most (a push past it is refused)
OBJ, ARR = 0, 1
WS = b" \t\n\r"
DIGITS = b"0123456789"
HEX = b"0123456789abcdefABCDEF"
LITERALS = (b"true", b"false", b"null")
BRACKETS = b"{}[]"

# ---- modes: (kind, ctx, extra) -> an int ----------------------------------------------------------
# START: before the top object; DONE: after it. The rest carry ctx, the innermost container's
# kind: VALUE (after ':' or ',' in an array), VALUE_OR_CLOSE (after '['), KEY_OR_CLOSE (after
# '{'), KEY (after ',' in an object), COLON (after a key), NEXT (after a value: ',' or the
# close), STR / STR_ESC / STR_U (a key's or a value's string: extra = (is_key, hex digits left)),
# NUM (extra = the number's sub-state), LIT (extra = (literal, bytes matched)).
_MODES: list[tuple] = []
_INDEX: dict[tuple, int] = {}


def _mode(*key: object) -> int:
    if key not in _INDEX:
        _INDEX[key] = len(_MODES)
        _MODES.append(key)
    return _INDEX[key]


START, DONE = _mode("START"), _mode("DONE")
DEAD = -1
_D = DIGITS.decode()
# a number's sub-state -> {character: next sub-state} (RFC 8259 number syntax)
NUM_NEXT = {
    "minus": {"0": "zero", **dict.fromkeys("123456789", "int")},
    "zero": {".": "dot", "e": "e", "E": "e"},
    "int": {**dict.fromkeys(_D, "int"), ".": "dot", "e": "e", "E": "e"},
    "dot": dict.fromkeys(_D, "frac"),
    "frac": {**dict.fromkeys(_D, "frac"), "e": "e", "E": "e"},
    "e": {"+": "esign", "-": "esign", **dict.fromkeys(_D, "exp")},
    "esign": dict.fromkeys(_D, "exp"),
    "exp": dict.fromkeys(_D, "exp"),
}
NUM_STATES = tuple(NUM_NEXT)
NUM_END = ("zero", "int", "frac", "exp")  # a number may stop here
for _ctx in (OBJ, ARR):
    for _kind in ("VALUE", "NEXT"):
        _mode(_kind, _ctx)
    for _is_key in (True, False) if _ctx == OBJ else (False,):
        _mode("STR", _ctx, _is_key)
        _mode("STR_ESC", _ctx, _is_key)
        for _left in (4, 3, 2, 1):
            _mode("STR_U", _ctx, (_is_key, _left))
    for _n in NUM_STATES:
        _mode("NUM", _ctx, _n)
    for _lit in LITERALS:
        for _i in range(1, len(_lit)):
            _mode("LIT", _ctx, (_lit, _i))
_mode("VALUE_OR_CLOSE", ARR)
_mode("KEY_OR_CLOSE", OBJ)
_mode("KEY", OBJ)
_mode("COLON", OBJ)


def _after_value(ctx: int) -> int:
    return _INDEX[("NEXT", ctx)]


def _value_start(ctx: int, b: int) -> int:
    # the mode after byte b where a value begins in container ctx (not a bracket)
    if b == ord('"'):
        return _INDEX[("STR", ctx, False)]
    if b == ord("-"):
        return _INDEX[("NUM", ctx, "minus")]
    if b == ord("0"):
        return _INDEX[("NUM", ctx, "zero")]
    if b in DIGITS:
        return _INDEX[("NUM", ctx, "int")]
    for lit in LITERALS:
        if b == lit[0]:
            return _INDEX[("LIT", ctx, (lit, 1))]
    return DEAD


def _number(ctx: int, sub: str, b: int) -> int:
    nxt = NUM_NEXT[sub].get(chr(b))
    if nxt is not None:
        return _INDEX[("NUM", ctx, nxt)]
    if sub in NUM_END:  # the number ends; the byte is read after it
        return _step_plain(_after_value(ctx), b)
    return DEAD


def _step_plain(mode: int, b: int) -> int:
    """The mode after byte b (not a bracket) from `mode`; DEAD if b cannot come next."""
    key = _MODES[mode]
    kind = key[0]
    if kind in ("START", "DONE"):
        return mode if b in WS else DEAD
    ctx = key[1]
    if kind == "STR":
        is_key = key[2]
        if b == ord('"'):
            return _INDEX[("COLON", OBJ)] if is_key else _after_value(ctx)
        if b == ord("\\"):
            return _INDEX[("STR_ESC", ctx, is_key)]
        return mode if b >= 0x20 else DEAD
    if kind == "STR_ESC":
        if b in b'"\\/bfnrt':
            return _INDEX[("STR", ctx, key[2])]
        return _INDEX[("STR_U", ctx, (key[2], 4))] if b == ord("u") else DEAD
    if kind == "STR_U":
        is_key, left = key[2]
        if b not in HEX:
            return DEAD
        return (
            _INDEX[("STR", ctx, is_key)]
            if left == 1
            else _INDEX[("STR_U", ctx, (is_key, left - 1))]
        )
    if kind == "NUM":
        return _number(ctx, key[2], b)
    if kind == "LIT":
        lit, i = key[2]
        if b != lit[i]:
            return DEAD
        return _after_value(ctx) if i + 1 == len(lit) else _INDEX[("LIT", ctx, (lit, i + 1))]
    if b in WS:
        return mode
    if kind in ("VALUE", "VALUE_OR_CLOSE"):
        return _value_start(ctx, b)
    if kind in ("KEY_OR_CLOSE", "KEY"):
        return _INDEX[("STR", OBJ, True)] if b == ord('"') else DEAD
    if kind == "COLON":
        return _INDEX[("VALUE", OBJ)] if b == ord(":") else DEAD
    if kind == "NEXT":
        if b == ord(","):
            return _INDEX[("KEY", OBJ)] if ctx == OBJ else _INDEX[("VALUE", ARR)]
        return DEAD
    raise AssertionError(key)


def step(state: tuple[int, tuple], b: int) -> tuple[int, tuple] | None:
    """The exact automaton: (mode, stack) after byte b, or None when b cannot come next."""
    mode, stack = state
    key = _MODES[mode]
    if b not in BRACKETS:
        nxt = _step_plain(mode, b)
        return None if nxt == DEAD else (nxt, stack)
    kind = key[0]
    if kind in ("STR", "STR_ESC", "STR_U"):  # a bracket inside a string is text
        nxt = _step_plain(mode, b)
        return None if nxt == DEAD else (nxt, stack)
    if kind == "NUM" and key[2] in NUM_END:  # the number ends at the bracket
        return step((_after_value(key[1]), stack), b)
    if b in b"{[":
        inner = _INDEX[("KEY_OR_CLOSE", OBJ)] if b == ord("{") else _INDEX[("VALUE_OR_CLOSE", ARR)]
        if kind == "START":  # the top value is an object
            return (inner, ()) if b == ord("{") else None
        if kind not in ("VALUE", "VALUE_OR_CLOSE") or len(stack) + 1 >= MAX_DEPTH:
            return None
        return inner, stack + (key[1],)
    closes = OBJ if b == ord("}") else ARR
    if kind not in ("NEXT", "KEY_OR_CLOSE", "VALUE_OR_CLOSE") or key[1] != closes:
        return None
    if not stack:
        return DONE, ()
    return _after_value(stack[-1]), stack[:-1]


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:  # noqa: ANN001
    """Each id's bytes (a byte-level BPE's token text through the byte alphabet); an added token
    that decodes as its own text (not special, not a `<...>` marker such as `</think>`: e.g.
    `｜DSML｜`, which DSML tool calls are written with) as its UTF-8; None for the other added
    tokens and ids the tokenizer does not have."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = {ch: i for i, ch in enumerate(_byte_alphabet(ByteLevel.alphabet()))}
    added = {t.content: t for t in tokenizer.get_added_tokens_decoder().values()}
    out: list[bytes | None] = []
    for i in range(vocab_size):
        text = tokenizer.id_to_token(i)
        tok = added.get(text)
        if tok is not None:
            marker = tok.special or (text.startswith("<") and text.endswith(">"))
            out.append(None if marker else text.encode())
        elif text is None or any(ch not in alphabet for ch in text):
            out.append(None)
        else:
            out.append(bytes(alphabet[ch] for ch in text))
    return out


def _byte_alphabet(chars: list[str]) -> list[str]:
    # GPT-2's byte -> printable character map (ByteLevel's): byte b is the b-th of this list
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, n = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    assert set(mapping.values()) == set(chars), "not a ByteLevel alphabet"
    return [mapping[b] for b in range(256)]


class TokenMatrix:
    """Token byte strings as a matrix, longest first, for running a byte automaton over the whole
    vocabulary at once: column j is read only for the tokens long enough to have it."""

    def __init__(self, tokens: list[bytes | None], keep: list[bool]) -> None:
        lens = np.array([len(t) if k and t else 0 for t, k in zip(tokens, keep)], dtype=np.int64)
        self.order = np.argsort(-lens, kind="stable")
        self.count = int((lens > 0).sum())  # the kept tokens: the first rows
        width = int(lens.max(initial=1))
        mat = np.zeros((len(tokens), width), dtype=np.uint8)
        for r, i in enumerate(self.order[: self.count]):
            mat[r, : lens[i]] = list(tokens[i])
        self.bytes = mat
        # rows with a byte in column j: the first active[j]
        self.active = [int((lens > j).sum()) for j in range(width)]

    def run(
        self, start: int, lookup: Callable[[np.ndarray, np.ndarray], np.ndarray], dead: int
    ) -> np.ndarray:
        """bool [vocab]: the kept tokens whose bytes take the automaton from `start` to a state
        other than `dead` (lookup(states, bytes) -> next states; dead stays dead)."""
        cur = np.full(self.count, start, dtype=np.int64)
        rows = np.arange(self.count)  # alive and long enough, ascending
        for j, k in enumerate(self.active):
            rows = rows[: np.searchsorted(rows, k)]
            if not len(rows):
                break
            nxt = lookup(cur[rows], self.bytes[rows, j])
            cur[rows] = nxt
            rows = rows[nxt != dead]
        ok = np.zeros(len(self.order), dtype=bool)
        ok[self.order[: self.count]] = cur != dead
        return ok


class JsonGrammar:
    """The vocabulary's bytes and the cached masks of JSON mode (one per tokenizer)."""

    def __init__(self, tokens: list[bytes | None], eos_token_id: int) -> None:
        self.vocab_size, self.eos = len(tokens), eos_token_id
        self.tokens = tokens
        plain = [t is not None and len(t) > 0 and not any(b in BRACKETS for b in t) for t in tokens]
        self.dynamic = [i for i, t in enumerate(tokens) if t and any(b in BRACKETS for b in t)]
        self._plain = TokenMatrix(tokens, plain)  # the bracket-free tokens
        # the byte table: mode x byte -> mode, DEAD as the last row (it stays DEAD)
        n = len(_MODES)
        table = np.full((n + 1, 256), n, dtype=np.int64)
        for m in range(n):
            for b in range(256):
                if b not in BRACKETS:
                    nxt = _step_plain(m, b)
                    table[m, b] = n if nxt == DEAD else nxt
        self._table = table
        self._by_mode: dict[int, np.ndarray] = {}
        self._by_state: dict[tuple, torch.Tensor] = {}
        self._all: TokenMatrix | None = None  # every token (structured outputs), made on first use

    def _plain_ok(self, mode: int) -> np.ndarray:
        # the bracket-free tokens that leave `mode` alive, all at once
        if mode not in self._by_mode:
            self._by_mode[mode] = self._plain.run(mode, lambda s, b: self._table[s, b], len(_MODES))
        return self._by_mode[mode]

    @property
    def all_tokens(self) -> TokenMatrix:
        """Every token's bytes (special tokens left out) for `SchemaGrammar`."""
        if self._all is None:
            self._all = TokenMatrix(self.tokens, [t is not None for t in self.tokens])
        return self._all

    def mask(self, state: tuple[int, tuple]) -> torch.Tensor:
        """bool [vocab_size]: the tokens allowed after `state` (EOS once the object is done)."""
        if state not in self._by_state:
            ok = self._plain_ok(state[0]).copy()
            for i in self.dynamic:
                ok[i] = advance(state, self.tokens[i]) is not None
            if state[0] == DONE and 0 <= self.eos < len(ok):
                ok[self.eos] = True
            if len(self._by_state) > 4096:  # bounded: deep or unusual states are recomputed
                self._by_state.clear()
            self._by_state[state] = torch.from_numpy(ok)
        return self._by_state[state]


def advance(state: tuple[int, tuple] | None, data: bytes | None) -> tuple[int, tuple] | None:
    """The state after `data`, None once it cannot be part of a JSON object."""
    if data is None:
        return None
    for b in data:
        if state is None:
            return None
        state = step(state, b)
    return state


class _Prefixes:
    """The states of every prefix of one sequence's output, rebuilt from its output ids: a
    speculative step's tokens may be dropped again, so the common prefix with the last call is
    reused. Subclasses give the start state, the dead state and one token's step; the grammar's
    mask(state) gives the tokens allowed in a state."""

    dead: object = None  # the state once the output left the grammar: nothing masked then

    def __init__(self, grammar, start: object) -> None:  # noqa: ANN001
        self.grammar = grammar
        self._ids: list[int] = []
        self._states: list = [start]

    def mask(self, output_ids: list[int]) -> torch.Tensor | None:
        """The tokens allowed after output_ids; None once the output left the grammar (an EOS
        or a forced token: nothing is masked then)."""
        state = self.state(output_ids)
        return None if state == self.dead else self.grammar.mask(state)

    def _advance(self, state, token: int):  # noqa: ANN001, ANN202
        raise NotImplementedError

    def state(self, output_ids: list[int]):  # noqa: ANN201
        k = len(self._ids)
        if len(output_ids) < k or output_ids[:k] != self._ids:  # (the usual case: one compare)
            k = 0
            while k < min(len(self._ids), len(output_ids)) and self._ids[k] == output_ids[k]:
                k += 1
            del self._ids[k:], self._states[k + 1 :]
        for t in output_ids[k:]:
            self._ids.append(t)
            self._states.append(self._advance(self._states[-1], t))
        return self._states[-1]


def _token_data(grammar, t: int) -> bytes | None:  # noqa: ANN001
    # an EOS that did not stop the request (ignore_eos) adds nothing; other ids their bytes
    return b"" if t == grammar.eos else grammar.tokens[t] if 0 <= t < grammar.vocab_size else None


class JsonState(_Prefixes):
    """One sequence's JSON-mode state (the parser state after its output so far)."""

    def __init__(self, grammar: JsonGrammar) -> None:
        super().__init__(grammar, (START, ()))

    def _advance(self, state, token: int):  # noqa: ANN001, ANN202
        return advance(state, _token_data(self.grammar, token))


class SchemaGrammar:
    """Structured outputs over one tokenizer's vocabulary: a `dsv4.automaton.Automaton` (a
    JSON schema, or a list of choices) and its token masks, cached per state."""

    def __init__(self, automaton, json_grammar: JsonGrammar) -> None:  # noqa: ANN001
        self.automaton = automaton
        self.tokens, self.vocab_size, self.eos = (
            json_grammar.tokens,
            json_grammar.vocab_size,
            json_grammar.eos,
        )
        self._matrix = json_grammar.all_tokens
        self._masks: dict[int, torch.Tensor] = {}

    def _lookup(self, states: np.ndarray, data: np.ndarray) -> np.ndarray:
        a = self.automaton
        a.rows(states)
        return a.table[states, data]

    def mask(self, sid: int) -> torch.Tensor:
        """bool [vocab_size]: the tokens allowed in state sid (EOS once the output is complete)."""
        if sid not in self._masks:
            ok = self._matrix.run(sid, self._lookup, 0)
            if self.automaton.accepts(sid) and 0 <= self.eos < len(ok):
                ok[self.eos] = True
            if len(self._masks) > 4096:  # bounded: unusual states are recomputed
                self._masks.clear()
            self._masks[sid] = torch.from_numpy(ok)
        return self._masks[sid]


class SchemaState(_Prefixes):
    """One sequence's structured-output state: the automaton's state after its output so far
    (0 once it left the schema)."""

    dead = 0

    def __init__(self, grammar: SchemaGrammar) -> None:
        super().__init__(grammar, grammar.automaton.START)

    def _advance(self, state, token: int):  # noqa: ANN001, ANN202
        return self.grammar.automaton.advance(state, _token_data(self.grammar, token))


class AfterTrigger:
    """A constraint that starts once `trigger` is out, on the tokens after it; before it only EOS
    is masked (thinking mode: the answer's constraint after `</think>`, and no end before it).
    The same mask interface as JsonState; None = nothing masked."""

    def __init__(self, trigger: int, inner, eos_token_id: int, vocab_size: int) -> None:  # noqa: ANN001
        self.trigger, self.inner = trigger, inner
        self._no_eos = torch.ones(vocab_size, dtype=torch.bool)
        if 0 <= eos_token_id < vocab_size:
            self._no_eos[eos_token_id] = False

    def mask(self, output_ids: list[int]) -> torch.Tensor | None:
        try:
            at = output_ids.index(self.trigger)
        except ValueError:
            return self._no_eos  # the reasoning goes on until the trigger: no end before it
        return self.inner.mask(output_ids[at + 1 :])


class Forced:
    """These tokens come first, one by one; then the constraint `then` on the rest (None:
    nothing masked; also once the output left the forced tokens)."""

    def __init__(self, ids: list[int], vocab_size: int, then=None) -> None:  # noqa: ANN001
        self.ids, self.vocab_size, self.then = list(ids), vocab_size, then
        self._only: dict[
            int, torch.Tensor
        ] = {}  # (one tensor per token: the sampler's device cache)

    def mask(self, done: list[int]) -> torch.Tensor | None:
        n = len(self.ids)
        if done[:n] != self.ids[: len(done)]:
            return None
        if len(done) >= n:
            return None if self.then is None else self.then.mask(done[n:])
        t = self.ids[len(done)]
        if t not in self._only:
            self._only[t] = torch.zeros(self.vocab_size, dtype=torch.bool)
            self._only[t][t] = True
        return self._only[t]


def forced_after(trigger: int, ids: list[int], eos_token_id: int, vocab_size: int,
                 then=None) -> AfterTrigger:  # noqa: ANN001  # fmt: skip
    """Once `trigger` is out the next tokens are `ids`, and EOS waits for them, then `then`
    constrains the rest (thinking mode's tool_choice "required" / named: after `</think>`, the
    DSML call's start, then its constrained arguments)."""
    return AfterTrigger(trigger, Forced(ids, vocab_size, then), eos_token_id, vocab_size)
