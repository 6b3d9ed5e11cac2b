from __future__ import annotations

import pytest

from dsv4.chat import encode_messages, tool_call_prefix

# Spelled out here rather than imported, so the goldens do not share the encoder's constants.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

TOOLS_SECTION = (
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools "
    'by writing a "<｜DSML｜tool_calls>" block like the following:\n'
    "\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    "</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    '{"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}}}\n'
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n"
)

EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)


def user(text):
    return {"role": "user", "content": text}


def test_plain_chat():
    assert encode_messages([user("Hello")]) == f"{BOS}{U}Hello{A}</think>"


def test_no_generation_prompt():
    assert encode_messages([user("Hello")], add_generation_prompt=False) == f"{BOS}{U}Hello"


def test_system_multi_turn():
    msgs = [
        {"role": "system", "content": "You are helpful."},
        user("Hi"),
        {"role": "assistant", "content": "Hello!"},
        user("How are you?"),
    ]
    expected = f"{BOS}You are helpful.{U}Hi{A}</think>Hello!{EOS}{U}How are you?{A}</think>"
    assert encode_messages(msgs) == expected


def test_content_parts_and_consecutive_users_merge():
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": t} for t in ("S1", "S2")]},
        user("a"),
        user([{"type": "text", "text": "b"}]),
    ]
    assert encode_messages(msgs) == f"{BOS}S1\n\nS2{U}a\n\nb{A}</think>"


def test_thinking_mode():
    assert encode_messages([user("2+2?")], thinking=True) == f"{BOS}{U}2+2?{A}<think>"


