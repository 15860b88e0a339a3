"""OpenAI request and response schemas; the source of /openapi.json.

PURE: pydantic and the core package only (no torch, no asyncio). Requests are pydantic models with
strict types: "10" or 1.5 is not an integer and 1 is not a boolean, while a JSON 1 is a valid
float. Unknown fields are ignored; known fields the server does not support (tools,
response_format, suffix, best_of > 1, ...) are refused with a message naming them. Responses are
TypedDicts: the handlers build plain dicts that orjson serializes, and the same types give the
response schemas. The builders at the end turn engine outputs into those dicts.
"""

from __future__ import annotations

import reprlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from typing_extensions import NotRequired, TypedDict

from aioinfer.core.outputs import CompletionOutput, RequestOutput
from aioinfer.core.sampling_params import SamplingParams
from aioinfer.core.step import TokenLogprobs

COMPLETION_MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions
_MAX_REPORTED_ERRORS = 3
_MAX_INPUT_REPR = 80
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, _MAX_INPUT_REPR, _MAX_INPUT_REPR

TokenText = Callable[[int], str]
_M = TypeVar("_M", bound="OpenAIRequest")


class RequestValidationError(ValueError):
    """A request the server refuses (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# --------------------------------------------------------------------------- requests


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @classmethod
    def parse(cls: type[_M], data: Mapping[str, Any]) -> _M:
        """Validate a decoded JSON object; raises RequestValidationError with a readable
        message that names the field."""
        try:
            request = cls.model_validate(data)
        except ValidationError as exc:
            message, param = describe_validation_error(exc)
            raise RequestValidationError(message, param) from None
        request.check_supported()
        return request

    def check_supported(self) -> None:
        """Refuse valid-looking requests the server cannot serve."""


class StreamOptions(OpenAIRequest):
    include_usage: bool | None = Field(None, description="Send a final chunk with the usage.")
    continuous_usage_stats: bool | None = Field(None, description="Send the usage in each chunk.")


class _GenerationRequest(OpenAIRequest):
    """Fields shared by completions and chat completions."""

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
    )

    model: str | None = Field(None, description="The served model name (default: the only one).")
    n: int | None = Field(None, description="Completions per prompt (default 1).")
    temperature: float | None = None
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
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError(f"must be a string or a list of strings, got {_short(value)}")

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestValidationError(
                "stream_options is only allowed when stream is true", "stream_options"
            )

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
        return values

    def _build(self, values: dict[str, Any]) -> SamplingParams:
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise RequestValidationError(str(exc), _param_of(str(exc))) from None


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A text, a list of texts, a list of token ids or a list of such lists."
    )
    echo: bool | None = Field(False, description="Prepend the prompt to each completion.")
    logprobs: int | None = Field(None, description="Top logprobs per token (0: the chosen one).")
    suffix: str | None = Field(None, description="Not supported: refused unless empty.")
    best_of: int | None = Field(None, description="Not supported: refused unless 1.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if _is_prompt(value):
            return value
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id "
            f"lists, none of them empty; got {_short(value)}"
        )

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise RequestValidationError(
                "suffix is not supported: fill-in-the-middle needs a model-specific prompt; put "
                "the text in the prompt instead",
                "suffix",
            )
        if self.best_of is not None and self.best_of != 1:
            raise RequestValidationError(
                f"best_of must be 1 (or omitted): it is not supported, got {self.best_of}",
                "best_of",
            )

    @property
    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None

    def to_sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """The request's SamplingParams: request values, then the model's defaults, then
        OpenAI's (max_tokens 16)."""
        values = self._sampling_values(defaults)
        limit = self.max_tokens
        if limit is None:
            limit = defaults.get("max_tokens", COMPLETION_MAX_TOKENS_DEFAULT)
        values["max_tokens"] = limit
        if self.logprobs is not None:
            values["logprobs"] = self.logprobs
            if self.echo:
                values["prompt_logprobs"] = self.logprobs
        return self._build(values)


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIRequest):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart] | None = Field(
        None, description="A string or a list of text parts."
    )
    name: str | None = None

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
                        f"supported, got {_short(part)}"
                    )
            return value
        raise ValueError(f"must be a string or a list of text parts, got {_short(value)}")

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
        return message


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(
        None, description="Output limit (default: the rest of the context)."
    )
    logprobs: bool | None = Field(False, description="Return the chosen tokens' logprobs.")
    top_logprobs: int | None = Field(None, description="Alternatives per token (needs logprobs).")
    add_generation_prompt: bool | None = Field(
        True, description="End the prompt with the assistant header."
    )
    tools: list[Any] | None = Field(None, description="Not supported: refused unless empty.")
    tool_choice: Any = Field(None, description="Not supported: refused unless 'none'.")
    functions: list[Any] | None = Field(None, description="Not supported.")
    function_call: Any = Field(None, description="Not supported.")
    response_format: Any = Field(None, description="Only {'type': 'text'} is supported.")

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise RequestValidationError("tools are not supported by this server", "tools")
        if self.tool_choice not in (None, "none"):
            raise RequestValidationError(
                "tool_choice must be 'none' (or omitted): tools are not supported", "tool_choice"
            )
        if self.functions or self.function_call is not None:
            param = "functions" if self.functions else "function_call"
            raise RequestValidationError(f"{param} is not supported (no function calling)", param)
        if self.response_format not in (None, {"type": "text"}):
            raise RequestValidationError(
                "response_format must be {'type': 'text'} (or omitted): structured output is not "
                "supported",
                "response_format",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestValidationError("top_logprobs needs logprobs to be true", "top_logprobs")

    @property
    def max_tokens_given(self) -> bool:
        return self.max_completion_tokens is not None or self.max_tokens is not None

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.to_template() for message in self.messages]

    def to_sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """The request's SamplingParams; max_tokens None means the rest of the context."""
        values = self._sampling_values(defaults)
        limit = self.max_completion_tokens
        if limit is None:
            limit = self.max_tokens
        values["max_tokens"] = limit if limit is not None else defaults.get("max_tokens")
        if self.logprobs:
            values["logprobs"] = self.top_logprobs or 0
        return self._build(values)


