from __future__ import annotations

import json
import random

import numpy as np
import pytest

from dsv4.chat import render_tool_calls, tool_call_prefix
from dsv4.dsml_grammar import compile_tool_calls
from dsv4.json_schema import SchemaError
from dsv4.parsers import parse_completion
from tests.test_json_schema import _instance

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["c", "f"]}, "when": {"type": "string", "format": "date"},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                   "note": {"type": ["string", "null"], "maxLength": 5}},
    "required": ["city"]}}}  # fmt: skip
NOW = {
    "type": "function",
    "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, NOW]


def accepts(auto, text: str) -> bool:  # noqa: ANN001
    sid = auto.advance(auto.START, text.encode())
    return sid != 0 and auto.accepts(sid)


def test_rendered_calls_are_accepted_and_others_not():
    named, required = (
        compile_tool_calls(TOOLS, "get_weather", False),
        compile_tool_calls(TOOLS, None),
    )
    rng = random.Random(0)
    schema = WEATHER["function"]["parameters"]
    for _ in range(100):
        args = _instance(schema, rng, schema)
        args.pop("x0", None)  # (no other keys)
        args = {k: v for k, v in args.items() if k in schema["properties"]}
        if "when" in args:
            args["when"] = "2024-05-0" + str(rng.randint(1, 9))
        if isinstance(args.get("note"), str):
            args["note"] = args["note"][:5].replace("<", "")
        if isinstance(args.get("city"), str):
            args["city"] = args["city"].replace("<", "")
        jsonschema.validate(args, schema)
        text = render_tool_calls([("get_weather", args)])
        assert accepts(named, text[len(tool_call_prefix("get_weather")) :]), text
        assert accepts(required, text[len(tool_call_prefix(None)) :]), text
        two = render_tool_calls([("get_weather", args), ("now", {})])
        assert accepts(required, two[len(tool_call_prefix(None)) :]), two
        assert not accepts(named, two[len(tool_call_prefix("get_weather")) :])  # a name: one call
    for args in ({"days": 2}, {"city": "x", "days": 9}, {"city": "x", "unit": "k"}, {"city": "x", "zz": 1},
                 {"city": "x", "when": "05/01/2024"}, {"city": "x", "note": "toolong"}):  # fmt: skip
        text = render_tool_calls([("get_weather", args)])
        assert not accepts(named, text[len(tool_call_prefix("get_weather")) :]), args
    # a free string may hold anything but the parameter's closing tag
    text = render_tool_calls([("get_weather", {"city": "a </b> <｜DSML｜x"})])
    assert accepts(named, text[len(tool_call_prefix("get_weather")) :])


def test_walks_parse_to_valid_arguments():
    # random walks through the automaton that finish are calls the DSML parser reads back with
    # arguments valid under the tool's schema
    auto = compile_tool_calls(TOOLS, None)
    rng = random.Random(1)
    prefer = set(b'<>/"0123456789\n') | set("｜DSML｜".encode())
    finished = 0
    for _ in range(300):
        sid, out = auto.START, bytearray()
        for _ in range(600):
            auto.rows(np.array([sid]))
            allowed = np.nonzero(auto.table[sid])[0].tolist()
            if not allowed:
                break
            good = [b for b in allowed if b in prefer]
            out.append(rng.choice(good if good and rng.random() < 0.9 else allowed))
            sid = auto.step(sid, out[-1])
        if not auto.accepts(sid):
            continue
        finished += 1
        parsed = parse_completion(
            tool_call_prefix(None) + out.decode("utf-8", "replace"), tools=TOOLS
        )
        assert parsed["tool_calls"], out
        for call in parsed["tool_calls"]:
            fn = {"get_weather": WEATHER, "now": NOW}[call["function"]["name"]]["function"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), fn["parameters"])
    assert finished >= 20, finished


def test_strict_functions_must_compile():
    email = {"type": "object", "properties": {"e": {"type": "string", "format": "email"}}}
    strict = {"type": "function", "function": {"name": "s", "strict": True, "parameters": email}}
    with pytest.raises(SchemaError, match="format 'email'"):
        compile_tool_calls([strict], "s")
    loose = {"type": "function", "function": {"name": "s", "parameters": email}}
    auto = compile_tool_calls([loose], "s")  # (the value is left free)
    text = render_tool_calls([("s", {"e": "anything"})])
    assert accepts(auto, text[len(tool_call_prefix("s")) :])
    with pytest.raises(SchemaError, match="not in tools"):
        compile_tool_calls([loose], "missing")
