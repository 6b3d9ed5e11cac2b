from __future__ import annotations

import json

import pytest

from dsv4.parsers import (
    ReasoningParser,
    StreamParser,
    ToolCallParser,
    merge_deltas,
    parse_completion,
)

EOS = "<｜end▁of▁sentence｜>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]


def invoke(name, *params):
    tag = '<｜DSML｜parameter name="{}" string="{}">{}</｜DSML｜parameter>\n'
    body = "".join(tag.format(*p) for p in params)
    return f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n'


def block(*invokes):
    return "\n\n<｜DSML｜tool_calls>\n" + "".join(invokes) + "</｜DSML｜tool_calls>"


PARIS = invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "3"))
ROME = invoke("get_weather", ("city", "true", 'Rome <old> & "new"'), ("days", "true", "2"))
SEARCH = invoke(
    "search",
    ("q", "true", "a\nb"),
    ("filters", "false", '{"lang": ["en", "fr"]}'),
    ("strict", "false", "true"),
    ("n", "false", "not json"),
)


def call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def result(reasoning=None, content=None, calls=()):
    calls = list(calls)
    return {
        "reasoning_content": reasoning,
        "content": content,
        "tool_calls": calls,
        "finish_reason": "tool_calls" if calls else "stop",
    }


# (text, thinking, expected message without tool-call ids)
CASES = {
    "plain": (
        "Hello, world!\n\nSecond paragraph.",
        False,
        result(content="Hello, world!\n\nSecond paragraph."),
    ),
    "plain_eos": ("Hi there" + EOS, False, result(content="Hi there")),
    "reasoning_content": (
        "Let me think.\nx < y </thin k>.</think>The answer is 4." + EOS,
        True,
        result("Let me think.\nx < y </thin k>.", "The answer is 4."),
    ),
    "reasoning_only_truncated": ("Still thinking </thi", True, result("Still thinking </thi")),
    "repeated_think_tag": ("<think>r</think>c", True, result("r", "c")),
    "content_tool_call": (
        "I'll check." + block(PARIS) + EOS,
        False,
        result(content="I'll check.", calls=[call("get_weather", {"city": "Paris", "days": 3})]),
    ),
    "multiple_tool_calls": (
        "Plan</think>" + block(PARIS, ROME, SEARCH) + EOS,
        True,
        result(
            "Plan",
            None,
            [
                call("get_weather", {"city": "Paris", "days": 3}),
                # string="true" but the schema says integer: typed from the schema.
                call("get_weather", {"city": 'Rome <old> & "new"', "days": 2}),
                call(
                    "search",
                    {
                        "q": "a\nb",
                        "filters": {"lang": ["en", "fr"]},
                        "strict": True,
                        "n": "not json",
                    },
                ),
            ],
        ),
    ),
    "tool_call_without_think_end": (
        "r" + block(PARIS),
        True,
        result("r", None, [call("get_weather", {"city": "Paris", "days": 3})]),
    ),
    "markup_lookalikes": (
        'Use <｜DSML｜tool_call> or <invoke name="x"> and <｜DSML｜invoke name="y">; '
        "end <｜DSML｜tool_calls",
        False,
        result(
            content='Use <｜DSML｜tool_call> or <invoke name="x"> and '
            '<｜DSML｜invoke name="y">; end <｜DSML｜tool_calls'
        ),
    ),
    "unclosed_block": (
        "Text" + block(PARIS)[:-19],
        False,
        result(content="Text", calls=[call("get_weather", {"city": "Paris", "days": 3})]),
    ),
    # a call cut short (max_tokens) is closed: its parameters so far, an unfinished one as text
    "unfinished_invoke_closed": (
        "Text" + block(PARIS)[:-30],
        False,
        result(content="Text", calls=[call("get_weather", {"city": "Paris", "days": 3})]),
    ),
    "unfinished_parameter_as_text": (
        "Text" + block(SEARCH)[: block(SEARCH).index("a\nb") + 2],
        False,
        result(content="Text", calls=[call("search", {"q": "a\n"})]),
    ),
    # markup that never becomes a call is text as written (cut before the name; no name)
    "unnamed_cut_kept_as_text": (
        "Text" + block(PARIS)[:40],
        False,
        result(content="Text" + block(PARIS)[:40]),
    ),
    "nameless_invoke_kept_as_text": (
        "T" + block(invoke("", ("city", "true", "Oslo")), PARIS),
        False,
        result(
            content="T" + block(invoke("", ("city", "true", "Oslo")), PARIS)[: -len(PARIS) - 20],
            calls=[call("get_weather", {"city": "Paris", "days": 3})],
        ),
    ),
    # arguments wrapped in one "arguments" / "input" parameter the schema lacks: unwrapped when
    # the schema has every inner key (vLLM's repair); kept as given otherwise
    "wrapped_arguments_unwrapped": (
        block(
            invoke("get_weather", ("arguments", "false", '{"city": "Oslo", "days": 2}')),
            invoke("get_weather", ("input", "true", '{"city": "Rome"}')),
        ),
        False,
        result(
            calls=[
                call("get_weather", {"city": "Oslo", "days": 2}),
                call("get_weather", {"city": "Rome"}),
            ]
        ),  # fmt: skip
    ),
    "wrapped_arguments_kept": (
        block(
            invoke("get_weather", ("arguments", "false", '{"town": "Oslo"}')),
            invoke("get_weather", ("city", "true", "Oslo"), ("input", "false", '{"days": 1}')),
            invoke("search", ("arguments", "false", '{"q": "x"}')),
        ),
        False,
        result(
            calls=[
                call("get_weather", {"arguments": {"town": "Oslo"}}),
                call("get_weather", {"city": "Oslo", "input": {"days": 1}}),
                call("search", {"arguments": {"q": "x"}}),
            ]
        ),  # fmt: skip
    ),
    "direct_json_and_text_after": (
        'A\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">{"q": "x"}</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>\n\nB",
        False,
        result(content="AB", calls=[call("search", {"q": "x"})]),
    ),
}