class TokenizeRequest(OpenAIRequest):
    """POST /tokenize: either a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(True, description="For prompt: add BOS etc.")
    add_generation_prompt: bool | None = Field(True, description="For messages.")

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestValidationError(
                "give exactly one of prompt and messages", "prompt" if self.prompt else "messages"
            )


class DetokenizeRequest(OpenAIRequest):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- responses


class UsageInfo(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class CompletionResponse(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[UsageInfo | None]


class CompletionChunk(TypedDict):
    """One SSE chunk of a streamed completion: usage only with stream_options."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[UsageInfo | None]


class TopLogprob(TypedDict):
    token: str
    logprob: float | None
    bytes: list[int]


class ChatLogprob(TypedDict):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatLogprob]


class ChatResponseMessage(TypedDict):
    role: Literal["assistant"]
    content: str


class ChatChoice(TypedDict):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(TypedDict):
    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str]


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: NotRequired[int | str | None]


class ChatCompletionChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: NotRequired[UsageInfo | None]


class ModelPermission(TypedDict):
    id: str
    object: Literal["model_permission"]
    allow_sampling: bool


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    permission: list[ModelPermission]


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorInfo(TypedDict):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(TypedDict):
    error: ErrorInfo


class TokenizeResponse(TypedDict):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(TypedDict):
    prompt: str


class VersionResponse(TypedDict):
    version: str


# --------------------------------------------------------------------------- validation helpers


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """A readable message naming each offending field (the first few), and the first field."""
    errors = exc.errors(include_url=False)
    parts = []
    for error in errors[:_MAX_REPORTED_ERRORS]:
        path = format_loc(error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "missing":
            message = "field required"
        elif error["type"] != "value_error":
            message = f"{message}, got {_short(error.get('input'))}"
        parts.append(f"{path}: {message}" if path else message)
    if len(errors) > _MAX_REPORTED_ERRORS:
        parts.append(f"and {len(errors) - _MAX_REPORTED_ERRORS} more errors")
    param = format_loc(errors[0]["loc"]) if errors else None
    return "Invalid request: " + "; ".join(parts), param or None


def format_loc(loc: Sequence[int | str]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _short(value: Any) -> str:
    text = _REPR.repr(value)  # bounded work, whatever the size or depth of the value
    if len(text) > _MAX_INPUT_REPR:
        text = text[: _MAX_INPUT_REPR - 3] + "..."
    return f"{text} ({_json_type(value)})"


def _json_type(value: Any) -> str:
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "object"
    return kinds.get(type(value), type(value).__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(p, str) for p in value) or all(_is_int(t) for t in value):
        return True
    return all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value)


def _parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    parsed: dict[int, float] = {}
    for key, bias in logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise RequestValidationError(
                f'logit_bias keys must be token ids written as strings (e.g. "50256"), got {key!r}',
                "logit_bias",
            ) from None
        parsed[token] = bias
    return parsed


_SAMPLING_PARAM_NAMES = frozenset(SamplingParams.__dataclass_fields__)


def _param_of(message: str) -> str | None:
    """SamplingParams messages start with the field's name."""
    first = message.split(" ", 1)[0]
    return first if first in _SAMPLING_PARAM_NAMES else None


# --------------------------------------------------------------------------- response builders


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Prompt:
    """One prompt as the engine sees it: token ids, and the text when there was one."""

    token_ids: list[int]
    text: str | None = None


def model_card(name: str, max_model_len: int, created: int) -> ModelCard:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "aioinfer",
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {"id": f"modelperm-{name}", "object": "model_permission", "allow_sampling": True}
        ],
    }