HISTORY = [
    user("Q1"),
    {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
    user("Q2"),
]


def test_drop_thinking_across_turns():
    # Earlier turns become chat turns: no reasoning and a closed `</think>` prefix.
    expected = f"{BOS}{U}Q1{A}</think>A1{EOS}{U}Q2{A}<think>"
    assert encode_messages(HISTORY, thinking=True) == expected


def test_keep_thinking_when_not_dropped():
    expected = f"{BOS}{U}Q1{A}<think>R1</think>A1{EOS}{U}Q2{A}<think>"
    assert encode_messages(HISTORY, thinking=True, drop_thinking=False) == expected


def test_chat_mode_never_renders_reasoning():
    expected = f"{BOS}{U}Q1{A}</think>A1{EOS}{U}Q2{A}</think>"
    assert encode_messages(HISTORY, drop_thinking=False) == expected


def test_last_assistant_keeps_reasoning():
    msgs = HISTORY + [{"role": "assistant", "reasoning_content": "R2", "content": "A2"}]
    expected = f"{BOS}{U}Q1{A}</think>A1{EOS}{U}Q2{A}<think>R2</think>A2{EOS}"
    assert encode_messages(msgs, thinking=True) == expected


R = "<｜latest_reminder｜>"


def dev(text):
    return {"role": "developer", "content": text}


def test_developer_turns():
    # encoding_dsv4's developer role: a user-token turn; no answer opens before the user turn
    # that follows it; as the last asking turn it opens the answer like a user turn
    assert encode_messages([dev("Be brief"), user("Q")]) == f"{BOS}{U}Be brief{U}Q{A}</think>"
    msgs = [user("Q"), {"role": "assistant", "content": "A"}, dev("D")]
    assert encode_messages(msgs) == f"{BOS}{U}Q{A}</think>A{EOS}{U}D{A}</think>"
    assert encode_messages(msgs, thinking=True) == f"{BOS}{U}Q{A}</think>A{EOS}{U}D{A}<think>"
    # thinking mode drops developer turns before the last user turn with the old reasoning
    history = [dev("D1"), *HISTORY]
    assert encode_messages(history, thinking=True) == f"{BOS}{U}Q1{A}</think>A1{EOS}{U}Q2{A}<think>"
    kept = f"{BOS}{U}D1{U}Q1{A}<think>R1</think>A1{EOS}{U}Q2{A}<think>"
    assert encode_messages(history, thinking=True, drop_thinking=False) == kept
    assert encode_messages(history) == f"{BOS}{U}D1{U}Q1{A}</think>A1{EOS}{U}Q2{A}</think>"
    # request-level tools join a leading developer turn (as vLLM's deepseek_v4 tokenizer mode)
    with_tools = encode_messages([dev("D"), user("Q")], tools=[WEATHER])
    assert with_tools == f"{BOS}{U}D\n\n{TOOLS_SECTION}{U}Q{A}</think>"


def test_latest_reminder():
    # DeepSeek's reminder turn: its token and text; the answer opens before it, as the reference
    msgs = [user("Q"), {"role": "latest_reminder", "content": "Rm"}]
    assert encode_messages(msgs) == f"{BOS}{U}Q{A}</think>{R}Rm"
    assert encode_messages(msgs, thinking=True) == f"{BOS}{U}Q{A}<think>{R}Rm"
    with pytest.raises(ValueError, match="must not be empty for role 'latest_reminder'"):
        encode_messages([user("Q"), {"role": "latest_reminder", "content": ""}])
    with pytest.raises(ValueError, match="must not be empty for role 'developer'"):
        encode_messages([dev(""), user("Q")])


def test_tasks():
    # SGLang's request `task` (encoding_dsv4's quick-instruction tasks): the last user turn ends
    # with the task's token instead of the answer's prefix; "action" comes after the prefix; an
    # answer to a task has no reasoning part
    assert encode_messages([user("classify me")], task="query") == f"{BOS}{U}classify me<｜query｜>"
    assert encode_messages([user("Q")], task="action") == f"{BOS}{U}Q{A}</think><｜action｜>"
    assert encode_messages([user("Q")], task="action", thinking=True) == (
        f"{BOS}{U}Q{A}<think><｜action｜>"
    )
    assert encode_messages(HISTORY, task="domain", thinking=True) == (
        f"{BOS}{U}Q1{A}</think>A1{EOS}{U}Q2<｜domain｜>"
    )
    answered = [user("Q"), {"role": "assistant", "reasoning_content": "R", "content": "T"}]
    assert encode_messages(answered, task="title", thinking=True) == f"{BOS}{U}Q<｜title｜>T{EOS}"
    with pytest.raises(ValueError, match="task 'summary' is not one of action, query"):
        encode_messages([user("Q")], task="summary")
    with pytest.raises(ValueError, match="task needs a user or developer message"):
        encode_messages([{"role": "system", "content": "S"}], task="query")


def test_continue_final_message():
    # vLLM's continue_final_message: the last assistant message stays open (no EOS) for the model
    # to go on with; in thinking mode its reasoning is closed before the content, or left open
    # when there is no content yet (continues_reasoning tells the response which one)
    from dsv4.chat import continues_reasoning

    def cont(msgs, **kw):
        return encode_messages(msgs, add_generation_prompt=False, continue_final_message=True, **kw)

    chat = [user("Q"), {"role": "assistant", "content": "The answer is"}]
    assert cont(chat) == f"{BOS}{U}Q{A}</think>The answer is"
    assert cont(chat, thinking=True) == f"{BOS}{U}Q{A}<think></think>The answer is"
    both = [user("Q"), {"role": "assistant", "reasoning_content": "R", "content": "A"}]
    assert cont(both, thinking=True) == f"{BOS}{U}Q{A}<think>R</think>A"
    reasoning = [user("Q"), {"role": "assistant", "reasoning_content": "Let me see", "content": ""}]
    assert cont(reasoning, thinking=True) == f"{BOS}{U}Q{A}<think>Let me see"
    assert cont(reasoning) == f"{BOS}{U}Q{A}</think>"  # chat mode: no reasoning is rendered
    assert continues_reasoning(reasoning, True) and not continues_reasoning(reasoning, False)
    assert not continues_reasoning(both, True) and not continues_reasoning(chat, True)
    # earlier turns render as before; only the last one stays open
    assert cont(HISTORY + chat[1:]).startswith(
        encode_messages(HISTORY, add_generation_prompt=False)
    )
    with pytest.raises(ValueError, match="add_generation_prompt"):
        encode_messages(chat, continue_final_message=True)
    with pytest.raises(ValueError, match="assistant message last"):
        cont([user("Q")])
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]  # fmt: skip
    with pytest.raises(ValueError, match="tool_calls"):
        cont([user("Q"), {"role": "assistant", "content": "", "tool_calls": calls}])


def test_tool_call_prefix():
    # the forced start of a reply for tool_choice: a named invoke, or up to the name's quote
    named = tool_call_prefix("get_weather")
    assert named == '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    assert tool_call_prefix(None) == '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="'
    # it is how a rendered call begins, so the model continues a call in its own format
    from dsv4.chat import render_tool_calls

    assert render_tool_calls([("get_weather", {"city": "Paris"})]).startswith(named)


