"""OpenAI wire format: request models, their SamplingParams, and the error envelope."""

from __future__ import annotations

import functools
import json
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dsv4.chat import continues_reasoning, message_tools, tool_call_prefix
from dsv4.sampling import SamplingParams

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_CHOICES = 128  # choices a request may ask for: prompts x n
# SGLang /generate fields that would change or add to the answer (a 400 naming them)
REFUSED_NATIVE = (
    "token_ids_logprob",
    "return_hidden_states",
    "custom_logit_processor",
    "lora_path",
)
# vLLM's structured-output fields and structured_outputs keys -> SamplingParams fields
GUIDED = {"guided_json": "json_schema", "guided_choice": "guided_choice",
          "guided_regex": "guided_regex", "guided_grammar": "guided_grammar"}  # fmt: skip
STRUCTURED_OUTPUTS = {"json": "json_schema", "choice": "guided_choice", "regex": "guided_regex",
                      "grammar": "guided_grammar"}  # fmt: skip

# ---- errors -----------------------------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """A request the server refuses: becomes {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The OpenAI error envelope; `code` is the HTTP status (as vLLM and SGLang send it)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# ---- requests ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    """`stream_options`: usage in a final chunk (and optionally in every chunk)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatTemplateKwargs(BaseModel):
    """`chat_template_kwargs`: options of the DeepSeek-V4 prompt encoder."""

    model_config = ConfigDict(strict=True, extra="forbid")
    thinking: bool | None = None
    enable_thinking: bool | None = None  # alias of thinking
    reasoning_effort: Literal["high", "max"] | None = None
    drop_thinking: bool = True


# SGLang's `task` field for DeepSeek-V4 (`dsv4.chat.TASKS`)
TaskName = Literal["action", "query", "authority", "domain", "title", "read_url"]


class GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI plus vLLM extensions).

    Unknown fields are accepted and ignored, as OpenAI-compatible servers do; wrong types and
    out-of-range values are 400s naming the field.
    """

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)  # None -> 1.0; 0 = greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0 = off
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False  # vLLM extension
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM extension
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM's: keep the prompt's last k
    # the response's id (and the engine's: /abort_request takes it), vLLM's and SGLang's names
    request_id: str | None = Field(None, min_length=1)
    rid: str | None = Field(None, min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM extension: token ids on each choice / chunk
    user: str | None = None
    priority: int = 0  # vLLM extension: the place under a priority policy (`dsv4.scheduler`)
    # {"type": "text"}, {"type": "json_object"} (JSON mode: dsv4.grammar) or {"type":
    # "json_schema", "json_schema": {"name", "schema", "strict"}} (structured outputs:
    # dsv4.json_schema); vLLM takes it on completions too
    response_format: dict[str, Any] | None = None
    # vLLM's structured-output fields: guided_json (a schema), guided_choice (the output is one
    # of the strings), structured_outputs {"json" | "choice" | "json_object"}
    guided_json: dict[str, Any] | str | bool | None = None
    guided_choice: list[str] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @functools.cached_property
    def structured(self) -> tuple[str | None, dict]:
        """(the field that asks for structured output, its SamplingParams keywords), (None, {})
        when none does: JSON mode, a JSON schema, a regex, a grammar or a choice. A schema is
        compiled here, so one it cannot constrain to is a 400 naming the keyword (a constraint
        is never dropped)."""
        asked: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf not in (None, {"type": "text"}, {"type": "json_object"}):
            spec = rf.get("json_schema") if rf.get("type") == "json_schema" else None
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
                msg = ("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                       "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")  # fmt: skip
                raise ApiError(400, msg, "response_format")
            asked.append(("response_format", {"json_schema": spec["schema"]}))
        elif rf == {"type": "json_object"}:
            asked.append(("response_format", {"json_object": True}))
        asked += [(name, {key: getattr(self, name)}) for name, key in GUIDED.items()
                  if getattr(self, name) is not None]  # fmt: skip
        so = self.structured_outputs
        if so is not None:
            other = sorted(k for k, v in so.items()
                           if v is not None and k not in (*STRUCTURED_OUTPUTS, "json_object"))  # fmt: skip
            if other:
                msg = f"structured_outputs {other[0]} is not supported"
                raise ApiError(400, msg, "structured_outputs")
            asked += [("structured_outputs", {key: so[k]}) for k, key in STRUCTURED_OUTPUTS.items()
                      if so.get(k) is not None]  # fmt: skip
            if so.get("json_object") is True:
                asked.append(("structured_outputs", {"json_object": True}))
        if len(asked) > 1:
            raise ApiError(400, f"{asked[1][0]} cannot be combined with {asked[0][0]}", asked[1][0])
        if not asked:
            return None, {}
        field, kw = asked[0]
        try:
            SamplingParams(**kw)  # compiles the schema / checks the choices
        except ValueError as e:
            raise ApiError(400, f"{field}: {str(e).split(': ', 1)[-1]}", field) from None
        return field, kw

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def truncate(self, ids: list[int]) -> list[int]:
        """The prompt's last truncate_prompt_tokens ids (all of them when unset)."""
        k = self.truncate_prompt_tokens
        return list(ids) if k is None else list(ids)[-k:]

    def response_id(self, prefix: str) -> str:
        """The id the client gave (request_id or rid), else prefix + a fresh one."""
        if None not in (self.request_id, self.rid) and self.request_id != self.rid:
            raise ApiError(400, "request_id and rid name two ids: give one", "rid")
        return self.request_id or self.rid or f"{prefix}{uuid.uuid4().hex}"

    def check_common(self) -> None:
        """Refusals that pydantic's field types cannot express."""
        if self.n > MAX_CHOICES:
            raise ApiError(400, f"n={self.n} exceeds {MAX_CHOICES}", "n")
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
        _ = self.structured

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        """SamplingParams for this request; None fields take the model's `defaults` (its
        generation_config.json's, `model_sampling_defaults`), then the OpenAI defaults."""
        defaults = defaults or {}

        def pick(value: Any, default: Any, name: str = "") -> Any:
            return defaults.get(name, default) if value is None else value

        try:
            return SamplingParams(
                temperature=pick(self.temperature, 1.0, "temperature"),
                top_k=pick(self.top_k, -1, "top_k"),
                top_p=pick(self.top_p, 1.0, "top_p"),
                min_p=pick(self.min_p, 0.0, "min_p"),
                repetition_penalty=pick(self.repetition_penalty, 1.0, "repetition_penalty"),
                presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0),
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias={int(k): v for k, v in self.logit_bias.items()}
                if self.logit_bias
                else None,
                allowed_token_ids=self.allowed_token_ids,
                **self.structured[1],
            )
        except ValueError as e:  # SamplingParams messages start with the field name
            field = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), field if field in type(self).model_fields else None) from e


