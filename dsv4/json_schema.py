"""Structured outputs: a JSON schema (or a list of choices) compiled to a byte automaton.

  compile_schema(schema) -> Automaton     response_format json_schema (cached per schema)
  compile_choice(choices) -> Automaton    vLLM's guided_choice: the output is one of the strings

The schema becomes a `dsv4.automaton.Automaton`: a `$ref` and a free-form JSON value are
subroutines, so recursive schemas and nested free JSON work, up to MAX_DEPTH calls deep. The
token masks over a vocabulary are `dsv4.grammar`'s (`SchemaGrammar`).

What the output may be (as vLLM's xgrammar backend and OpenAI's strict mode):
- Objects write their declared properties in the schema's order; required ones must appear,
  optional ones may be left out. Other keys only with `additionalProperties` true or a schema
  (after the declared ones). An object schema with no `properties` takes any members.
- Whitespace is free between tokens (xgrammar's any_whitespace). Strings are checked as UTF-8.
- Supported: type (or a list of types), enum, const, properties, required,
  additionalProperties, items, prefixItems, minItems / maxItems, minLength / maxLength, anyOf,
  oneOf (as anyOf: exclusivity is not enforced), allOf with one schema, $ref into the document
  ("#", "#/$defs/..", "#/definitions/.."), nullable, annotations (title, description, ..),
  minimum / maximum / exclusiveMinimum / exclusiveMaximum (any bounds for integers; whole-number
  bounds for numbers, which are then written without an exponent), pattern (`dsv4.regex`'s
  syntax; a search, as JSON schema means it), and the string formats date, time, date-time
  (RFC 3339; days 01-31 in every month), uuid and ipv4. Any other keyword or format (multipleOf,
  email, ...) is a SchemaError naming it and its place: a constraint is never silently dropped.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any

from dsv4.automaton import MAX_COUNT, Automaton, SchemaError, _bits
from dsv4.regex import regex_piece

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
               "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict"}  # fmt: skip
KEYWORDS = {"type", "enum", "const", "properties", "required", "additionalProperties", "items",
            "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "anyOf", "oneOf",
            "allOf", "$ref", "nullable", "minimum", "maximum", "exclusiveMinimum",
            "exclusiveMaximum", "format", "pattern"}  # fmt: skip
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
FORMATS = ("date", "time", "date-time", "uuid", "ipv4")
# a bound of an integer as the first / last integer inside it
INT_BOUND = {"minimum": math.ceil, "maximum": math.floor,
             "exclusiveMinimum": lambda v: math.floor(v) + 1, "exclusiveMaximum": lambda v: math.ceil(v) - 1}  # fmt: skip
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


DIGIT = _bits(b"0123456789")
NONZERO = _bits(b"123456789")
HEX = _bits(b"0123456789abcdefABCDEF")
# an unescaped string character: printable ASCII but '"' and '\', or one well-formed UTF-8
# sequence (RFC 3629: no overlong forms, surrogates or code points past U+10FFFF), byte ranges
PLAIN = _bits(range(0x20, 0x80)) & ~_bits(b'"\\')
UTF8 = [
    [(0xC2, 0xDF), (0x80, 0xBF)],
    [(0xE0, 0xE0), (0xA0, 0xBF), (0x80, 0xBF)],
    [(0xE1, 0xEC), (0x80, 0xBF), (0x80, 0xBF)],
    [(0xED, 0xED), (0x80, 0x9F), (0x80, 0xBF)],
    [(0xEE, 0xEF), (0x80, 0xBF), (0x80, 0xBF)],
    [(0xF0, 0xF0), (0x90, 0xBF), (0x80, 0xBF), (0x80, 0xBF)],
    [(0xF1, 0xF3), (0x80, 0xBF), (0x80, 0xBF), (0x80, 0xBF)],
    [(0xF4, 0xF4), (0x80, 0x8F), (0x80, 0xBF), (0x80, 0xBF)],
]
ESCAPED = _bits(b'"\\/bfnrt')


# ---- the schema's pieces ------------------------------------------------------------------------
class _Compiler:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.a = Automaton()
        self.subs: dict[tuple, int] = {}  # (document, $ref) -> the entry of its subroutine
        self._any: int | None = None

    # -- JSON values
    def utf8_multibyte(self) -> list[tuple[int, int]]:
        """One piece per well-formed multi-byte UTF-8 sequence form (`UTF8`)."""
        a = self.a
        return [a.seq(*(a.byte_set(_bits(range(lo, hi + 1))) for lo, hi in seq)) for seq in UTF8]

    def string_char(self) -> tuple[int, int]:
        a = self.a
        utf8 = a.alt(a.byte_set(PLAIN), *self.utf8_multibyte())
        unicode = a.seq(a.lit(b"u"), *(a.byte_set(HEX) for _ in range(4)))
        escape = a.seq(a.lit(b"\\"), a.alt(a.byte_set(ESCAPED), unicode))
        return a.alt(utf8, escape)

    def string(self, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        a = self.a
        return a.seq(a.lit(b'"'), self.a.repeat(self.string_char, lo, hi), a.lit(b'"'))

    def number(self, integer: bool) -> tuple[int, int]:
        a = self.a

        def digits() -> tuple[int, int]:
            return a.seq(a.byte_set(DIGIT), a.star(a.byte_set(DIGIT)))

        whole = a.seq(a.opt(a.lit(b"-")), a.alt(a.lit(b"0"), a.seq(a.byte_set(NONZERO), a.star(a.byte_set(DIGIT)))))  # fmt: skip
        if integer:
            return whole
        frac = a.opt(a.seq(a.lit(b"."), digits()))
        exp = a.opt(a.seq(a.byte_set(_bits(b"eE")), a.opt(a.byte_set(_bits(b"+-"))), digits()))
        return a.seq(whole, frac, exp)

    # -- numbers in a range (canonical decimal digits: no leading zeros)
    def same_length(self, x: str, y: str) -> tuple[int, int]:
        # the digit strings of len(x) between x and y (x <= y, as many digits)
        a = self.a
        if not x:
            return a.empty()
        if x[0] == y[0]:
            return a.seq(a.lit(x[0].encode()), self.same_length(x[1:], y[1:]))
        rest = len(x) - 1
        parts = [
            a.seq(a.lit(x[0].encode()), self.same_length(x[1:], "9" * rest)),
            a.seq(a.lit(y[0].encode()), self.same_length("0" * rest, y[1:])),
        ]
        if int(y[0]) - int(x[0]) > 1:
            mid = a.byte_set(_bits(range(ord(x[0]) + 1, ord(y[0]))))
            parts.append(a.seq(mid, *(a.byte_set(DIGIT) for _ in range(rest))))
        return a.alt(*parts)

    def digits_between(self, lo: int, hi: int | None) -> tuple[int, int]:
        """The decimal digits of the integers lo..hi (hi None: no end), 0 <= lo <= hi."""
        a = self.a
        n = len(str(lo))
        if hi is None:
            longer = a.seq(
                a.byte_set(NONZERO),
                *(a.byte_set(DIGIT) for _ in range(n)),
                a.star(a.byte_set(DIGIT)),
            )
            return a.alt(self.same_length(str(lo), "9" * n), longer)
        parts = []
        for width in range(n, len(str(hi)) + 1):
            x = str(lo) if width == n else "1" + "0" * (width - 1)
            y = str(hi) if width == len(str(hi)) else "9" * width
            parts.append(self.same_length(x, y))
        return a.alt(*parts)

    def decimal_between(self, lo: int, lo_in: bool, hi: int | None, hi_in: bool, integer: bool):  # noqa: ANN201
        # a non-negative decimal (no sign, no exponent) in the range between integers lo <= hi,
        # each end included or not: by its integer part; a fraction only where it stays inside
        a = self.a
        frac_any = a.opt(a.seq(a.lit(b"."), a.byte_set(DIGIT), a.star(a.byte_set(DIGIT))))
        parts = []
        if integer:
            first, last = lo + (not lo_in), None if hi is None else hi - (not hi_in)
            return self.digits_between(first, last) if last is None or first <= last else None
        if hi is not None and lo > hi:
            return None
        if hi is not None and lo == hi:  # one point: lo itself, zeros after the point
            return (
                a.seq(self.digits_between(lo, lo), self._zero_frac()) if lo_in and hi_in else None
            )
        if lo_in:
            parts.append(a.seq(self.digits_between(lo, lo), frac_any))
        else:  # above lo: a fraction with a non-zero digit
            nonzero = a.seq(
                a.lit(b"."),
                a.star(a.byte_set(DIGIT)),
                a.byte_set(NONZERO),
                a.star(a.byte_set(DIGIT)),
            )
            parts.append(a.seq(self.digits_between(lo, lo), nonzero))
        if hi is None or hi - lo >= 2:
            parts.append(
                a.seq(self.digits_between(lo + 1, None if hi is None else hi - 1), frac_any)
            )
        if hi is not None and hi_in:
            parts.append(a.seq(self.digits_between(hi, hi), self._zero_frac()))
        return a.alt(*parts)

    def _zero_frac(self) -> tuple[int, int]:
        a = self.a
        return a.opt(a.seq(a.lit(b"."), a.lit(b"0"), a.star(a.lit(b"0"))))

    def bounded(self, t: str, s: dict, path: str) -> tuple[int, int]:
        """An integer or a number between minimum / exclusiveMinimum and maximum /
        exclusiveMaximum (a bounded number is written without an exponent; its bounds must be
        whole numbers)."""
        a = self.a
        lo = hi = None
        lo_in = hi_in = True
        for key in BOUNDS:
            v = s.get(key)
            if v is None:
                continue
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or v != v
                or v in (float("inf"), -float("inf"))
            ):
                raise SchemaError(f"{path}: {key} must be a finite number, got {v!r}")
            if t == "integer":  # the integers inside: inclusive integer bounds
                v, inclusive = INT_BOUND[key](v), True
            elif v != int(v):
                raise SchemaError(
                    f"{path}: {key} {v!r} is not supported for numbers (only whole bounds)"
                )
            else:
                inclusive = not key.startswith("exclusive")
            v = int(v)
            if key.endswith("inimum") and (lo is None or v > lo or (v == lo and not inclusive)):
                lo, lo_in = v, inclusive
            if key.endswith("aximum") and (hi is None or v < hi or (v == hi and not inclusive)):
                hi, hi_in = v, inclusive
        integer = t == "integer"
        parts = []
        if hi is None or hi > 0 or (hi == 0 and hi_in):  # x >= 0
            start, start_in = (0, True) if lo is None or lo < 0 else (lo, lo_in)
            part = self.decimal_between(start, start_in, hi, hi_in, integer)
            if part is not None:
                parts.append(part)
        if lo is None or lo < 0:  # x < 0: "-" and -x between -hi and -lo (ends swapped)
            start, start_in = (0, False) if hi is None or hi >= 0 else (-hi, hi_in)
            part = self.decimal_between(
                start, start_in, None if lo is None else -lo, lo_in, integer
            )
            if part is not None:
                parts.append(a.seq(a.lit(b"-"), part))
        if not parts:
            raise SchemaError(f"{path}: no {t} fits the bounds")
        return a.alt(*parts)

    def patterned(self, s: dict, path: str) -> tuple[int, int]:
        """A string with a match of `pattern` (a search, as JSON schema means it: anchor with ^ $)."""
        a = self.a
        other = sorted({"minLength", "maxLength", "format"} & set(s))
        if other:
            raise SchemaError(f"{path}: pattern beside {other[0]} is not supported")
        try:
            body = regex_piece(a, s["pattern"], json_string=True, search=True)
        except SchemaError as e:
            raise SchemaError(f"{path}: {e}") from None
        return a.seq(a.lit(b'"'), body, a.lit(b'"'))

    # -- string formats
    def formatted(self, s: dict, path: str, quoted: bool = True) -> tuple[int, int]:
        a = self.a
        fmt = s["format"]
        if fmt not in FORMATS:
            raise SchemaError(
                f"{path}: format {fmt!r} is not supported (only {', '.join(FORMATS)})"
            )
        if {"minLength", "maxLength"} & set(s):
            raise SchemaError(f"{path}: format beside minLength / maxLength is not supported")

        def digits(n: int) -> tuple[int, int]:
            return a.seq(*(a.byte_set(DIGIT) for _ in range(n)))

        def hexes(n: int) -> tuple[int, int]:
            return a.seq(*(a.byte_set(HEX) for _ in range(n)))

        def date() -> tuple[int, int]:  # (days 01-31 in every month)
            return a.seq(
                digits(4),
                a.lit(b"-"),
                self.same_length("01", "12"),
                a.lit(b"-"),
                self.same_length("01", "31"),
            )

        def time() -> tuple[int, int]:
            hms = a.seq(self.same_length("00", "23"), a.lit(b":"), self.same_length("00", "59"), a.lit(b":"),
                        self.same_length("00", "60"))  # fmt: skip
            frac = a.opt(a.seq(a.lit(b"."), a.byte_set(DIGIT), a.star(a.byte_set(DIGIT))))
            offset = a.seq(
                a.byte_set(_bits(b"+-")),
                self.same_length("00", "23"),
                a.lit(b":"),
                self.same_length("00", "59"),
            )
            return a.seq(hms, frac, a.alt(a.byte_set(_bits(b"Zz")), offset))

        if fmt == "date":
            body = date()
        elif fmt == "time":
            body = time()
        elif fmt == "date-time":
            body = a.seq(date(), a.byte_set(_bits(b"Tt")), time())
        elif fmt == "uuid":
            body = a.seq(
                hexes(8),
                a.lit(b"-"),
                hexes(4),
                a.lit(b"-"),
                hexes(4),
                a.lit(b"-"),
                hexes(4),
                a.lit(b"-"),
                hexes(12),
            )
        else:  # ipv4: four numbers 0-255, no leading zeros
            octets = [self.digits_between(0, 255) for _ in range(4)]
            body = a.seq(octets[0], *(a.seq(a.lit(b"."), o) for o in octets[1:]))
        return a.seq(a.lit(b'"'), body, a.lit(b'"')) if quoted else body

    def any_value(self) -> tuple[int, int]:
        """A call of the free-form JSON value subroutine (built once)."""
        a = self.a
        if self._any is None:
            self._any = entry = a.node()
            end = a.node()
            a.ret.add(end)

            def member() -> tuple[int, int]:
                return a.seq(self.string(), a.ws(), a.lit(b":"), a.ws(), a.calls(entry))

            obj = self.container(b"{", b"}", member, 0, None)
            arr = self.container(b"[", b"]", lambda: a.calls(entry), 0, None)
            scalars = [self.string(), self.number(False)]
            scalars += [a.lit(w) for w in (b"true", b"false", b"null")]
            body = a.alt(obj, arr, *scalars)
            a.seq((entry, entry), body, (end, end))
        return a.calls(self._any)

    def container(self, open_: bytes, close: bytes, item, lo: int, hi: int | None):  # noqa: ANN001, ANN201
        a = self.a
        items = self.a.repeat(item, lo, hi, self.comma)
        return a.seq(a.lit(open_), a.ws(), items, a.ws(), a.lit(close))

    # -- schemas
    def value(self, s: Any, path: str) -> tuple[int, int]:
        a = self.a
        if s is True or s == {}:
            return self.any_value()
        if s is False:
            raise SchemaError(f"{path}: the schema false allows no value")
        if not isinstance(s, dict):
            raise SchemaError(f"{path}: a schema must be an object or a boolean, got {s!r}")
        unknown = sorted(set(s) - KEYWORDS - ANNOTATIONS)
        if unknown:
            raise SchemaError(f"{path}: '{unknown[0]}' is not supported")
        if s.get("nullable"):
            rest = {k: v for k, v in s.items() if k != "nullable"}
            return a.alt(self.value(rest, path), a.lit(b"null"))
        if "$ref" in s:
            self._only(s, "$ref", path)
            return self.ref(s["$ref"], path)
        if "const" in s or "enum" in s:
            values = [s["const"]] if "const" in s else s["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{path}: enum must be a non-empty list")
            return a.alt(*(self.literal(v) for v in values))
        for key in ("anyOf", "oneOf"):
            if key in s:
                subs = s[key]
                if not isinstance(subs, list) or not subs:
                    raise SchemaError(f"{path}: {key} must be a non-empty list")
                rest = {k: v for k, v in s.items() if k != key and k not in ANNOTATIONS}
                if rest:
                    raise SchemaError(f"{path}: {key} beside {sorted(rest)[0]!r} is not supported")
                return a.alt(*(self.value(x, f"{path}/{key}/{i}") for i, x in enumerate(subs)))
        if "allOf" in s:
            subs = s["allOf"]
            if not isinstance(subs, list) or len(subs) != 1 or len(set(s) - ANNOTATIONS) != 1:
                raise SchemaError(
                    f"{path}: allOf is supported with one schema and nothing beside it"
                )
            return self.value(subs[0], f"{path}/allOf/0")
        types = s.get("type")
        if types is None:
            if {"properties", "additionalProperties", "required"} & set(s):
                types = "object"
            elif {"items", "prefixItems", "minItems", "maxItems"} & set(s):
                types = "array"
            elif {"minLength", "maxLength"} & set(s):
                types = "string"
            else:
                return self.any_value()
        names = types if isinstance(types, list) else [types]
        bad = [t for t in names if t not in TYPES]
        if bad or not names:
            raise SchemaError(
                f"{path}: type must be one of {', '.join(TYPES)} (or a list), got {types!r}"
            )
        return a.alt(*(self.typed(t, s, path) for t in dict.fromkeys(names)))

    def typed(self, t: str, s: dict, path: str) -> tuple[int, int]:
        a = self.a
        if t == "string":
            if "pattern" in s:
                return self.patterned(s, path)
            if "format" in s:
                return self.formatted(s, path)
            return self.string(*self._bounds(s, "minLength", "maxLength", path))
        if t in ("integer", "number"):
            if any(k in s for k in BOUNDS):
                return self.bounded(t, s, path)
            return self.number(t == "integer")
        if t == "boolean":
            return a.alt(a.lit(b"true"), a.lit(b"false"))
        if t == "null":
            return a.lit(b"null")
        if t == "array":
            return self.array(s, path)
        return self.object(s, path)

    def then(self, piece: tuple[int, int], cont: int) -> int:
        # a continuation (an entry node whose paths all reach one exit) after a piece
        self.a.eps[piece[1]].append(cont)
        return piece[0]

    def either(self, *conts: int) -> int:
        n = self.a.node()
        self.a.eps[n].extend(conts)
        return n

    def comma(self) -> tuple[int, int]:
        a = self.a
        return a.seq(a.ws(), a.lit(b","), a.ws())

    def array(self, s: dict, path: str) -> tuple[int, int]:
        a = self.a
        lo, hi = self._bounds(s, "minItems", "maxItems", path)
        prefix = s.get("prefixItems", [])
        items = s.get("items", True)
        if not isinstance(prefix, list):
            raise SchemaError(f"{path}: prefixItems must be a list")
        if not prefix:
            if items is False:
                hi = 0
            if hi is not None and lo > hi:
                raise SchemaError(f"{path}: no array fits minItems {lo} and maxItems {hi}")
            item = lambda: self.value(items, f"{path}/items")  # noqa: E731
            return self.container(b"[", b"]", item, lo, hi)
        # the prefix items one by one, built back to front as continuations: after item j the
        # array may end (minItems met) or go on with item j + 1, or after the last, with `items`
        k = len(prefix) if hi is None else min(len(prefix), hi)
        rest_hi = 0 if items is False else None if hi is None else hi - k
        out = a.node()
        end = self.then(a.seq(a.ws(), a.lit(b"]")), out)
        tail = None
        if rest_hi != 0:  # (hi >= lo, so the rest can hold the items minItems still needs)
            rest = self.a.repeat(
                lambda: self.value(items, f"{path}/items"), max(lo - k, 1), rest_hi, self.comma
            )
            tail = self.then(a.seq(self.comma(), rest, a.ws(), a.lit(b"]")), out)
        body = None
        for j in reversed(range(k)):
            conts = [end] if j + 1 >= lo else []
            if j + 1 < k:
                conts.append(self.then(self.comma(), body))
            elif tail is not None:
                conts.append(tail)
            if not conts:
                raise SchemaError(f"{path}: no array fits minItems {lo}")
            body = self.then(self.value(prefix[j], f"{path}/prefixItems/{j}"), self.either(*conts))
        first = [body] if k else []
        if lo == 0:
            first.append(end)
        if not first:
            raise SchemaError(f"{path}: no array fits minItems {lo} and maxItems {hi}")
        return self.then(a.seq(a.lit(b"["), a.ws()), self.either(*first)), out

    def object(self, s: dict, path: str) -> tuple[int, int]:
        a = self.a
        props = s.get("properties")
        extra = s.get("additionalProperties", props is None)
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{path}: required must be a list of names")
        props = props or {}
        if not isinstance(props, dict):
            raise SchemaError(f"{path}: properties must be an object")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"{path}: required property {missing[0]!r} is not in properties")

        def member(name: str) -> tuple[int, int]:
            value = self.value(props[name], f"{path}/properties/{name}")
            return a.seq(a.lit(self.dump(name)), a.ws(), a.lit(b":"), a.ws(), value)

        def any_member() -> tuple[int, int]:
            value = self.value(extra, f"{path}/additionalProperties")
            return a.seq(self.string(), a.ws(), a.lit(b":"), a.ws(), value)

        # continuations, back to front over the declared properties: f = nothing written yet,
        # w = a member written (the next one needs a comma); other keys after the declared ones
        out = a.node()
        close = self.then(a.seq(a.ws(), a.lit(b"}")), out)
        f = w = close
        if extra is not False:
            w = self.either(close)
            a.eps[w].append(self.then(a.seq(self.comma(), any_member()), w))
            f = self.either(close, self.then(a.seq(a.ws(), any_member()), w))
        first = lambda name: a.seq(a.ws(), member(name))  # noqa: E731
        later = lambda name: a.seq(self.comma(), member(name))  # noqa: E731
        return self.then(a.lit(b"{"), self.in_order(list(props), required, first, later, f, w)), out

    def in_order(self, names: list[str], required: list[str], first, later, f: int, w: int) -> int:  # noqa: ANN001
        """Members in the given order, required ones always, others optional, before the
        continuations f (nothing written yet) and w (a member written): first(name) / later(name)
        is a member's piece as the first / after another (its separator in front). Built back to
        front; -> the entry before the first member."""
        for name in reversed(names):
            wrote_f, wrote_w = self.then(first(name), w), self.then(later(name), w)
            if name in required:
                f, w = wrote_f, wrote_w
            else:
                f, w = self.either(wrote_f, f), self.either(wrote_w, w)
        return f

    def ref(self, ref: Any, path: str) -> tuple[int, int]:
        a = self.a
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(
                f"{path}: only $ref into this schema ('#...') is supported, got {ref!r}"
            )
        key = (id(self.root), ref)  # (a tool-call grammar compiles several documents)
        if key not in self.subs:
            target = self.root
            for part in [p for p in ref[1:].split("/") if p]:
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise SchemaError(f"{path}: $ref {ref!r} does not resolve")
                target = target[part]
            self.subs[key] = entry = a.node()
            end = a.node()
            a.ret.add(end)
            a.seq((entry, entry), self.value(target, ref), (end, end))
        return a.calls(self.subs[key])

    def literal(self, v: Any) -> tuple[int, int]:
        """Exactly the JSON value v, whitespace free between its tokens (the member order kept)."""
        a = self.a
        if isinstance(v, dict):
            members = [
                a.seq(a.lit(self.dump(k)), a.ws(), a.lit(b":"), a.ws(), self.literal(x))
                for k, x in v.items()
            ]
            return self.listed(b"{", b"}", members)
        if isinstance(v, list):
            return self.listed(b"[", b"]", [self.literal(x) for x in v])
        return a.lit(self.dump(v))

    def listed(self, open_: bytes, close: bytes, parts: list) -> tuple[int, int]:
        a = self.a
        body = [p if i == 0 else a.seq(self.comma(), p) for i, p in enumerate(parts)]
        return a.seq(a.lit(open_), a.ws(), *body, a.ws(), a.lit(close))

    # -- helpers
    @staticmethod
    def dump(v: Any) -> bytes:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode()

    @staticmethod
    def _only(s: dict, key: str, path: str) -> None:
        rest = sorted(set(s) - {key} - ANNOTATIONS)
        if rest:
            raise SchemaError(f"{path}: {key} beside {rest[0]!r} is not supported")

    @staticmethod
    def _bounds(s: dict, lo_key: str, hi_key: str, path: str) -> tuple[int, int | None]:
        lo, hi = s.get(lo_key, 0), s.get(hi_key)
        for key, v in ((lo_key, lo), (hi_key, hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise SchemaError(f"{path}: {key} must be an integer >= 0, got {v!r}")
            if v is not None and v > MAX_COUNT:
                raise SchemaError(f"{path}: {key} above {MAX_COUNT} is not supported")
        if hi is not None and lo > hi:
            raise SchemaError(f"{path}: {lo_key} {lo} > {hi_key} {hi}")
        return lo, hi


def _key(schema: Any) -> str:
    return json.dumps(schema)  # (keys in their order: the properties' order is the output's)


@lru_cache(maxsize=64)
def _compiled(key: str) -> Automaton:
    schema = json.loads(key)
    c = _Compiler(schema)
    c.a.finish(c.value(schema, "#"))
    return c.a


def compile_schema(schema: Any) -> Automaton:
    """The automaton of a JSON schema (a dict, a bool, or its JSON text); SchemaError if it
    cannot be constrained to. Cached per schema (the same automaton for the same schema)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise SchemaError(f"the schema is not JSON: {e}") from None
    return _compiled(_key(schema))


@lru_cache(maxsize=64)
def _choices(key: str) -> Automaton:
    a = Automaton()
    a.finish(a.alt(*(a.lit(c.encode()) for c in json.loads(key))), ws=False)
    return a


def compile_choice(choices: list[str]) -> Automaton:
    """The output is exactly one of these strings (vLLM's guided_choice)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise SchemaError("choice must be a non-empty list of strings")
    return _choices(json.dumps(choices))
