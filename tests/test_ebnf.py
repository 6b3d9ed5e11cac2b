from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from dsv4.automaton import MAX_DEPTH, SchemaError
from dsv4.ebnf import compile_grammar

JSON_GRAMMAR = r"""
root   ::= value            # one JSON value, no whitespace around it
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( member ( ws "," ws member )* )? ws "}"
member ::= string ws ":" ws value
array  ::= "[" ws ( value ( ws "," ws value )* )? ws "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ["\\/bfnrt] | "\\u" [0-9a-fA-F]{4} )* "\""
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws     ::= [ \t\n\r]*
"""


def accepts(auto, text: str) -> bool:  # noqa: ANN001
    sid = auto.advance(auto.START, text.encode())
    return sid != 0 and auto.accepts(sid)


def test_rules_references_and_comments():
    g = compile_grammar(
        'root ::= greeting " " name  # a comment\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z]+\n'
    )
    assert accepts(g, "hello Bob") and accepts(g, "hi Al")
    assert not accepts(g, "hi al") and not accepts(g, "hello  Bob") and not accepts(g, "hey Bob")
    nested = compile_grammar('root ::= "(" root ")" | "x"')  # (recursion that reads first)
    assert accepts(nested, "((x))") and not accepts(nested, "((x)")
    depth = MAX_DEPTH - 2
    assert accepts(nested, "(" * depth + "x" + ")" * depth)
    assert nested.advance(nested.START, b"(" * (MAX_DEPTH + 1)) == 0  # bounded


def test_json_grammar_takes_json_and_its_walks_are_json():
    g = compile_grammar(JSON_GRAMMAR)
    rng = random.Random(0)
    for k in range(200):
        doc = {"k": [1, -2.5e3, {"s": 'a"\\\n\u00e9' * (k % 3)}, None, True], "n": k}
        assert accepts(g, json.dumps(doc, indent=2 if k % 2 else None)), doc
    for text in ['{"a":01}', '{"a":}', "[1,]", '"\x01"', "{'a': 1}", " 1"]:
        assert not accepts(g, text), text
    finished = 0
    prefer = set(b'}]"0123456789,:tfn')
    for _ in range(200):
        sid, out = g.START, bytearray()
        for _ in range(300):
            g.rows(np.array([sid]))
            allowed = np.nonzero(g.table[sid])[0].tolist()
            assert allowed or g.accepts(sid)  # never stuck inside a value
            if g.accepts(sid) and (not allowed or rng.random() < 0.3):
                json.loads(out.decode())
                finished += 1
                break
            good = [b for b in allowed if b in prefer]
            out.append(rng.choice(good if good and rng.random() < 0.8 else allowed))
            sid = g.step(sid, out[-1])
    assert finished >= 50


def _tree(rng: random.Random, depth: int = 0) -> tuple[str, str]:
    # one random expression as (regex, grammar): the same language written both ways
    r = rng.random()
    if depth < 3 and r < 0.2:
        parts = [_tree(rng, depth + 1) for _ in range(rng.randint(2, 3))]
        return "(?:" + "|".join(p[0] for p in parts) + ")", "(" + " | ".join(
            p[1] for p in parts
        ) + ")"
    if depth < 3 and r < 0.4:
        x, y = _tree(rng, depth + 1), _tree(rng, depth + 1)
        return f"(?:{x[0]}{y[0]})", f"({x[1]} {y[1]})"
    if depth < 3 and r < 0.6:
        x = _tree(rng, depth + 1)
        q = rng.choice(["*", "+", "?", "{2}", "{0,2}", "{1,}"])
        return f"(?:{x[0]}){q}", f"({x[1]}){q}"
    if r < 0.8:
        s = "".join(rng.choice('ab"é\n') for _ in range(rng.randint(1, 2)))
        return "".join(re.escape(c) for c in s), json.dumps(s, ensure_ascii=False)
    cls = rng.choice(["[a-c]", "[^a]", "[é\\n]", "[ab]"])
    return cls, cls


def test_grammars_match_the_same_language_as_regexes():
    rng = random.Random(1)
    for _ in range(200):
        rx, gr = _tree(rng)
        auto = compile_grammar(f"root ::= {gr}")
        want = re.compile(rx, re.ASCII | re.DOTALL)
        for _ in range(40):
            s = "".join(rng.choice('ab"éc\n') for _ in range(rng.randint(0, 5)))
            assert accepts(auto, s) == bool(want.fullmatch(s)), (rx, gr, s)


@pytest.mark.parametrize(
    "text,words",
    [
        ('greeting ::= "hi"', "no rule named 'root'"),
        ("root ::= missing", "rule 'missing' is not defined"),
        ('root ::= "a"\nroot ::= "b"', "defined twice"),
        ('root ::= expr\nexpr ::= expr "+" "1" | "1"', "left-recursive"),
        ('root ::= "x"? root "a" | "b"', "left-recursive"),
        ('root ::= "abc', "unterminated string"),
        ('root ::= ("a"', "missing ')'"),
        ('root ::= "a")', "unbalanced ')'"),
        ('root "a"', "'::=' expected"),
        ("root ::= [z-a]", "out of order"),
    ],
)
def test_what_cannot_be_taken_is_refused(text: str, words: str):
    with pytest.raises(SchemaError, match=re.escape(words)):
        compile_grammar(text)