# the sampling fields a checkpoint's generation_config.json may set as defaults (vLLM's and SGLang's
# choice of keys; do_sample and the rest are not read)
MODEL_DEFAULTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def model_sampling_defaults(directory: str | Path) -> dict:
    """The sampling defaults in `directory`/generation_config.json ({} when there is none): what
    a request leaves unset takes them before the OpenAI defaults, as vLLM's --generation-config
    auto and SGLang's --sampling-defaults model. ValueError naming a malformed file or value."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    out = {}
    for key in MODEL_DEFAULTS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
        out[key] = int(value) if key == "top_k" else float(value)
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return out


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's completions default
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's extension: each prompt token's logprob, rank and the top n, on each choice
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of={self.best_of} is not supported; only 1", "best_of")
        if not self.prompt:
            raise ApiError(400, "prompt is empty", "prompt")
        if self.prompt_logprobs is not None and self.stream:
            raise ApiError(400, "prompt_logprobs is not supported with stream", "prompt_logprobs")
        echoed = self.logprobs if self.echo else None
        if None not in (echoed, self.prompt_logprobs) and echoed != self.prompt_logprobs:
            msg = (
                "prompt_logprobs and logprobs with echo ask for the prompt's top n: make them equal"
            )
            raise ApiError(400, msg, "prompt_logprobs")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            msg = f"{len(self.prompts())} prompts x n={self.n} exceed {MAX_CHOICES} choices"
            raise ApiError(400, msg, "prompt")

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or token list, or a list of them (choices prompt by prompt)."""
        p = self.prompt
        return p if isinstance(p, list) and p and isinstance(p[0], str | list) else [p]


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions. Thinking is off unless asked for (chat_template_kwargs)."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1)  # preferred over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's knob: "none" = non-thinking; "max" = Think Max; any other level = Think High
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "max"] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    # vLLM's: end the prompt with the assistant prefix / continue the final assistant message
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    separate_reasoning: bool = True  # SGLang's: false leaves the reasoning inline in content
    stream_reasoning: bool = True  # SGLang's: false sends the reasoning in one delta at its end
    # SGLang's DeepSeek-V4 quick-instruction task (`dsv4.chat.TASKS`): a classification of the
    # last user turn instead of an answer
    task: TaskName | None = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", "top_logprobs")

    def encoder_options(self) -> dict:
        """Keyword arguments for dsv4.chat.encode_messages."""
        kw = self.chat_template_kwargs or ChatTemplateKwargs()
        thinking = kw.thinking if kw.thinking is not None else kw.enable_thinking
        effort = kw.reasoning_effort
        if self.reasoning_effort is not None:
            if thinking is None:
                thinking = self.reasoning_effort != "none"
            if effort is None and self.reasoning_effort == "max":
                effort = "max"
        return {
            "tools": self.tools if self.tool_choice != "none" else None,
            "thinking": bool(thinking),
            "reasoning_effort": effort,
            "drop_thinking": kw.drop_thinking,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "task": self.task,
        }

    def callable_tools(self, opts: dict) -> list[dict] | None:
        """The tools whose calls the reply is parsed for: the request's, else those its system
        and developer messages carry (`chat.message_tools`); none under tool_choice "none"."""
        if self.tool_choice == "none":
            return None
        return opts["tools"] or message_tools(self.messages) or None

    def check_structured(self, opts: dict, prefix: str) -> None:
        """Structured output (JSON mode, a schema, a regex, a grammar, a choice) constrains the
        answer from its first token (in thinking mode: from the token after `</think>`), so it
        has no room for a forced tool call or a continued message."""
        field = self.structured[0]
        if field is None:
            return
        clash = (
            "a forced tool_choice" if prefix
            else "continue_final_message" if self.continue_final_message else None
        )  # fmt: skip
        if clash:
            raise ApiError(400, f"{field} cannot be combined with {clash}", field)

    def forced_tool(self, opts: dict) -> tuple[str, dict | None]:
        """tool_choice "required" or a named function: (the DSML text the answer is made to
        begin with, `chat.tool_call_prefix`; the constraint of the call's arguments by the tools'
        schemas, `SamplingParams.tool_calls`), ("", None) otherwise. In chat mode the text goes
        after the prompt; in thinking mode the sampler forces its tokens right after `</think>`
        (`forced_after`). A strict function's schema it cannot constrain to is a 400 naming
        tools."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return "", None
        if not self.tools:
            raise ApiError(400, f"tool_choice={choice!r} needs tools", "tool_choice")
        if opts["thinking"] and not self.add_generation_prompt:
            msg = f"tool_choice={choice!r} in thinking mode needs add_generation_prompt"
            raise ApiError(400, msg, "tool_choice")
        if self.continue_final_message:
            msg = "tool_choice cannot be combined with continue_final_message"
            raise ApiError(400, msg, "tool_choice")
        name = None
        if choice != "required":
            fn = choice.get("function") if choice.get("type", "function") == "function" else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str) or not name:
                msg = "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
                raise ApiError(400, msg, "tool_choice")
            names = {
                (t.get("function") or {}).get("name") for t in self.tools if isinstance(t, dict)
            }
            if name not in names:
                msg = f"tool_choice names {name!r}, which is not in tools"
                raise ApiError(400, msg, "tool_choice")
        spec = {
            "tools": self.tools,
            "name": name,
            "parallel": self.parallel_tool_calls is not False,
        }
        try:
            SamplingParams(tool_calls=spec)
        except ValueError as e:
            raise ApiError(400, f"tools: {str(e).split(': ', 1)[-1]}", "tools") from None
        return tool_call_prefix(name), spec

    def output_in_reasoning(self, opts: dict) -> bool:
        """Whether the model's output starts inside its reasoning, to be split off into
        reasoning_content: thinking mode after a fresh assistant prefix, or continuing a final
        message's reasoning. Never with separate_reasoning=false (all of it is content)."""
        if not self.separate_reasoning:
            return False
        if self.continue_final_message:
            return continues_reasoning(self.messages, opts["thinking"])
        if self.task not in (None, "action"):  # (no answer's prefix: the task's token)
            return False
        return opts["thinking"] and self.add_generation_prompt


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt string, or chat messages rendered as /v1/chat/completions does."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # prompt: prepend BOS, as /v1/completions does
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    add_generation_prompt: bool = True
    task: TaskName | None = None


