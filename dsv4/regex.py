"""Regular expressions (a common subset) compiled into a `dsv4.automaton.Automaton` graph: a JSON
schema's `pattern`, vLLM's guided_regex, SGLang's regex.

  regex_piece(a, pattern, json_string) -> (entry, exit)   the piece of graph that matches it
  compile_regex(pattern) -> Automaton     the output matches it as a whole

Syntax and meaning are Python's `re` with re.ASCII (what users of both engines write): literals;
escapes \\d \\D \\w \\W \\s \\S (ASCII classes), \\t \\n \\r \\f \\v \\a \\0, \\xHH, \\uXXXX,
\\UXXXXXXXX and escaped punctuation; classes [...] with ranges, negation and those escapes; '.'
(any character but a newline); groups (...) and (?:...); alternation; the quantifiers * + ?
{n} {n,} {n,m} and their lazy forms (the same language); '^' first and '$' last. Anything else
(backreferences, lookaround, \\b, inline flags, named groups, possessive quantifiers) is a
SchemaError naming it. Characters are code points matched as UTF-8; inside a JSON string each is
written in its JSON form as `json.dumps` writes it ('"' as \\", control characters escaped).
"""

from __future__ import annotations

import json
from functools import lru_cache

from dsv4.automaton import MAX_COUNT, Automaton, SchemaError, _bits

MAX_CP = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
DIGITS = [(0x30, 0x39)]
WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
SPACE = [(0x09, 0x0D), (0x20, 0x20)]
ESCAPES = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "a": 7, "0": 0}


