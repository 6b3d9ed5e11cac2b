"""Streaming parsers for DeepSeek-V4 output: reasoning vs content, and DSML tool calls."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from dsv4.chat import CALLS_END, CALLS_START, DSML, EOS, THINK_END, THINK_START

INVOKE_START = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAM_START = f"<{DSML}parameter"
PARAM_END = f"</{DSML}parameter>"
_NAME = re.compile(r'\bname="([^"]*)"')
_STRING = re.compile(r'\bstring="(true|false)"')
_JSON_TYPES: dict[str, Any] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def _find_first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = len(text), None
    for m in markers:
        i = text.find(m, 0, best + len(m))
        if i != -1 and i < best:
            best, found = i, m
    return best, found


def _partial_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a marker (held back)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ReasoningParser:
    """Splits model output into (reasoning, content) at `</think>`; drops EOS and what follows."""

    def __init__(self, thinking: bool) -> None:
        # A thinking-mode prompt ends with `<think>`, so the output starts inside the reasoning.
        self._in_reasoning = thinking
        self._at_start = thinking
        self._buf = ""
        self._done = False

    def feed(self, delta: str) -> tuple[str, str]:
        if self._done:
            return "", ""
        self._buf += delta
        reasoning, content = [], []
        if self._at_start:  # tolerate a repeated `<think>` at the very start
            if len(self._buf) < len(THINK_START) and THINK_START.startswith(self._buf):
                return "", ""
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START) :]
            self._at_start = False
        while True:
            # Tool calls end a reasoning block that never closed; the markup goes on as content.
            markers = (THINK_END, CALLS_START, EOS) if self._in_reasoning else (EOS,)
            out = reasoning if self._in_reasoning else content
            i, marker = _find_first(self._buf, markers)
            if marker is None:
                cut = len(self._buf) - _partial_len(self._buf, markers)
                if self._in_reasoning:  # whitespace before a tool block is not reasoning
                    cut = len(self._buf[:cut].rstrip())
                out.append(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            out.append(self._buf[:i].rstrip() if marker == CALLS_START else self._buf[:i])
            if marker == EOS:
                self._done, self._buf = True, ""
                break
            self._in_reasoning = False
            self._buf = self._buf[i + len(THINK_END) :] if marker == THINK_END else self._buf[i:]
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        # Held-back text never became a marker: it is ordinary text.
        rest, self._buf = self._buf, ""
        if self._done:
            return "", ""
        return (rest, "") if self._in_reasoning else ("", rest)


class ToolCallParser:
    """Turns DSML `tool_calls` blocks in content into OpenAI tool calls.

    feed/finish return OpenAI-style deltas: {"content": str} or {"tool_calls": [call]}. A call
    streams as vLLM's and SGLang's do: its first delta {"index", "id", "type": "function",
    "function": {"name", "arguments": ""}} once its invoke tag is read, then {"index",
    "function": {"arguments": piece}} as each parameter closes, the pieces adding up to the
    arguments' JSON (`json.dumps` of them) at `</invoke>`. A call still open at finish() (the
    output hit max_tokens) is closed there, its unfinished parameter taken as text so far.
    Markup that becomes a call is not content; markup that never does (an invoke with no name,
    a block still open at finish() with no call in it) comes back as content, as written, so no
    output is lost. `tool_calls` holds the calls made, whole.
    """

    def __init__(self, tools: list[dict] | None = None) -> None:
        self._params: dict[str, dict] = {}  # tool name -> JSON-schema properties
        for tool in tools or []:
            fn = tool.get("function") or {}
            props = (fn.get("parameters") or {}).get("properties")
            if isinstance(fn.get("name"), str) and isinstance(props, dict):
                self._params[fn["name"]] = props
        self.tool_calls: list[dict] = []
        self._buf = ""
        self._in_block = False
        self._lstrip = False  # drop whitespace that follows a block
        self._call: dict | None = None  # the open invoke: name, args, loose text
        self._raw: list[str] = []  # the block's text read since it opened or since the last call

    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        events: list[dict] = []
        while self._step_block(events) if self._in_block else self._step_content(events):
            pass
        return events

    def finish(self) -> list[dict]:
        events = []
        if self._call is not None and self._call["name"]:  # cut short: close it, keep its text
            buf = self._buf
            i = buf.find(PARAM_START)
            j = buf.find(">", i) if i != -1 else -1
            if j != -1:
                self._param(buf[i:j], buf[j + 1 :], events)
            self._buf = ""
            self._emit_call(events)
        if self._in_block:  # never closed: what did not become a call is text
            rest = "".join(self._raw) + self._buf
            if rest.strip():
                events.append({"content": rest})
        else:
            rest = self._buf.lstrip() if self._lstrip else self._buf
            if rest:
                events.append({"content": rest})
        self._buf, self._call, self._raw = "", None, []
        return events

    def _consume(self, n: int) -> None:
        # n characters of the block read: kept until they become a call (`_emit_call`), or
        # given back as content if they never do; a named call's own text is not kept (it is a
        # call from its invoke tag on: memory does not grow with its arguments)
        if self._call is None or not self._call["name"]:
            self._raw.append(self._buf[:n])
        self._buf = self._buf[n:]

    def _step_content(self, events: list[dict]) -> bool:
        if self._lstrip:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._lstrip = False
        i = self._buf.find(CALLS_START)
        if i == -1:
            # Hold back a partial opening tag and the whitespace before it: the blank line
            # that separates content from a block belongs to neither.
            cut = len(self._buf) - _partial_len(self._buf, (CALLS_START,))
            cut = len(self._buf[:cut].rstrip())
            if cut:
                events.append({"content": self._buf[:cut]})
            self._buf = self._buf[cut:]
            return False
        text = self._buf[:i].rstrip()
        if text:
            events.append({"content": text})
        self._raw = [self._buf[len(text) : i]]  # (the blank line before the block)
        self._buf = self._buf[i:]
        self._consume(len(CALLS_START))
        self._in_block = True
        return True

    def _step_block(self, events: list[dict]) -> bool:
        buf = self._buf
        if self._call is None:
            i, marker = _find_first(buf, (INVOKE_START, CALLS_END))
            if marker is None:
                # Text between invokes is no call; keep only what may begin a tag.
                self._consume(len(buf) - _partial_len(buf, (INVOKE_START, CALLS_END)))
                return False
            if marker == CALLS_END:
                self._close_block(i + len(CALLS_END))
                return True
            j = buf.find(">", i)
            if j == -1:
                self._consume(i)
                return False
            name = _NAME.search(buf, i, j)
            self._call = {"name": name.group(1) if name else "", "args": {}, "loose": []}
            self._consume(j + 1)
            if self._call["name"]:  # the call starts: its id and name
                self._call["index"] = len(self.tool_calls)
                self._call["id"] = f"call_{secrets.token_hex(12)}"
                fn = {"name": self._call["name"], "arguments": ""}
                start = {"index": self._call["index"], "id": self._call["id"], "type": "function"}
                events.append({"tool_calls": [start | {"function": fn}]})
                self._raw = []  # (the block's text before it: no content)
            return True
        i, marker = _find_first(buf, (PARAM_START, INVOKE_END, CALLS_END))
        if marker is None:
            return False
        self._call["loose"].append(buf[:i])
        if marker == PARAM_START:
            j = buf.find(">", i)
            k = buf.find(PARAM_END, j) if j != -1 else -1
            if k == -1:
                self._call["loose"].pop()
                return False
            self._param(buf[i:j], buf[j + 1 : k], events)
            self._consume(k + len(PARAM_END))
            return True
        if marker == INVOKE_END:
            self._consume(i + len(INVOKE_END))
            self._emit_call(events)
        else:  # block closed without closing the invoke
            self._consume(i)
            self._emit_call(events)
            self._close_block(len(CALLS_END))
        return True

    def _close_block(self, end: int) -> None:
        self._buf = self._buf[end:]
        self._in_block, self._lstrip, self._raw = False, True, []

    def _param(self, tag: str, raw: str, events: list[dict]) -> None:
        # a parameter of the open call (`tag`: its opening tag up to `>`): typed, and its piece
        # of the arguments' JSON streamed (the first opens the object; a repeated name is ignored)
        call = self._call
        name, string = _NAME.search(tag), _STRING.search(tag)
        if not name or name.group(1) in call["args"] or not call["name"]:
            return
        given = self._typed(name.group(1), raw, string is None or string.group(1) == "true")
        for key, value in self._unwrapped(name.group(1), given):
            piece = ("{" if not call["args"] else ", ") + json.dumps(key, ensure_ascii=False)
            call["args"][key] = value
            self._piece(piece + ": " + json.dumps(value, ensure_ascii=False), events)

    def _unwrapped(self, key: str, value: Any) -> list[tuple[str, Any]]:
        # A call's arguments wrapped in one "arguments" or "input" parameter that its schema does
        # not have (an object, or its JSON text): its own parameters, when the schema has them
        # all, as vLLM's DeepSeek-V4 parser repairs them; otherwise the parameter as given.
        props = self._params.get(self._call["name"])
        if self._call["args"] or key not in ("arguments", "input") or not props or key in props:
            return [(key, value)]
        inner = value
        if isinstance(inner, str):
            try:
                inner = json.loads(inner)
            except json.JSONDecodeError:
                return [(key, value)]
        if isinstance(inner, dict) and inner and set(inner) <= set(props):
            return list(inner.items())
        return [(key, value)]

    def _piece(self, text: str, events: list[dict]) -> None:
        events.append(
            {"tool_calls": [{"index": self._call["index"], "function": {"arguments": text}}]}
        )

    def _emit_call(self, events: list[dict]) -> None:
        call = self._call
        raw, self._raw = "".join(self._raw), []
        if not call["name"]:  # no call to make of it: its text, as written
            self._call = None
            if raw.strip():
                events.append({"content": raw})
            return
        args = call["args"]
        if not args:
            loose = "".join(call["loose"]).strip()
            if loose.startswith("{"):
                # Some outputs put a JSON object directly inside the invoke.
                try:
                    direct = json.loads(loose)
                    args = direct if isinstance(direct, dict) else args
                except json.JSONDecodeError:
                    pass
        text = json.dumps(args, ensure_ascii=False)  # (what the pieces add up to)
        self._piece("}" if call["args"] else text, events)
        self._call = None
        fn = {"name": call["name"], "arguments": text}
        self.tool_calls.append({"id": call["id"], "type": "function", "function": fn})

    def _typed(self, param: str, raw: str, is_string: bool) -> Any:
        """DSML rule: string="true" is raw text, "false" is JSON (kept as text if it isn't)."""
        schema = self._params.get(self._call["name"], {}).get(param)
        types = schema.get("type") if isinstance(schema, dict) else None
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
        if is_string and (not types or "string" in types):
            return raw
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        if not is_string:
            return value
        # Flagged as a string but the schema wants e.g. an integer: take the JSON if it fits.
        return value if any(t in _JSON_TYPES and _JSON_TYPES[t](value) for t in types) else raw


class StreamParser:
    """Reasoning split plus tool-call parsing; feed/finish return OpenAI chat deltas.
    parallel=False (OpenAI's parallel_tool_calls=false): the first call only, as vLLM keeps it."""

    def __init__(
        self, thinking: bool, tools: list[dict] | None = None, parallel: bool = True
    ) -> None:
        self.reasoning = ReasoningParser(thinking)
        self.tools = ToolCallParser(tools)
        self.parallel = parallel

    def feed(self, delta: str) -> list[dict]:
        return self._route(*self.reasoning.feed(delta), final=False)

    def finish(self) -> list[dict]:
        return self._route(*self.reasoning.finish(), final=True)

    def _route(self, reasoning: str, content: str, *, final: bool) -> list[dict]:
        deltas = [{"reasoning_content": reasoning}] if reasoning else []
        deltas += self.tools.feed(content) if content else []
        deltas += self.tools.finish() if final else []
        return deltas if self.parallel else _first_call_only(deltas)


def _first_call_only(deltas: list[dict]) -> list[dict]:
    # the deltas without tool calls past the first (index > 0)
    out = []
    for d in deltas:
        calls = [c for c in d.get("tool_calls", []) if c["index"] == 0]
        d = {k: v for k, v in d.items() if k != "tool_calls"} | (
            {"tool_calls": calls} if calls else {}
        )
        if d:
            out.append(d)
    return out


def merge_calls(pieces: list[dict]) -> list[dict]:
    """Streamed tool-call deltas (`ToolCallParser`) folded by index as a client folds them: the
    first gives id, type and name, the arguments add up. Keeps "index"."""
    calls: dict[int, dict] = {}
    for c in pieces:
        if c["index"] not in calls:
            calls[c["index"]] = {**c, "function": {"arguments": "", **c["function"]}}
            continue
        fn = calls[c["index"]]["function"]
        fn["arguments"] += c["function"].get("arguments", "")
    return list(calls.values())


def merge_deltas(deltas: list[dict]) -> dict:
    """Fold chat deltas into a message: reasoning_content, content, tool_calls, finish_reason."""
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [
        {k: v for k, v in c.items() if k != "index"}
        for c in merge_calls([c for d in deltas for c in d.get("tool_calls", [])])
    ]
    return {
        "reasoning_content": reasoning or None,
        "content": content or None,
        "tool_calls": calls,
        "finish_reason": "tool_calls" if calls else "stop",
    }


def parse_completion(
    text: str, thinking: bool = False, tools: list[dict] | None = None, parallel: bool = True
) -> dict:
    """Parse a whole completion; finish_reason is "tool_calls" or "stop" (the caller knows
    about "length")."""
    parser = StreamParser(thinking, tools, parallel)
    return merge_deltas(parser.feed(text) + parser.finish())
