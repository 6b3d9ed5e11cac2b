"""JSON mode: constrained decoding for response_format {"type": "json_object"}.

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
Only the syntax is constrained (json_object), not a schema.
"""

from __future__ import annotations

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
    """Each id's bytes (a byte-level BPE's token text through the byte alphabet); None for
    special tokens and ids the tokenizer does not have."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = {ch: i for i, ch in enumerate(_byte_alphabet(ByteLevel.alphabet()))}
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    out: list[bytes | None] = []
    for i in range(vocab_size):
        text = tokenizer.id_to_token(i)
        if text is None or text in special or any(ch not in alphabet for ch in text):
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


class JsonGrammar:
    """The vocabulary's bytes and the cached masks of JSON mode (one per tokenizer)."""

    def __init__(self, tokens: list[bytes | None], eos_token_id: int) -> None:
        self.vocab_size, self.eos = len(tokens), eos_token_id
        self.tokens = tokens
        plain = [t is not None and len(t) > 0 and not any(b in BRACKETS for b in t) for t in tokens]
        self.dynamic = [i for i, t in enumerate(tokens) if t and any(b in BRACKETS for b in t)]
        # bracket-free tokens as a byte matrix, longest first, so column j is read only for the
        # rows long enough to have it (`_plain_ok`)
        lens = np.array([len(t) if p else 0 for t, p in zip(tokens, plain)], dtype=np.int64)
        self._order = np.argsort(-lens, kind="stable")
        width = int(lens.max(initial=1))
        mat = np.zeros((len(tokens), width), dtype=np.uint8)
        for r, i in enumerate(self._order):
            if plain[i]:
                mat[r, : lens[i]] = list(tokens[i])
        self._bytes, self._plain = mat, np.array(plain)
        # rows of the sorted matrix with a byte in column j: the first _active[j]
        self._active = [int((lens > j).sum()) for j in range(width)]
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

    def _plain_ok(self, mode: int) -> np.ndarray:
        # the bracket-free tokens that leave `mode` alive, all at once
        if mode not in self._by_mode:
            cur = np.full(len(self.tokens), mode, dtype=np.int64)  # in the sorted order
            for j, k in enumerate(self._active):
                cur[:k] = self._table[cur[:k], self._bytes[:k, j]]
            alive = np.empty_like(cur)
            alive[self._order] = cur
            self._by_mode[mode] = self._plain & (alive != len(_MODES))
        return self._by_mode[mode]

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


class JsonState:
    """One sequence's JSON-mode state, rebuilt from its output ids: a speculative step's
    tokens may be dropped again, so the states of every prefix are kept and the common prefix
    with the last call is reused."""

    def __init__(self, grammar: JsonGrammar) -> None:
        self.grammar = grammar
        self._ids: list[int] = []
        self._states: list[tuple | None] = [(START, ())]

    def state(self, output_ids: list[int]) -> tuple[int, tuple] | None:
        k = len(self._ids)
        if len(output_ids) < k or output_ids[:k] != self._ids:  # (the usual case: one compare)
            k = 0
            while k < min(len(self._ids), len(output_ids)) and self._ids[k] == output_ids[k]:
                k += 1
            del self._ids[k:], self._states[k + 1 :]
        g = self.grammar
        for t in output_ids[k:]:
            # an EOS that did not stop the request (ignore_eos) adds nothing; other ids their bytes
            data = b"" if t == g.eos else g.tokens[t] if 0 <= t < g.vocab_size else None
            self._ids.append(t)
            self._states.append(advance(self._states[-1], data))
        return self._states[-1]

    def mask(self, output_ids: list[int]) -> torch.Tensor | None:
        """The tokens allowed after output_ids; None once the output left JSON (an EOS or a
        forced token: nothing is masked then)."""
        state = self.state(output_ids)
        return None if state is None else self.grammar.mask(state)


class ForcedAfter:
    """A forced continuation: once `trigger` is out, the next tokens are `ids`, and EOS is masked
    until they are (thinking mode's tool_choice "required" / named: after `</think>`, the DSML
    call's start). The same mask interface as JsonState; None = nothing masked."""

    def __init__(self, trigger: int, ids: list[int], eos_token_id: int, vocab_size: int) -> None:
        self.trigger, self.ids, self.eos, self.vocab_size = (
            trigger,
            list(ids),
            eos_token_id,
            vocab_size,
        )
        self._no_eos = torch.ones(vocab_size, dtype=torch.bool)
        if 0 <= eos_token_id < vocab_size:
            self._no_eos[eos_token_id] = False

    def mask(self, output_ids: list[int]) -> torch.Tensor | None:
        try:
            at = output_ids.index(self.trigger)
        except ValueError:
            return self._no_eos  # the reasoning goes on until the trigger: no end before it
        done = output_ids[at + 1 :]
        if len(done) >= len(self.ids) or done != self.ids[: len(done)]:
            return None  # forced part out (or left: then nothing is forced any more)
        only = torch.zeros(self.vocab_size, dtype=torch.bool)
        only[self.ids[len(done)]] = True
        return only