def _norm(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _gaps(lo: int, hi: int, removed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    # the parts of lo..hi that no range of `removed` covers
    out, at = [], lo
    for a, b in _norm(removed):
        if a > hi:
            break
        if a > at:
            out.append((at, a - 1))
        at = max(at, b + 1)
    if at <= hi:
        out.append((at, hi))
    return out


def _negate(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return _gaps(0, MAX_CP, ranges + [SURROGATES])


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The code points lo..hi (no surrogates) as UTF-8: sequences of byte ranges, each byte
    position one contiguous range."""
    if lo > hi:
        return []
    if lo <= SURROGATES[1] and hi >= SURROGATES[0]:
        return utf8_sequences(lo, SURROGATES[0] - 1) + utf8_sequences(SURROGATES[1] + 1, hi)
    for top in (0x7F, 0x7FF, 0xFFFF):  # one encoded length at a time
        if lo <= top < hi:
            return utf8_sequences(lo, top) + utf8_sequences(top + 1, hi)
    if hi <= 0x7F:
        return [[(lo, hi)]]
    for i in (1, 2, 3):  # split until the trailing bytes of lo and hi span whole ranges
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                return utf8_sequences(lo, lo | m) + utf8_sequences((lo | m) + 1, hi)
            if hi & m != m:
                return utf8_sequences(lo, (hi & ~m) - 1) + utf8_sequences(hi & ~m, hi)
    a, b = chr(lo).encode(), chr(hi).encode()
    return [list(zip(a, b))]


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p, self.i = pattern, 0

    def fail(self, what: str) -> SchemaError:
        return SchemaError(f"regex {self.p!r}: {what} (at {self.i}) is not supported")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def take(self) -> str:
        c = self.p[self.i]
        self.i += 1
        return c

    # tree: ("set", ranges) | ("seq", [..]) | ("alt", [..]) | ("rep", node, lo, hi | None)
    def alternation(self) -> tuple:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence())
        return ("alt", branches) if len(branches) > 1 else branches[0]

    def sequence(self) -> tuple:
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.repeat(self.atom()))
        return ("seq", items)

    def atom(self) -> tuple:
        c = self.take()
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.fail("a '(?' group other than (?:")
            inner = self.alternation()
            if self.peek() != ")":
                raise SchemaError(f"regex {self.p!r}: missing ')'")
            self.take()
            return inner
        if c == ")":
            raise SchemaError(f"regex {self.p!r}: unbalanced ')'")
        if c == "[":
            return ("set", self.klass())
        if c == ".":
            return ("set", _negate([(10, 10)]))
        if c == "\\":
            return ("set", self.escape(in_class=False))
        if c in "*+?":
            raise SchemaError(f"regex {self.p!r}: nothing to repeat at {self.i - 1}")
        if c in "^$":
            raise self.fail(f"'{c}' inside the pattern")
        return ("set", [(ord(c), ord(c))])

    def repeat(self, node: tuple) -> tuple:
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.take()
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and self._counted():
                lo, hi = self._counted(take=True)
            else:
                return node
            if self.peek() == "?":  # lazy: the same strings
                self.take()
            elif self.peek() == "+":
                raise self.fail("a possessive quantifier")
            if (hi if hi is not None else lo) > MAX_COUNT:
                raise SchemaError(f"regex {self.p!r}: a count above {MAX_COUNT} is not supported")
            node = ("rep", node, lo, hi)

    def _counted(self, take: bool = False):  # noqa: ANN202
        # {n}, {n,}, {n,m} at i -> (lo, hi); None when '{' is a literal there (as in Python)
        end = self.p.find("}", self.i)
        body = self.p[self.i + 1 : end] if end > 0 else ""
        lo_s, comma, hi_s = body.partition(",")
        if not lo_s.isdigit() or (hi_s and not hi_s.isdigit()):
            return None
        lo, hi = int(lo_s), (int(hi_s) if hi_s else None) if comma else int(lo_s)
        if hi is not None and hi < lo:
            raise SchemaError(f"regex {self.p!r}: min repeat greater than max repeat")
        if take:
            self.i = end + 1
        return lo, hi

    def klass(self) -> list[tuple[int, int]]:
        negated = self.peek() == "^"
        if negated:
            self.take()
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.peek() is None:
                raise SchemaError(f"regex {self.p!r}: unterminated character class")
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "[" and self.peek() in (":", "=", "."):
                raise self.fail("a POSIX class")
            lo = self.escape(in_class=True) if c == "\\" else [(ord(c), ord(c))]
            if self.peek() == "-" and self.p[self.i + 1 : self.i + 2] not in ("]", ""):
                self.take()
                d = self.take()
                hi = self.escape(in_class=True) if d == "\\" else [(ord(d), ord(d))]
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    raise SchemaError(f"regex {self.p!r}: a bad class range at {self.i}")
                if hi[0][0] < lo[0][0]:
                    raise SchemaError(f"regex {self.p!r}: a class range out of order at {self.i}")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges.extend(lo)
        return _negate(ranges) if negated else _norm(ranges)

    def escape(self, in_class: bool) -> list[tuple[int, int]]:
        if self.peek() is None:
            raise SchemaError(f"regex {self.p!r}: a trailing backslash")
        c = self.take()
        named = {"d": DIGITS, "w": WORD, "s": SPACE}
        if c in named:
            return named[c]
        if c.lower() in named:
            return _negate(named[c.lower()])
        if c in ESCAPES and not (c == "0" and self.peek() is not None and self.peek().isdigit()):
            return [(ESCAPES[c],) * 2]
        if c == "b" and in_class:
            return [(8, 8)]
        for key, n in (("x", 2), ("u", 4), ("U", 8)):
            if c == key:
                digits = self.p[self.i : self.i + n]
                if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                    raise SchemaError(f"regex {self.p!r}: a bad \\{key} escape at {self.i}")
                self.i += n
                cp = int(digits, 16)
                if cp > MAX_CP or SURROGATES[0] <= cp <= SURROGATES[1]:
                    raise SchemaError(f"regex {self.p!r}: \\{key}{digits} is not a character")
                return [(cp, cp)]
        if c.isalnum():
            raise self.fail(f"the escape \\{c}")
        return [(ord(c), ord(c))]


def parse(pattern: str) -> tuple[tuple, bool, bool]:
    """(tree, anchored at the start, anchored at the end)."""
    if not isinstance(pattern, str):
        raise SchemaError(f"a regex must be a string, got {pattern!r}")
    start = pattern.startswith("^")
    body = pattern[1:] if start else pattern
    # ('$' after an odd number of backslashes is a literal)
    end = body.endswith("$") and (len(body[:-1]) - len(body[:-1].rstrip("\\"))) % 2 == 0
    body = body[:-1] if end else body
    p = _Parser(body)
    tree = p.alternation()
    if p.peek() is not None:
        raise SchemaError(f"regex {pattern!r}: unbalanced ')'")
    if (start or end) and tree[0] == "alt":  # ('^a|b' anchors only its first branch)
        raise SchemaError(
            f"regex {pattern!r}: anchors beside a top-level '|' are not supported; group it: ^(?:...)$"
        )
    return tree, start, end


def _char_bytes(cp: int, json_string: bool) -> bytes:
    # a code point as written: raw UTF-8, or inside a JSON string its json.dumps form
    return (
        json.dumps(chr(cp), ensure_ascii=False)[1:-1].encode() if json_string else chr(cp).encode()
    )


def _set_piece(a: Automaton, ranges: list[tuple[int, int]], json_string: bool) -> tuple[int, int]:
    alts = []
    if json_string:  # the characters JSON escapes, each as its escape
        special = [
            cp for cp in (*range(0x20), 0x22, 0x5C) if any(lo <= cp <= hi for lo, hi in ranges)
        ]
        alts += [a.lit(_char_bytes(cp, True)) for cp in special]
        ranges = [r for lo, hi in ranges for r in _gaps(lo, hi, [(c, c) for c in special])]
    for lo, hi in ranges:
        for seq in utf8_sequences(lo, hi):
            alts.append(a.seq(*(a.byte_set(_bits(range(x, y + 1))) for x, y in seq)))
    if not alts:
        raise SchemaError("a regex class that matches no character")
    return alts[0] if len(alts) == 1 else a.alt(*alts)


def _piece(a: Automaton, node: tuple, json_string: bool, ref=None) -> tuple[int, int]:  # noqa: ANN001
    # a tree's piece of graph (ref(name): the piece of a ("ref", name) node, `dsv4.ebnf`'s rules)
    kind = node[0]
    if kind == "set":
        return _set_piece(a, node[1], json_string)
    if kind == "ref":
        return ref(node[1])
    if kind == "seq":
        return a.seq(*(_piece(a, x, json_string, ref) for x in node[1])) if node[1] else a.empty()
    if kind == "alt":
        return a.alt(*(_piece(a, x, json_string, ref) for x in node[1]))
    _, inner, lo, hi = node
    return a.repeat(lambda: _piece(a, inner, json_string, ref), lo, hi)


def regex_piece(
    a: Automaton, pattern: str, json_string: bool, search: bool = False
) -> tuple[int, int]:
    """The graph piece of strings the regex matches (search: also with anything before / after
    unless anchored by '^' / '$', as a JSON schema's `pattern`; else the whole string)."""
    tree, start, end = parse(pattern)
    body = _piece(a, tree, json_string)
    if not search:
        return body
    anything = ("rep", ("set", _negate([])), 0, None)
    before = a.empty() if start else _piece(a, anything, json_string)
    after = a.empty() if end else _piece(a, anything, json_string)
    return a.seq(before, body, after)


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> Automaton:
    a = Automaton()
    a.finish(regex_piece(a, pattern, json_string=False), ws=False)
    return a


def compile_regex(pattern: str) -> Automaton:
    """The output matches this regex as a whole (vLLM's guided_regex, SGLang's regex)."""
    if not isinstance(pattern, str):
        raise SchemaError(f"a regex must be a string, got {pattern!r}")
    return _compiled(pattern)
