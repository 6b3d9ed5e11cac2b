"""DeepSeek-V4 chat encoding: OpenAI-style messages -> prompt string (encoding_dsv4 format)."""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
# DeepSeek-V4's quick-instruction tasks (SGLang's request `task`): a token after the last user
# turn asks for that classification instead of an answer ("action": after the answer's prefix)
TASKS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}
CALLS_START = f"<{DSML}tool_calls>"
CALLS_END = f"</{DSML}tool_calls>"

# (developer: a user turn that carries instructions, dropped from history before the last user
# turn in thinking mode; latest_reminder: DeepSeek's reminder token and its text)
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
ASKING = ("user", "developer")  # the turns a generation prompt follows
REASONING_EFFORTS = (None, "high", "max")

# Fixed prompt text: must match the reference byte for byte, the model was trained on it.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

TOOLS_HEADER = f"""## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "{CALLS_START}" block like the following:

{CALLS_START}
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
{CALLS_END}

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), pass the value in JSON format \
and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning \
inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_FOOTER = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)
# a system or developer message's own `response_format` (encoding_dsv4's message key)
RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)


def encode_messages(
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    task: str | None = None,
) -> str:
    """Render OpenAI chat messages as a DeepSeek-V4 prompt; raises ValueError on bad input.

    thinking=False is the "chat" (non-think) mode. reasoning_effort is None, "high" or "max";
    only "max" (in thinking mode) changes the prompt. drop_thinking removes the reasoning of
    assistant turns before the last user turn; it is off whenever tools are given.
    continue_final_message (vLLM's): the last message is an assistant's, left open for the model
    to continue: its content without the end-of-sentence token, or, in thinking mode with
    reasoning and no content yet, its reasoning without `</think>` (`continues_reasoning`).
    task (SGLang's, one of TASKS): the last user (or developer) turn ends with the task's token
    instead of the answer's prefix ("action": after it), and an assistant turn after it has
    no reasoning part, as encoding_dsv4 renders a message's task.
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort {reasoning_effort!r} is not one of {REASONING_EFFORTS}")
    functions = _check_tools(tools)
    turns = _to_turns(messages)
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError(
                "continue_final_message cannot be combined with add_generation_prompt=true"
            )
        if turns[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs an assistant message last in messages")
        if turns[-1]["calls"]:
            raise ValueError("continue_final_message cannot continue a message with tool_calls")
    if functions:
        # Request-level tools join the leading system (or developer) prompt, or get an empty
        # system prompt of their own.
        if turns[0]["role"] not in ("system", "developer"):
            turns.insert(0, {"role": "system", "text": ""})
        if turns[0].get("tools"):
            raise ValueError(
                "tools are given both in the request and in messages[0].tools: give them once"
            )
        turns[0]["tools"] = functions
    # (encoding_dsv4 keeps the reasoning whenever any message carries tools)
    drop = drop_thinking and not any(t.get("tools") for t in turns)
    last_user = _last_asking(turns)
    if task is not None:
        if task not in TASKS:
            raise ValueError(f"task {task!r} is not one of {', '.join(TASKS)}")
        if last_user < 0:
            raise ValueError("task needs a user or developer message")
        if continue_final_message:
            raise ValueError("task cannot be combined with continue_final_message")
        turns[last_user]["task"] = task
    if thinking and drop:  # developer turns before the last user turn leave the history
        turns = [t for i, t in enumerate(turns) if t["role"] != "developer" or i >= last_user]
        last_user = _last_asking(turns)

    out = [BOS]
    if thinking and reasoning_effort == "max":
        out.append(REASONING_EFFORT_MAX)
    for i, turn in enumerate(turns):
        role = turn["role"]
        if role == "system" or role in ASKING:
            out.append(turn["text"] if role == "system" else USER + turn["text"])
            if turn.get("tools"):
                out.append("\n\n" + render_tools(turn["tools"]))
            if turn.get("response_format") is not None:
                out.append(
                    "\n\n"
                    + RESPONSE_FORMAT
                    + json.dumps(turn["response_format"], ensure_ascii=False)
                )
            nxt = turns[i + 1]["role"] if i + 1 < len(turns) else None
            # (the reference opens the answer before a reminder that follows, too)
            opens = nxt in ("assistant", "latest_reminder") or (
                nxt is None and add_generation_prompt
            )
            if role in ASKING and opens:
                # Earlier turns with dropped reasoning were answered in chat form.
                open_think = thinking and (not drop or i >= last_user)
                if turn.get("task") in (None, "action"):
                    out.append(ASSISTANT + (THINK_START if open_think else THINK_END))
                if turn.get("task") is not None:
                    out.append(TASKS[turn["task"]])
        elif role == "latest_reminder":
            out.append(LATEST_REMINDER + turn["text"])
        else:
            # (an answer to a task has no reasoning part)
            after_task = i > 0 and turns[i - 1].get("task") is not None
            keep_reasoning = thinking and (not drop or i > last_user) and not after_task
            if continue_final_message and i == len(turns) - 1:
                if keep_reasoning and turn["reasoning"] and not turn["text"]:
                    out.append(turn["reasoning"])  # the reasoning goes on
                else:
                    out.append(
                        (turn["reasoning"] + THINK_END if keep_reasoning else "") + turn["text"]
                    )
                break
            reasoning = turn["reasoning"] + THINK_END if keep_reasoning else ""
            out.append(reasoning + turn["text"] + render_tool_calls(turn["calls"]) + EOS)
    return "".join(out)


def _last_asking(turns: list[dict]) -> int:
    # the index of the last user / developer turn (-1: none)
    return max((i for i, t in enumerate(turns) if t["role"] in ASKING), default=-1)


def continues_reasoning(messages: list[dict], thinking: bool) -> bool:
    """With continue_final_message: whether the model's output continues the final assistant
    message's reasoning (thinking mode, reasoning given, no content yet) rather than its content."""
    last = _to_turns(messages)[-1]
    return bool(thinking and last["role"] == "assistant" and last["reasoning"] and not last["text"])


def tool_call_prefix(name: str | None) -> str:
    """The start of a DSML tool-call block, up to a named function's invoke tag (name None: up to
    the name's opening quote, for the model to pick one). A reply made to begin with it calls a
    tool: tool_choice "required" / a named function (its arguments constrained by
    `dsv4.dsml_grammar`)."""
    invoke = f'<{DSML}invoke name="' + (f'{name}">\n' if name is not None else "")
    return "\n\n" + CALLS_START + "\n" + invoke


def render_tools(functions: list[dict]) -> str:
    """The `## Tools` system-prompt section for OpenAI `function` objects (key order kept)."""
    schemas = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return TOOLS_HEADER + schemas + TOOLS_FOOTER


def render_tool_calls(calls: list[tuple[str, dict]]) -> str:
    """DSML block for (name, arguments) pairs, preceded by the blank line the model emits."""
    if not calls:
        return ""
    invokes = []
    for name, args in calls:
        params = []
        for key, value in args.items():
            is_str = isinstance(value, str)
            text = value if is_str else json.dumps(value, ensure_ascii=False)
            params.append(
                f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                f"{text}</{DSML}parameter>"
            )
        invokes.append(f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>")
    return "\n\n" + CALLS_START + "\n" + "\n".join(invokes) + "\n" + CALLS_END


# ---- validation and normalisation -------------------------------------------------------------


def _check_tools(tools: list[dict] | None) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be an object with type 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function must be an object with a non-empty 'name'")
        functions.append(fn)
    return functions


def _instructions(msg: dict, where: str) -> dict:
    # a system or developer message's own `tools` (OpenAI tool objects) and `response_format`
    # (a JSON object rendered as its schema), encoding_dsv4's message keys
    out: dict = {}
    if msg.get("tools") is not None:
        try:
            out["tools"] = _check_tools(msg["tools"])
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None
    fmt = msg.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise ValueError(f"{where}.response_format must be an object")
        out["response_format"] = fmt
    return out


def message_tools(messages: list[dict]) -> list[dict]:
    """The OpenAI tool objects that system and developer messages carry themselves (their
    `tools` key): the model may call them as it may call a request's tools."""
    return [
        tool
        for m in messages if isinstance(m, dict) and m.get("role") in ("system", "developer")
        for tool in (m.get("tools") or [])
    ]  # fmt: skip


def _text(content: Any, where: str, *, optional: bool) -> str:
    if content is None:
        if optional:
            return ""
        raise ValueError(f"{where} is required")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}] has type {kind!r}; only 'text' parts are supported")
        texts.append(part["text"])
    # Same joiner the reference uses for multi-part tool results.
    return "\n\n".join(texts)


def _check_calls(calls: Any, where: str) -> list[tuple[str, dict, str]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ValueError(f"{at} must be an object with type 'function'")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{at}.function must be an object with a non-empty 'name'")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"{at}.function.arguments is not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise ValueError(f"{at}.function.arguments must encode a JSON object")
        out.append((fn["name"], args, call.get("id") or ""))
    return out


def _to_turns(messages: list[dict]) -> list[dict]:
    """Validate messages; merge each run of user/tool messages into one user turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    turns: list[dict] = []
    call_order: dict[str, int] = {}  # tool_call id -> position in the latest assistant's calls
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where} must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role {role!r} is not one of {', '.join(map(repr, ROLES))}")
        if role == "system":
            text = _text(msg.get("content"), f"{where}.content", optional=True)
            turns.append({"role": "system", "text": text, **_instructions(msg, where)})
        elif role in ("developer", "latest_reminder"):
            text = _text(msg.get("content"), f"{where}.content", optional=False)
            if not text:
                raise ValueError(f"{where}.content must not be empty for role {role!r}")
            extra = _instructions(msg, where) if role == "developer" else {}
            turns.append({"role": role, "text": text, **extra})
        elif role == "assistant":
            # (vLLM's newer `reasoning` field, or `reasoning_content`)
            key = "reasoning_content" if msg.get("reasoning_content") is not None else "reasoning"
            reasoning = msg.get(key)
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}.{key} must be a string")
            calls = _check_calls(msg.get("tool_calls"), f"{where}.tool_calls")
            if calls:
                call_order = {cid: k for k, (_, _, cid) in enumerate(calls) if cid}
            turns.append(
                {
                    "role": "assistant",
                    "text": _text(msg.get("content"), f"{where}.content", optional=True),
                    "reasoning": reasoning or "",
                    "calls": [(name, args) for name, args, _ in calls],
                }
            )
        else:
            if role == "user":
                block = ("text", _text(msg.get("content"), f"{where}.content", optional=False), 0)
            else:
                call_id = msg.get("tool_call_id")
                if call_id is not None and not isinstance(call_id, str):
                    raise ValueError(f"{where}.tool_call_id must be a string")
                text = _text(msg.get("content"), f"{where}.content", optional=False)
                block = ("tool", f"<tool_result>{text}</tool_result>", call_order.get(call_id, 0))
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block]})
    for turn in turns:
        if turn["role"] == "user":
            turn["text"] = "\n\n".join(b[1] for b in _sort_tool_results(turn.pop("blocks")))
    return turns


def _sort_tool_results(blocks: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    # Tool results go back in the order the assistant made the calls; text blocks keep their slots.
    results = iter(sorted((b for b in blocks if b[0] == "tool"), key=lambda b: b[2]))
    return [next(results) if b[0] == "tool" else b for b in blocks]