class UpdateWeightsRequest(BaseModel):
    """SGLang's POST /update_weights_from_disk: another checkpoint of the served model, loaded
    in place once the requests in flight have finished (new ones wait; abort_all_requests ends
    the running ones first)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model_path: str
    load_format: Literal["auto", "safetensors"] | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: Literal[True] = True  # (the cached prefixes hold the old weights' state)


class MemoryTagsRequest(BaseModel):
    """SGLang's POST /release_memory_occupation and /resume_memory_occupation: what to give
    back or take again, of "weights" and "kv_cache" (None: both)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    tags: list[str] | None = None


class PauseGenerationRequest(BaseModel):
    """SGLang's POST /pause_generation: new requests wait until /continue_generation; "abort"
    ends the running ones, "in_place" holds them where they are (a weight update may come in
    between: they go on with the new weights), "retract" holds them with their state freed (a
    sleep may come in between too; they recompute prompt + output on continue)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    mode: Literal["abort", "in_place", "retract"] = "abort"


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]


class NativeSamplingParams(BaseModel):
    """`sampling_params` of SGLang's native POST /generate (its names and defaults)."""

    model_config = ConfigDict(strict=True, extra="allow")

    max_new_tokens: int = Field(128, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1)
    sampling_seed: int | None = None
    json_schema: str | None = None  # structured outputs: the schema's JSON text (dsv4.json_schema)
    regex: str | None = None  # the output matches this regex (dsv4.regex)
    ebnf: str | None = None  # a sentence of this grammar (dsv4.ebnf)