def test_tools_section_without_system():
    expected = f"{BOS}\n\n{TOOLS_SECTION}{U}Weather in Paris?{A}</think>"
    assert encode_messages([user("Weather in Paris?")], tools=[WEATHER]) == expected


def test_tools_section_joins_system():
    msgs = [{"role": "system", "content": "Be brief."}, user("Hi")]
    expected = f"{BOS}Be brief.\n\n{TOOLS_SECTION}{U}Hi{A}<think>"
    assert encode_messages(msgs, tools=[WEATHER], thinking=True) == expected


RESPONSE_FORMAT = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def test_system_message_tools_and_response_format():
    # encoding_dsv4's message keys: content, then the tools section, then the response format
    msgs = [
        {"role": "system", "content": "Be brief.", "tools": [WEATHER], "response_format": SCHEMA},
        user("Hi"),
    ]
    schema = (
        '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}'
    )
    expected = f"{BOS}Be brief.\n\n{TOOLS_SECTION}\n\n{RESPONSE_FORMAT}{schema}{U}Hi{A}</think>"
    assert encode_messages(msgs) == expected


def test_developer_message_response_format():
    msgs = [{"role": "developer", "content": "Reply in JSON.", "response_format": {"type": "ä"}}]
    expected = f'{BOS}{U}Reply in JSON.\n\n{RESPONSE_FORMAT}{{"type": "ä"}}{A}</think>'
    assert encode_messages(msgs) == expected


def test_message_tools_keep_reasoning():
    # a message's own tools switch drop_thinking off, as request tools do
    history = [
        user("a"),
        {"role": "assistant", "content": "b", "reasoning_content": "r"},
        user("c"),
    ]
    plain = encode_messages(history, thinking=True)
    assert "r</think>" not in plain
    with_tools = encode_messages([{"role": "system", "tools": [WEATHER]}, *history], thinking=True)
    assert f"{A}<think>r</think>b{EOS}" in with_tools


def test_assistant_reasoning_alias():
    # vLLM's newer `reasoning` field renders as reasoning_content does
    history = [user("a"), {"role": "assistant", "content": "b"}]
    a = encode_messages(
        [*history[:1], {**history[1], "reasoning": "r"}], thinking=True, add_generation_prompt=False
    )
    b = encode_messages(
        [*history[:1], {**history[1], "reasoning_content": "r"}],
        thinking=True,
        add_generation_prompt=False,
    )
    assert a == b and "<think>r</think>b" in a


def test_message_tools_listed():
    from dsv4.chat import message_tools

    msgs = [
        {"role": "system", "tools": [WEATHER]},
        {"role": "developer", "content": "x"},
        user("y"),
    ]
    assert message_tools(msgs) == [WEATHER]
    assert message_tools([user("y")]) == []


TOOL_TURN = [
    user("Weather in Paris and Rome?"),
    {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Need two calls.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {
                "id": "call_b",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Rome", "opts": {"u": "C"}}',
                },
            },
        ],
    },
    # Results arrive out of order; the encoder puts them back in call order.
    {"role": "tool", "tool_call_id": "call_b", "content": "Rome: 25C"},
    {"role": "tool", "tool_call_id": "call_a", "content": [{"type": "text", "text": "Paris: 18C"}]},
]

CALLS_DSML = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="opts" string="false">{"u": "C"}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
RESULTS = "<tool_result>Paris: 18C</tool_result>\n\n<tool_result>Rome: 25C</tool_result>"


def test_tool_calls_and_results_chat():
    expected = (
        f"{BOS}{U}Weather in Paris and Rome?{A}</think>Checking.{CALLS_DSML}{EOS}"
        f"{U}{RESULTS}{A}</think>"
    )
    assert encode_messages(TOOL_TURN) == expected


def test_tool_calls_and_results_thinking_with_tools_keeps_reasoning():
    # Tools switch drop_thinking off, so the earlier turn keeps its reasoning.
    expected = (
        f"{BOS}\n\n{TOOLS_SECTION}{U}Weather in Paris and Rome?{A}<think>Need two calls.</think>"
        f"Checking.{CALLS_DSML}{EOS}{U}{RESULTS}{A}<think>"
    )
    assert encode_messages(TOOL_TURN, tools=[WEATHER], thinking=True) == expected


