"""The request models more than one API shares: the sampling and format fields of a
generation request, chat messages and the chat template's options, and the chat completion
request that the Responses and Messages APIs become.

PURE: pydantic and the core package only (no torch, no asyncio). Requests are pydantic models with
strict types: "10" or 1.5 is not an integer and 1 is not a boolean, while a JSON 1 is a valid
float. Unknown fields are ignored; known fields the server does not support (suffix,
best_of > 1, ...) are refused with a message naming them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from aioinfer.core.request import MAX_CACHE_SALT_CHARS
from aioinfer.core.sampling_params import SamplingParams, StructuredOutputsParams
from aioinfer.engine.tokenizer import check_template_kwargs
from aioinfer.server.http.request_model import ModelRequest, RequestModel, RequestValidationError
from aioinfer.server.http.validation import (
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID,
    REQUEST_ID_RULE,
    short_repr,
)
from aioinfer.server.serving.formats import ResponseFormat, StructuredOutputs
from aioinfer.server.serving.tools import (
    AssistantToolCall,
    ChatTool,
    NamedToolChoice,
    ToolMode,
    ToolsError,
    tool_constraint,
)

# A request's own chat template (--trust-request-chat-template) is refused past this size.
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024
# The most completions one request may ask for per prompt (OpenAI allows 128; vLLM's default
# max_num_seqs is 256); generation.admit refuses more.
MAX_N = 256
# The most messages a chat may hold, as sent and as rendered (what the Responses and Messages
# APIs make of theirs, with what they continue): each is a model of its own and a turn of the
# template (300,000 empty messages, an 8.7 MB body, held 173 MB and took 1.7 s to validate
# before the template wrote a prompt far past any context).
MAX_CHAT_MESSAGES = 10_000


def check_prompt_shape(value: Any) -> Any:
    """A completions prompt (or embeddings input) as given; ValueError for any other shape."""
    if is_prompt(value):
        return value
    raise ValueError(
        "must be a string, a list of strings, a list of token ids or a list of token-id "
        f"lists, none of them empty; got {short_repr(value)}"
    )


def is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(p, str) for p in value) or all(_is_int(t) for t in value):
        return True
    return all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class StreamOptions(RequestModel):
    include_usage: bool | None = Field(None, description="Send a final chunk with the usage.")
    continuous_usage_stats: bool | None = Field(None, description="Send the usage in each chunk.")


class GenerationRequest(ModelRequest):
    """Fields shared by completions and chat completions: sampling, output formats, streaming."""

    UNSUPPORTED: ClassVar[Mapping[str, str]] = {
        "use_beam_search": "beam search is served offline only (LLM.beam_search)",
        "return_tokens_as_token_ids": "logprobs name each token by its text",
    }

    # SamplingParams fields that map one to one; unset ones take the model's defaults.
    SAMPLING_FIELDS: ClassVar[tuple[str, ...]] = (
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "ignore_eos",
        "min_tokens",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
        "prompt_logprobs",
    )

    model: str | None = Field(None, description="The served model name (default: the only one).")
    n: int | None = Field(
        None,
        description=f"Completions per prompt (default 1), at most {MAX_N}.",
        json_schema_extra={"maximum": MAX_N},  # checked with the sequences (admit)
    )
    temperature: float | None = Field(None, le=2.0, description="0 to 2, as OpenAI's.")
    top_p: float | None = None
    top_k: int | None = Field(None, description="0 or -1: no top-k truncation.")
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(None, description="Strings that end the output.")
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) to a bias in [-100, 100]."
    )
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = Field(None, description="Sample only these tokens.")
    bad_words: list[str] | None = Field(None, description="Words the output never contains.")
    truncate_prompt_tokens: int | None = Field(
        None, description="Keep only the prompt's last k tokens (-1: what the context holds)."
    )
    request_id: str | None = Field(
        None,
        description="Names the response (cmpl-<request_id>), as vLLM's; X-Request-Id wins. "
        f"Printable ASCII without spaces, at most {MAX_REQUEST_ID_CHARS} characters.",
        json_schema_extra={"pattern": f"^[!-~]{{1,{MAX_REQUEST_ID_CHARS}}}$"},
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="Prefixes shared only within a salt.",
    )
    priority: int = Field(
        0, description="With --scheduling-policy priority: lower runs first (vLLM's field)."
    )
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema (with json_schema.schema)."
    )
    structured_outputs: StructuredOutputs | None = None
    # vLLM before 0.12; it ignores them now, which silently drops the constraint.
    guided_json: Any = Field(None, description="Refused: use structured_outputs.json.")
    guided_regex: Any = Field(None, description="Refused: use structured_outputs.regex.")
    guided_choice: Any = Field(None, description="Refused: use structured_outputs.choice.")
    guided_grammar: Any = Field(None, description="Refused: use structured_outputs.grammar.")
    # >= 0 over HTTP: the offline API's -1 (the whole vocabulary) is not the API's.
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        description="Logprobs of each prompt token and its top alternatives (vLLM's).",
    )
    return_token_ids: bool | None = Field(
        None, description="Also return the prompt's and the output's token ids (vLLM's)."
    )
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None

    @field_validator("request_id")
    @classmethod
    def _request_id_chars(cls, value: str | None) -> str | None:
        # It names the response and reaches the log: a newline would forge a log line.
        if value is not None and not REQUEST_ID.fullmatch(value):
            raise ValueError(f"{REQUEST_ID_RULE}, got {short_repr(value)}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError(f"must be a string or a list of strings, got {short_repr(value)}")

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestValidationError(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.prompt_logprobs is not None and self.stream:
            raise RequestValidationError(
                "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )
        if self.structured_outputs is not None and self.structured_param == "response_format":
            raise RequestValidationError(
                "response_format and structured_outputs cannot both constrain the output",
                "structured_outputs",
            )
        self._structured_outputs()  # refuses a malformed spec at parse time
        for kind in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{kind}") is not None:
                raise RequestValidationError(
                    f"guided_{kind} is vLLM's old name (removed in 0.12): send "
                    f"structured_outputs {{'{kind}': ...}} instead",
                    f"guided_{kind}",
                )

    @property
    def structured_param(self) -> str | None:
        """The field that constrains the output to a language, if any."""
        return self._format_param()

    def _format_param(self) -> str | None:
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return "structured_outputs" if self.structured_outputs is not None else None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        try:
            if self.response_format is not None and self.response_format.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if self.response_format is not None and self.response_format.type == "json_schema":
                schema = self.response_format.json_schema
                if schema is None or schema.json_schema is None:
                    raise RequestValidationError(
                        "response_format of type json_schema needs json_schema.schema",
                        "response_format",
                    )
                return StructuredOutputsParams(json=schema.json_schema)
            spec = self.structured_outputs
            if spec is None:
                return None
            return StructuredOutputsParams(**spec.model_dump(by_alias=True))  # the same names
        except RequestValidationError:
            raise
        except ValueError as exc:
            param = self._format_param() or "structured_outputs"
            message = str(exc)
            if param == "response_format":
                message = message.replace(
                    "structured_outputs.json", "response_format.json_schema.schema"
                )
            raise RequestValidationError(message, param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _sampling_values(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name in self.SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                values[name] = value
        values["logit_bias"] = _parse_logit_bias(self.logit_bias)
        values["structured_outputs"] = self._structured_outputs()
        return values

    def _build(self, values: dict[str, Any]) -> SamplingParams:
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise RequestValidationError(str(exc), _param_of(str(exc))) from None


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    # "developer" is OpenAI's newer name for system instructions; templates see it as given.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="A string or a list of text parts."
    )
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = Field(
        None, description="An assistant message's tool calls."
    )
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")
    reasoning: str | None = Field(None, description="An assistant message's reasoning.")
    reasoning_content: str | None = Field(None, description="The same, by its older name.")

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(
                        f"only text content parts ({{'type': 'text', 'text': ...}}) are "
                        f"supported, got {short_repr(part)}"
                    )
            return value
        raise ValueError(f"must be a string or a list of text parts, got {short_repr(value)}")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def to_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.to_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:  # Qwen3's template reads reasoning_content
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message


def check_messages(messages: list[ChatMessage]) -> None:
    """What OpenAI refuses in a conversation: more than MAX_CHAT_MESSAGES messages, a message
    without content (an assistant's that calls tools aside), a tool message that does not name
    its call."""
    if len(messages) > MAX_CHAT_MESSAGES:
        raise too_many_messages(len(messages))
    for i, message in enumerate(messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            needs = "content or tool_calls" if message.role == "assistant" else "content"
            raise RequestValidationError(
                f"a {message.role} message needs {needs}", f"messages[{i}].content"
            )
        if message.role == "tool" and message.tool_call_id is None:
            raise RequestValidationError(
                "tool_call_id is required in a tool message: it names the call answered",
                f"messages[{i}].tool_call_id",
            )


def too_many_messages(count: int) -> RequestValidationError:
    """The 400 for a conversation past MAX_CHAT_MESSAGES (`count` of them, or more: what
    another API's request becomes is counted as it is built)."""
    return RequestValidationError(
        f"messages may hold at most {MAX_CHAT_MESSAGES} messages, got {count} (a system "
        "prompt, each tool result and what the request continues count as messages)",
        "messages",
    )


class ChatTemplateOptions(RequestModel):
    """How chat messages are rendered through the model's template (as vLLM's fields)."""

    add_generation_prompt: bool | None = Field(
        True, description="End the prompt with the assistant header."
    )
    continue_final_message: bool | None = Field(
        False,
        description="Leave the last message open for the model to continue (set "
        "add_generation_prompt to false).",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Variables for the chat template, e.g. {'enable_thinking': false}."
    )
    tools: list[ChatTool] | None = Field(
        None, description="Functions the model may call (shown by the template)."
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template for this request, instead of the model's (needs "
        "--trust-request-chat-template).",
    )
    documents: list[dict[str, str]] | None = Field(
        None, description="Documents for a retrieval template, each a dict of strings."
    )

    def check_template_options(self) -> None:
        if self.add_generation_prompt is not False and self.continue_final_message:
            raise RequestValidationError(
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the last message",
                "continue_final_message",
            )
        if self.chat_template is not None and "{" not in self.chat_template:
            # Never a path: a client must not have the server read its files.
            raise RequestValidationError("chat_template must be Jinja text", "chat_template")
        if self.chat_template is not None and len(self.chat_template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise RequestValidationError(
                f"chat_template must be at most {MAX_REQUEST_TEMPLATE_CHARS} characters long, "
                f"got {len(self.chat_template)}",
                "chat_template",
            )
        try:
            check_template_kwargs(self.chat_template_kwargs)
        except ValueError as exc:
            raise RequestValidationError(str(exc), "chat_template_kwargs") from None

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of `apply_chat_template`."""
        return {
            "add_generation_prompt": self.add_generation_prompt is not False,
            "continue_final_message": bool(self.continue_final_message),
            "chat_template_kwargs": self.chat_template_kwargs,
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []] or None,
            "chat_template": self.chat_template,
            "documents": self.documents,
        }


class ChatCompletionRequest(GenerationRequest, ChatTemplateOptions):
    """POST /v1/chat/completions."""

    UNSUPPORTED: ClassVar[Mapping[str, str]] = {
        **GenerationRequest.UNSUPPORTED,
        "echo": "a chat reply does not repeat the last message",
    }
    MAX_ITEMS: ClassVar[Mapping[str, int]] = {"messages": MAX_CHAT_MESSAGES}

    messages: list[ChatMessage] = Field(
        min_length=1, description=f"The conversation: at most {MAX_CHAT_MESSAGES} messages."
    )
    max_completion_tokens: int | None = Field(
        None, description="Output limit (default: the rest of the context)."
    )
    logprobs: bool | None = Field(False, description="Return the chosen tokens' logprobs.")
    top_logprobs: int | None = Field(None, description="Alternatives per token (needs logprobs).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description='"required" or a named function (the output is then the calls, as '
        'JSON that follows the schemas); "auto" is not supported. Default: "none" without '
        'tools, "auto" with them.',
    )
    parallel_tool_calls: bool | None = Field(
        True, description='With tool_choice "required": whether more than one call may come.'
    )
    include_reasoning: bool | None = Field(
        True, description="With the server's --reasoning-parser: return the reasoning."
    )
    functions: list[Any] | None = Field(None, description="OpenAI's deprecated form of tools.")
    function_call: Any = Field(None, description="OpenAI's deprecated form of tool_choice.")

    def check_supported(self) -> None:
        super().check_supported()
        check_messages(self.messages)
        format_param = self._format_param()
        if self.tool_call_constraint is not None and format_param is not None:
            raise RequestValidationError(  # the format first: other APIs rename it
                f"{format_param} and tool_choice cannot both constrain the output", "tool_choice"
            )
        if self.functions or self.function_call is not None:
            param = "functions" if self.functions else "function_call"
            raise RequestValidationError(
                f"{param} is OpenAI's old function calling: send tools and tool_choice", param
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestValidationError("top_logprobs needs logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise RequestValidationError(
                f"top_logprobs must be >= 0, got {self.top_logprobs}", "top_logprobs"
            )
        self.check_template_options()

    @property
    def max_tokens_given(self) -> bool:
        return self.max_completion_tokens is not None or self.max_tokens is not None

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.to_template() for message in self.messages]

    @property
    def auto_tools(self) -> bool:
        """Whether the model decides itself to call tools (tool_choice "auto", the default
        with tools), which needs a parser of its tool-call text."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @functools.cached_property
    def tool_call_constraint(self) -> tuple[ToolMode, StructuredOutputsParams] | None:
        """How tool_choice constrains the output (computed once: the handler, the checks and
        the sampling params all read it); raises RequestValidationError."""
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        try:
            return tool_constraint(self.tools or [], choice, self.parallel_tool_calls is not False)
        except ToolsError as exc:
            raise RequestValidationError(str(exc), exc.param) from None

    @property
    def structured_param(self) -> str | None:
        return "tools" if self.tool_mode is not None else self._format_param()

    @property
    def tool_mode(self) -> ToolMode | None:
        constraint = self.tool_call_constraint
        return None if constraint is None else constraint[0]

    def to_sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """The request's SamplingParams; max_tokens None means the rest of the context."""
        values = self._sampling_values(defaults)
        constraint = self.tool_call_constraint
        if constraint is not None:
            values["structured_outputs"] = constraint[1]
        limit = self.max_completion_tokens
        if limit is None:
            limit = self.max_tokens
        elif limit < 1:  # checked here: SamplingParams would name max_tokens
            raise RequestValidationError(
                f"max_completion_tokens must be >= 1, got {limit}", "max_completion_tokens"
            )
        values["max_tokens"] = capped_max_tokens(limit, defaults)
        if self.logprobs:
            values["logprobs"] = self.top_logprobs or 0
        return self._build(values)


def capped_max_tokens(limit: int | None, defaults: Mapping[str, Any]) -> int | None:
    """max_tokens under the server's cap (--override-generation-config's max_new_tokens, a
    cap as in vLLM; None: the rest of the context)."""
    cap = defaults.get("max_tokens")
    if cap is None:
        return limit
    return cap if limit is None else min(limit, cap)


def _parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    parsed: dict[int, float] = {}
    for key, bias in logit_bias.items():
        # ASCII digits only: int() also reads " 5", "5_0" (as 50) and other scripts' digits
        token = int(key) if re.fullmatch(r"-?[0-9]{1,18}", key) else None
        if token is None:
            raise RequestValidationError(
                f'logit_bias keys must be token ids written as strings (e.g. "50256"), got {key!r}',
                "logit_bias",
            )
        if not -100.0 <= bias <= 100.0:  # OpenAI's range (the offline API takes any)
            raise RequestValidationError(
                f"logit_bias values must be in [-100, 100], got {bias} ({key})", "logit_bias"
            )
        parsed[token] = bias
    return parsed


_SAMPLING_PARAM_NAMES = frozenset(SamplingParams.__dataclass_fields__)


def _param_of(message: str) -> str | None:
    """SamplingParams messages start with the field's name."""
    first = message.split(" ", 1)[0]
    return first if first in _SAMPLING_PARAM_NAMES else None