class GenerateRequest(BaseModel):
    """SGLang's native POST /generate: `text` or `input_ids`, one prompt or a batch (a list). The
    response is {text, output_ids, meta_info}, or a list of them for a batch or n > 1 (prompt
    by prompt, n each); a stream sends that body after every step, text cumulative (with
    `index` when there are several). return_logprob adds meta_info's output_token_logprobs
    ([logprob, token id, text or None] per token), and from logprob_start_len (-1: none) the
    prompt's input_token_logprobs (None for the first token); top_logprobs_num > 0 the
    output_top_logprobs / input_top_logprobs lists too."""

    model_config = ConfigDict(strict=True, extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    return_text_in_logprobs: bool = False
    priority: int | None = None  # SGLang's: the place under a priority policy

    @property
    def batch(self) -> bool:
        """The prompts came as a list (the response is a list)."""
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompts(self) -> list:
        """The prompts: texts or token id lists."""
        one = self.text if self.text is not None else self.input_ids
        return list(one) if self.batch else [one]

    def rids(self) -> list[str]:
        """An id per job (prompt by prompt, n each): the request's rid (a list for a batch),
        with -j for completion j of n > 1, or generated."""
        n, prompts = self.sampling_params.n, len(self.prompts())
        if self.rid is None:
            base = [f"gen-{uuid.uuid4().hex}" for _ in range(prompts)]
        elif isinstance(self.rid, list):
            base = list(self.rid)
        else:
            base = [self.rid]
        if len(base) != prompts:
            raise ApiError(400, f"rid: {len(base)} ids for {prompts} prompts", "rid")
        return base if n == 1 else [f"{b}-{j}" for b in base for j in range(n)]

    def check(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "send exactly one of text and input_ids", "text")
        field = "text" if self.text is not None else "input_ids"
        prompts = self.prompts()
        if not prompts:
            raise ApiError(400, f"{field}: an empty batch", field)
        if (
            self.batch
            and self.input_ids is not None
            and not all(isinstance(p, list) for p in prompts)
        ):
            raise ApiError(400, "input_ids: a list of token ids or a list of such lists", field)
        jobs = len(prompts) * self.sampling_params.n
        if jobs > MAX_CHOICES:
            raise ApiError(
                400, f"{jobs} completions (prompts x n); at most {MAX_CHOICES}", "sampling_params"
            )
        # SGLang's fields whose answer this server cannot give: refused by name rather than
        # dropped with the unknown keys
        for name in REFUSED_NATIVE:
            if (self.model_extra or {}).get(name) not in (None, False):
                raise ApiError(400, f"{name} is not supported on /generate", name)
        # SGLang's other structured outputs (json_schema, regex and ebnf are supported)
        if (self.sampling_params.model_extra or {}).get("structural_tag") is not None:
            msg = (
                "sampling_params structural_tag is not supported (json_schema, regex and ebnf are)"
            )
            raise ApiError(400, msg, "sampling_params")

    def check_prompt(self, ids: list[int]) -> None:
        """logprob_start_len within a prompt (SGLang refuses it at or past the prompt's end)."""
        if self.return_logprob and self.logprob_start_len >= len(ids):
            raise ApiError(
                400,
                f"logprob_start_len {self.logprob_start_len} is past the prompt's {len(ids)} "
                f"tokens",
                "logprob_start_len",
            )

    def params(self) -> SamplingParams:
        p = self.sampling_params
        try:
            return SamplingParams(
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                min_p=p.min_p,
                repetition_penalty=p.repetition_penalty,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                seed=p.sampling_seed,
                max_tokens=p.max_new_tokens,
                min_tokens=p.min_new_tokens,
                stop=p.stop,
                stop_token_ids=p.stop_token_ids,
                ignore_eos=p.ignore_eos,
                skip_special_tokens=p.skip_special_tokens,
                json_schema=p.json_schema,
                guided_regex=p.regex,
                guided_grammar=p.ebnf,
                logprobs=self.top_logprobs_num if self.return_logprob else None,
                prompt_logprobs=(
                    self.top_logprobs_num
                    if self.return_logprob and self.logprob_start_len >= 0
                    else None
                ),
            )
        except ValueError as e:
            raise ApiError(400, str(e), "sampling_params") from e