def completion_logprobs(
    entries: Sequence[TokenLogprobs | None],
    token_ids: Sequence[int],
    token_text: TokenText,
    offset: int,
) -> CompletionLogprobs:
    """The legacy completions logprobs block; `offset` is where the first token's text starts.
    An entry of None (the first prompt token) has no logprob."""
    out: CompletionLogprobs = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = token_text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {token_text(t): lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(entries: Sequence[TokenLogprobs], token_text: TokenText) -> ChatLogprobs:
    content: list[ChatLogprob] = []
    for entry in entries:
        text = token_text(entry.token_id)
        top: list[TopLogprob] = []
        for token_id, logprob in entry.top:
            top_text = token_text(token_id)
            top.append({"token": top_text, "logprob": logprob, "bytes": _utf8(top_text)})
        content.append(
            {"token": text, "logprob": entry.logprob, "bytes": _utf8(text), "top_logprobs": top}
        )
    return {"content": content}


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def _offset_of(logprobs: CompletionLogprobs, start: int) -> int:
    if not logprobs["tokens"]:
        return start
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


@dataclass
class ResponseContext:
    """What every response of one request shares."""

    response_id: str
    model: str
    prompts: list[Prompt]
    n: int
    token_text: TokenText
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def choice_index(self, prompt_index: int, seq_index: int) -> int:
        return prompt_index * self.n + seq_index

    def prompt_text(self, prompt_index: int, decode: Callable[[list[int]], str]) -> str:
        prompt = self.prompts[prompt_index]
        return prompt.text if prompt.text is not None else decode(prompt.token_ids)


def completion_response(
    ctx: ResponseContext,
    finals: Sequence[RequestOutput],
    *,
    echo_texts: Sequence[str] | None,
    want_logprobs: bool,
) -> CompletionResponse:
    """The non-streaming /v1/completions body; `echo_texts` holds each prompt's text when the
    request asked for echo."""
    choices: list[CompletionChoice] = []
    completion_tokens = 0
    for p, final in enumerate(finals):
        for seq in final.outputs:
            completion_tokens += len(seq.token_ids)
            echo = echo_texts[p] if echo_texts is not None else ""
            logprobs = None
            if want_logprobs:
                logprobs = _echo_logprobs(ctx, p, final, echo_texts is not None)
                more = completion_logprobs(
                    seq.logprobs or [], seq.token_ids, ctx.token_text, _offset_of(logprobs, 0)
                )
                for key in logprobs:
                    logprobs[key].extend(more[key])  # type: ignore[literal-required]
            choices.append(
                {
                    "index": ctx.choice_index(p, seq.index),
                    "text": echo + seq.text,
                    "logprobs": logprobs,
                    "finish_reason": seq.finish_reason,
                    "stop_reason": seq.stop_reason,
                }
            )
    return {
        "id": ctx.response_id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage(ctx.prompt_tokens, completion_tokens),
    }


def _echo_logprobs(
    ctx: ResponseContext, prompt_index: int, output: RequestOutput, echo: bool
) -> CompletionLogprobs:
    """The prompt part of an echoed completion's logprobs (empty without echo)."""
    if not echo or output.prompt_logprobs is None:
        return completion_logprobs([], [], ctx.token_text, 0)
    ids = ctx.prompts[prompt_index].token_ids
    return completion_logprobs(output.prompt_logprobs, ids, ctx.token_text, 0)


def chat_response(
    ctx: ResponseContext, final: RequestOutput, *, want_logprobs: bool
) -> ChatCompletionResponse:
    choices: list[ChatChoice] = []
    completion_tokens = 0
    for seq in final.outputs:
        completion_tokens += len(seq.token_ids)
        logprobs = chat_logprobs(seq.logprobs or [], ctx.token_text) if want_logprobs else None
        choices.append(
            {
                "index": seq.index,
                "message": {"role": "assistant", "content": seq.text},
                "logprobs": logprobs,
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason,
            }
        )
    return {
        "id": ctx.response_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage(ctx.prompt_tokens, completion_tokens),
    }


@dataclass
class StreamOptionsView:
    include_usage: bool = False
    continuous_usage: bool = False


class _ChunkStream:
    """Shared bookkeeping of the streaming renderers: token counts and usage."""

    object_name = ""

    def __init__(self, ctx: ResponseContext, options: StreamOptionsView) -> None:
        self.ctx = ctx
        self.options = options
        self.completion_tokens = 0

    def _usage_now(self) -> UsageInfo:
        return usage(self.ctx.prompt_tokens, self.completion_tokens)

    def _with_usage(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if self.options.continuous_usage:
            chunk["usage"] = self._usage_now()
        return chunk

    def closing(self) -> list[dict[str, Any]]:
        """The final usage chunk (empty choices) when include_usage was asked for."""
        if not self.options.include_usage:
            return []
        return [self._envelope([], usage=self._usage_now())]

    def _envelope(self, choices: list[Any], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.ctx.response_id,
            "object": self.object_name,
            "created": self.ctx.created,
            "model": self.ctx.model,
            "choices": choices,
            **extra,
        }


class CompletionChunks(_ChunkStream):
    """The SSE chunks of a streamed /v1/completions response."""

    object_name = "text_completion"

    def __init__(
        self,
        ctx: ResponseContext,
        options: StreamOptionsView,
        *,
        echo_texts: Sequence[str] | None,
        want_logprobs: bool,
    ) -> None:
        super().__init__(ctx, options)
        self.echo_texts = echo_texts
        self.want_logprobs = want_logprobs
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._prompt_logprobs: dict[int, list[TokenLogprobs | None]] = {}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def delta(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        if output.prompt_logprobs is not None:
            self._prompt_logprobs[prompt_index] = output.prompt_logprobs
        chunks = []
        for seq in output.outputs:
            index = self.ctx.choice_index(prompt_index, seq.index)
            self.completion_tokens += len(seq.token_ids)
            text, logprobs = self._content(prompt_index, index, seq)
            if text or logprobs is not None:
                chunks.append(self._chunk(index, text, logprobs, None, None))
            if seq.finish_reason is not None:
                chunks.append(self._chunk(index, "", None, seq.finish_reason, seq.stop_reason))
        return chunks

    def _content(
        self, prompt_index: int, index: int, seq: CompletionOutput
    ) -> tuple[str, CompletionLogprobs | None]:
        first = index not in self._started
        self._started.add(index)
        echo = self.echo_texts[prompt_index] if first and self.echo_texts is not None else ""
        if not self.want_logprobs or (not seq.token_ids and not echo):
            return echo + seq.text, None
        logprobs = completion_logprobs([], [], self.ctx.token_text, 0)
        if echo:
            prompt_lps = self._prompt_logprobs.get(prompt_index)
            if prompt_lps is not None:
                ids = self.ctx.prompts[prompt_index].token_ids
                logprobs = completion_logprobs(prompt_lps, ids, self.ctx.token_text, 0)
        start = _offset_of(logprobs, self._offsets.get(index, 0))
        more = completion_logprobs(seq.logprobs or [], seq.token_ids, self.ctx.token_text, start)
        for key in logprobs:
            logprobs[key].extend(more[key])  # type: ignore[literal-required]
        self._offsets[index] = _offset_of(logprobs, start)
        return echo + seq.text, logprobs

    def _chunk(
        self,
        index: int,
        text: str,
        logprobs: CompletionLogprobs | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> dict[str, Any]:
        choice: CompletionChoice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        return self._with_usage(self._envelope([choice]))


class ChatChunks(_ChunkStream):
    """The SSE chunks of a streamed /v1/chat/completions response: a role chunk per choice,
    content chunks, then a chunk with an empty delta and the finish_reason."""

    object_name = "chat.completion.chunk"

    def __init__(
        self, ctx: ResponseContext, options: StreamOptionsView, *, want_logprobs: bool
    ) -> None:
        super().__init__(ctx, options)
        self.want_logprobs = want_logprobs

    def opening(self) -> list[dict[str, Any]]:
        return [
            self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
            for i in range(self.ctx.n)
        ]  # fmt: skip

    def delta(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        for seq in output.outputs:
            self.completion_tokens += len(seq.token_ids)
            logprobs = None
            if self.want_logprobs and seq.token_ids:
                logprobs = chat_logprobs(seq.logprobs or [], self.ctx.token_text)
            if seq.text or logprobs is not None:
                chunks.append(
                    self._chunk({"index": seq.index, "delta": {"content": seq.text},
                                 "logprobs": logprobs, "finish_reason": None})
                )  # fmt: skip
            if seq.finish_reason is not None:
                chunks.append(
                    self._chunk({"index": seq.index, "delta": {}, "logprobs": None,
                                 "finish_reason": seq.finish_reason,
                                 "stop_reason": seq.stop_reason})
                )  # fmt: skip
        return chunks

    def _chunk(self, choice: ChatChunkChoice) -> dict[str, Any]:
        return self._with_usage(self._envelope([choice]))


# --------------------------------------------------------------------------- OpenAPI


_JSON = "application/json"
_ERROR_CODES = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "503": "Engine not ready, shutting down, or queue full (with Retry-After)",
}
# Only where a body is read, or the engine generates.
_OPEN: dict[str, Any] = {"security": []}
_BODY_ERROR_CODES = {"413": "Body over the size limit"}
_GENERATION_ERROR_CODES = {"500": "The engine failed while generating"}


def openapi_document(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server, built from the schemas above."""
    components: dict[str, Any] = {}

    def ref(kind: Any, mode: Literal["validation", "serialization"]) -> dict[str, Any]:
        schema = TypeAdapter(kind).json_schema(
            mode=mode, ref_template="#/components/schemas/{model}"
        )
        components.update(schema.pop("$defs", {}))
        name = getattr(kind, "__name__", str(kind))
        components[name] = schema
        return {"$ref": f"#/components/schemas/{name}"}

    def body(kind: Any) -> dict[str, Any]:
        return {"required": True, "content": {_JSON: {"schema": ref(kind, "validation")}}}

    def events(chunk: Any) -> dict[str, Any]:
        """Each SSE event (OpenAPI 3.1: the schema describes one event): its data is a chunk,
        an in-band error, or the final [DONE]."""
        json_data = {
            "contentMediaType": _JSON,
            "contentSchema": {
                "anyOf": [ref(chunk, "serialization"), ref(ErrorResponse, "serialization")]
            },
        }
        data = {"type": "string", "if": {"const": "[DONE]"}, "else": json_data}
        return {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}

    def ok(kind: Any | None, media: str = _JSON, stream: Any = None) -> dict[str, Any]:
        """Responses of an operation; `stream` is the chunk type when it can stream."""
        responses: dict[str, Any] = {"200": {"description": "OK"}}
        if kind is not None:
            content = {media: {"schema": ref(kind, "serialization")}}
            if stream is not None:
                content["text/event-stream"] = events(stream)
            responses["200"]["content"] = content
        codes = dict(_ERROR_CODES)
        if stream is not None:
            codes.update(_GENERATION_ERROR_CODES)
        error = {_JSON: {"schema": ref(ErrorResponse, "serialization")}}
        for code, text in codes.items():
            responses[code] = {"description": text, "content": error}
        return responses

    def op(
        summary: str,
        responses: dict[str, Any],
        request: Any = None,
        parameters: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        operation: dict[str, Any] = {"summary": summary, "responses": responses}
        if request is not None:
            operation["requestBody"] = body(request)
            error = {_JSON: {"schema": ref(ErrorResponse, "serialization")}}
            for code, text in _BODY_ERROR_CODES.items():
                responses[code] = {"description": text, "content": error}
        if parameters:
            operation["parameters"] = parameters
        return operation

    text_plain = {"200": {"description": "OK", "content": {"text/plain": {"schema": {}}}}}
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    paths = {
        "/v1/models": {"get": op("List the served model", ok(ModelList))},
        "/v1/models/{model}": {
            "get": op("The served model, by its name", ok(ModelCard), parameters=[model_param])
        },
        "/v1/completions": {
            "post": op(
                "Text completion",
                ok(CompletionResponse, stream=CompletionChunk),
                CompletionRequest,
            )
        },
        "/v1/chat/completions": {
            "post": op(
                "Chat completion",
                ok(ChatCompletionResponse, stream=ChatCompletionChunk),
                ChatCompletionRequest,
            )
        },
        "/tokenize": {"post": op("Tokenize", ok(TokenizeResponse), TokenizeRequest)},
        "/detokenize": {"post": op("Detokenize", ok(DetokenizeResponse), DetokenizeRequest)},
        # Open to load balancers and scrapers: no API key needed.
        "/health": {"get": op("200 once the engine serves, 503 otherwise", ok(None)) | _OPEN},
        "/version": {"get": op("Server version", ok(VersionResponse)) | _OPEN},
        "/metrics": {"get": op("Prometheus metrics", text_plain) | _OPEN},
        "/openapi.json": {
            "get": op(
                "This document",
                {"200": {"description": "OK", "content": {_JSON: {"schema": {"type": "object"}}}}},
            )
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "aioinfer", "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