def normalise(message):
    calls = [
        {
            "type": c["type"],
            "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
        }
        for c in message["tool_calls"]
    ]
    for c, raw in zip(calls, message["tool_calls"], strict=True):
        assert raw["id"].startswith("call_")
        json.loads(c["function"]["arguments"])
    return {**message, "tool_calls": calls}


def stream(text, thinking, size):
    parser, deltas = StreamParser(thinking, TOOLS), []
    for i in range(0, len(text), size):
        deltas += parser.feed(text[i : i + size])
    return deltas + parser.finish()


@pytest.mark.parametrize("name", CASES)
def test_one_shot(name):
    text, thinking, expected = CASES[name]
    assert normalise(parse_completion(text, thinking, TOOLS)) == expected


@pytest.mark.parametrize("name", CASES)
def test_every_chunk_size_matches_one_shot(name):
    text, thinking, _ = CASES[name]
    one_shot = normalise(parse_completion(text, thinking, TOOLS))
    for size in range(1, len(text) + 1):
        deltas = stream(text, thinking, size)
        for d in deltas:  # markup leaks into the text channels only where it made no call
            if not name.endswith("kept_as_text"):
                assert "｜DSML｜parameter" not in d.get("content", "")
            assert EOS not in d.get("content", "") + d.get("reasoning_content", "")
        assert normalise(merge_deltas(deltas)) == one_shot, f"chunk size {size}"


def test_tool_call_deltas_have_openai_shape():
    # as vLLM and SGLang stream them: a call's first delta has its index, id, type and name (and
    # arguments ""), the later ones its index and a piece of the arguments' JSON, one a parameter
    parser = ToolCallParser(TOOLS)
    events = parser.feed("x" + block(PARIS, SEARCH)) + parser.finish()
    assert events[0] == {"content": "x"}
    calls = [c for e in events[1:] for c in e["tool_calls"]]
    starts = [c for c in calls if "id" in c]
    assert [c["index"] for c in starts] == [0, 1] and starts[0]["id"] != starts[1]["id"]
    assert all(c["type"] == "function" and c["function"]["arguments"] == "" for c in starts)
    pieces = [c["function"]["arguments"] for c in calls if c["index"] == 0 and "id" not in c]
    assert pieces == ['{"city": "Paris"', ', "days": 3', "}"]
    assert all(set(c) == {"index", "function"} for c in calls if "id" not in c)
    assert parser.tool_calls[1]["function"]["name"] == "search"
    assert parser.tool_calls[0]["id"] == starts[0]["id"]
    assert json.loads("".join(pieces)) == {"city": "Paris", "days": 3}


def test_one_call_without_parallel_tool_calls():
    # parallel_tool_calls=false: the first call only, whole and streamed at any chunk size
    text = "x" + block(PARIS, SEARCH)
    both = parse_completion(text, False, TOOLS)
    one = parse_completion(text, False, TOOLS, parallel=False)
    assert len(both["tool_calls"]) == 2 and len(one["tool_calls"]) == 1
    assert one["tool_calls"][0]["function"] == both["tool_calls"][0]["function"]
    assert one["content"] == "x"
    for size in (1, 5, len(text)):
        parser, deltas = StreamParser(False, TOOLS, parallel=False), []
        for i in range(0, len(text), size):
            deltas += parser.feed(text[i : i + size])
        deltas += parser.finish()
        assert all(c["index"] == 0 for d in deltas for c in d.get("tool_calls", []))
        merged = merge_deltas(deltas)
        assert [c["function"] for c in merged["tool_calls"]] == [
            c["function"] for c in one["tool_calls"]
        ]


def test_a_named_calls_text_is_not_kept():
    # a named call's markup is a call from its invoke tag on: the parser does not keep a copy of
    # its arguments' text (only text that may yet come back as content is kept)
    parser = ToolCallParser(TOOLS)
    parser.feed('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">\n')
    for _ in range(50):
        parser.feed(
            '<｜DSML｜parameter name="q" string="true">' + "y" * 1000 + "</｜DSML｜parameter>\n"
        )
    assert sum(map(len, parser._raw)) == 0
    parser.feed("</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    assert [c["function"]["name"] for c in parser.tool_calls] == ["search"]


def test_partial_markup_is_held_back():
    parser = ToolCallParser()
    assert parser.feed("Hi\n\n<｜DSML｜tool") == [{"content": "Hi"}]
    ((start,),) = [e["tool_calls"] for e in parser.feed('_calls>\n<｜DSML｜invoke name="f">\n')]
    assert start["function"] == {"name": "f", "arguments": ""}
    assert parser.feed("</｜DSML｜invoke>")[0]["tool_calls"] == [
        {"index": 0, "function": {"arguments": "{}"}}
    ]
    assert parser.finish() == []


def test_reasoning_parser_streams_incrementally():
    parser = ReasoningParser(thinking=True)
    assert parser.feed("abc</th") == ("abc", "")
    assert parser.feed("ink>de") == ("", "de")
    assert parser.feed(EOS + "junk") == ("", "")
    assert parser.finish() == ("", "")


def test_reasoning_parser_chat_mode_is_all_content():
    parser = ReasoningParser(thinking=False)
    assert parser.feed("a</think>b") == ("", "a</think>b")
    assert parser.finish() == ("", "")