def test_tool_results_then_user_text_share_a_turn():
    msgs = TOOL_TURN + [user("Thanks")]
    expected = (
        f"{BOS}{U}Weather in Paris and Rome?{A}</think>Checking.{CALLS_DSML}{EOS}"
        f"{U}{RESULTS}\n\nThanks{A}</think>"
    )
    assert encode_messages(msgs) == expected


def test_reasoning_effort_max():
    assert encode_messages([user("Prove it.")], thinking=True, reasoning_effort="max") == (
        f"{BOS}{EFFORT_MAX}{U}Prove it.{A}<think>"
    )
    # Only thinking mode gets the preamble; "high" renders like None.
    assert encode_messages([user("x")], reasoning_effort="max") == f"{BOS}{U}x{A}</think>"
    assert encode_messages([user("x")], thinking=True, reasoning_effort="high") == (
        f"{BOS}{U}x{A}<think>"
    )


def test_reasoning_effort_max_before_system_and_tools():
    msgs = [{"role": "system", "content": "S"}, user("x")]
    expected = f"{BOS}{EFFORT_MAX}S\n\n{TOOLS_SECTION}{U}x{A}<think>"
    assert encode_messages(msgs, tools=[WEATHER], thinking=True, reasoning_effort="max") == expected


def test_input_not_mutated():
    msgs = [{"role": "system", "content": "S"}, user("x")]
    snapshot = [dict(m) for m in msgs]
    encode_messages(msgs, tools=[WEATHER])
    assert msgs == snapshot


@pytest.mark.parametrize(
    ("messages", "kwargs", "error"),
    [
        ([], {}, "messages must be a non-empty list"),
        ("hi", {}, "messages must be a non-empty list"),
        ([user("a"), "b"], {}, "messages[1] must be an object"),
        (
            [user("a"), {"role": "foo", "content": "x"}],
            {},
            "messages[1].role 'foo' is not one of 'system', 'developer', 'user', 'assistant', 'tool', 'latest_reminder'",
        ),
        ([{"content": "x"}], {}, "messages[0].role None is not one of"),
        ([{"role": "user"}], {}, "messages[0].content is required"),
        ([{"role": "user", "content": 5}], {}, "messages[0].content must be a string or a list"),
        (
            [user([{"type": "image_url", "image_url": {"url": "u"}}])],
            {},
            "messages[0].content[0] has type 'image_url'",
        ),
        (
            [user("a"), {"role": "assistant", "reasoning_content": 1}],
            {},
            "messages[1].reasoning_content must be a string",
        ),
        (
            [user("a"), {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            {},
            "messages[1].tool_calls[0].function must be an object with a non-empty 'name'",
        ),
        (
            [
                user("a"),
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}],
                },
            ],
            {},
            "messages[1].tool_calls[0].function.arguments is not valid JSON",
        ),
        (
            [
                user("a"),
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                },
            ],
            {},
            "messages[1].tool_calls[0].function.arguments must encode a JSON object",
        ),
        (
            [{"role": "tool", "tool_call_id": 3, "content": "r"}],
            {},
            "messages[0].tool_call_id must be a string",
        ),
        ([user("a")], {"reasoning_effort": "extreme"}, "reasoning_effort 'extreme' is not one of"),
        ([user("a")], {"tools": [{"type": "function"}]}, "tools[0].function must be an object"),
        ([user("a")], {"tools": {"name": "f"}}, "tools must be a list"),
        (
            [{"role": "system", "tools": [WEATHER]}, user("a")],
            {"tools": [WEATHER]},
            "tools are given both in the request and in messages[0].tools",
        ),
        (
            [{"role": "system", "tools": [{"type": "function"}]}, user("a")],
            {},
            "messages[0].tools[0].function must be an object",
        ),
        (
            [{"role": "developer", "content": "d", "response_format": "json"}],
            {},
            "messages[0].response_format must be an object",
        ),
        (
            [user("a"), {"role": "assistant", "reasoning": 2}],
            {},
            "messages[1].reasoning must be a string",
        ),
    ],
)
def test_invalid_messages(messages, kwargs, error):
    with pytest.raises(ValueError) as info:
        encode_messages(messages, **kwargs)
    assert error in str(info.value)
