from __future__ import annotations

import functools
import json
import random
import re

import numpy as np
import pytest

from dsv4.json_schema import SchemaError, compile_schema
from dsv4.regex import compile_regex, utf8_sequences


def accepts(auto, text: str) -> bool:  # noqa: ANN001
    sid = auto.advance(auto.START, text.encode())
    return sid != 0 and auto.accepts(sid)


def _pattern(rng: random.Random, depth: int = 0) -> str:
    # a random pattern over a small alphabet, with every construct the compiler takes
    r = rng.random()
    if depth < 3 and r < 0.15:
        return "(" + "|".join(_pattern(rng, depth + 1) for _ in range(rng.randint(2, 3))) + ")"
    if depth < 3 and r < 0.25:
        return "(?:" + _pattern(rng, depth + 1) + _pattern(rng, depth + 1) + ")"
    if depth < 3 and r < 0.45:
        atom = _pattern(rng, depth + 1)
        if not atom or atom[-1] in "*+?}":
            atom = f"(?:{atom})"
        q = rng.choice(["*", "+", "?", "{2}", "{1,3}", "{0,2}", "{2,}", "*?", "+?"])
        return atom + q
    if r < 0.6:
        return rng.choice(
            ["a", "b", "é", "中", r"\.", "-", r"\d", r"\w", r"\s", r"\D", ".", r"\x41", r"\u00e9"]
        )
    if r < 0.8:
        body = "".join(
            rng.choice(["a-c", "x", r"\d", "é-ë", r"\-", r"\n", "_"])
            for _ in range(rng.randint(1, 3))
        )
        return "[" + rng.choice(["", "^"]) + body + "]"
    return "".join(_pattern(rng, depth + 1) for _ in range(rng.randint(1, 3)))


def _string(rng: random.Random) -> str:
    return "".join(rng.choice("abcx_-.é中A5 \n") for _ in range(rng.randint(0, 6)))


def test_random_patterns_match_as_python_re():
    # the automaton accepts exactly what re.fullmatch (re.ASCII) accepts, on random strings and
    # on strings drawn from the automaton itself
    rng = random.Random(0)
    for _ in range(300):
        pat = _pattern(rng)
        try:
            want = re.compile(pat, re.ASCII)
        except re.error:  # (a class range from \d: refused by both)
            with pytest.raises(SchemaError):
                compile_regex(pat)
            continue
        auto = compile_regex(pat)
        for _ in range(60):
            s = _string(rng)
            assert accepts(auto, s) == bool(want.fullmatch(s)), (pat, s)
        for _ in range(10):  # walks that stop on an accepting state spell a match
            sid, out = auto.START, bytearray()
            for _ in range(40):
                if auto.accepts(sid) and rng.random() < 0.4:
                    assert want.fullmatch(out.decode()), (pat, bytes(out))
                    break
                auto.rows(np.array([sid]))
                allowed = np.nonzero(auto.table[sid])[0].tolist()
                if not allowed:
                    assert auto.accepts(sid)
                    break
                out.append(rng.choice(allowed))
                sid = auto.step(sid, out[-1])


def _hit(seqs: list, b: bytes) -> bool:
    return any(len(s) == len(b) and all(x <= c <= y for c, (x, y) in zip(b, s)) for s in seqs)


def test_utf8_sequences_cover_exactly_the_range():
    rng = random.Random(1)
    for _ in range(200):
        lo = rng.choice(
            [0, 0x7F, 0x80, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000, rng.randint(0, 0x10FFFF)]
        )
        hi = min(0x10FFFF, lo + rng.choice([0, 1, 63, 64, 4095, 70000, rng.randint(0, 0x10FFFF)]))
        seqs = utf8_sequences(lo, hi)

        hit = functools.partial(_hit, seqs)

        for cp in {lo, hi, (lo + hi) // 2, *(rng.randint(lo, hi) for _ in range(50))}:
            if not 0xD800 <= cp <= 0xDFFF:
                assert hit(chr(cp).encode()), (lo, hi, cp)
        for cp in (lo - 1, hi + 1, rng.randint(0, 0x10FFFF)):
            if 0 <= cp <= 0x10FFFF and not lo <= cp <= hi and not 0xD800 <= cp <= 0xDFFF:
                assert not hit(chr(cp).encode()), (lo, hi, cp)


def test_unicode_classes_and_anchors():
    auto = compile_regex("[α-ω]+[^a-z]")
    assert accepts(auto, "αβω1") and accepts(auto, "ω中") and not accepts(auto, "αa")
    assert not accepts(compile_regex("[^a-z]"), "\ud7ff\ud7ff")  # one character only
    assert accepts(compile_regex("^ab$"), "ab") and accepts(compile_regex(r"ab\$"), "ab$")


@pytest.mark.parametrize(
    "pattern,words",
    [
        ("(?=a)b", "'(?' group"),
        ("(?P<x>a)", "'(?' group"),
        (r"(a)\1", "the escape \\1"),
        (r"\bword", "the escape \\b"),
        ("a++", "possessive"),
        ("a^b", "'^' inside"),
        ("(ab", "missing ')'"),
        ("ab)", "unbalanced ')'"),
        ("[z-a]", "out of order"),
        ("*a", "nothing to repeat"),
        ("a{5000}", "a count above"),
        ("^a|b", "top-level '|'"),
        ("[[:alpha:]]", "POSIX class"),
    ],
)
def test_what_is_not_supported_is_refused_by_name(pattern: str, words: str):
    with pytest.raises(SchemaError, match=re.escape(words)):
        compile_regex(pattern)


def test_schema_pattern_searches_inside_json_strings():
    # a schema's pattern is a search (anchor it with ^ $), over the string's value: the
    # characters JSON escapes are matched in their escaped form
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": r'^[A-Z]{2}-\d+$'},
                                               "q": {"type": "string", "pattern": '"x\\n'}}}  # fmt: skip
    auto = compile_schema(schema)
    assert accepts(auto, '{"id": "AB-12", "q": "say \\"x\\n!"}')
    assert not accepts(auto, '{"id": "AB-12x"}') and not accepts(auto, '{"q": "x"}')
    with pytest.raises(SchemaError, match="pattern beside maxLength"):
        compile_schema({"type": "string", "pattern": "a", "maxLength": 3})
    with pytest.raises(SchemaError, match="#/properties/p: regex"):
        compile_schema({"properties": {"p": {"type": "string", "pattern": "(?=a)"}}})
    rng = random.Random(2)
    for _ in range(100):
        pat = _pattern(rng)
        try:
            re.compile(pat)
        except re.error:
            continue
        one = compile_schema({"type": "string", "pattern": pat})
        for _ in range(10):
            s = _string(rng) + rng.choice(['"', "\\", "\t", ""])
            assert accepts(one, json.dumps(s, ensure_ascii=False)) == bool(
                re.search(pat, s, re.ASCII)
            ), (pat, s)
