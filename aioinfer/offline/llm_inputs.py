"""The offline LLM's inputs checked before any request is queued: prompts (texts, token ids,
prompt dicts) and chat conversations, each refused with the argument's name."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from aioinfer.core.request import MAX_CACHE_SALT_CHARS

_P = TypeVar("_P")


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt as it is queued: its text (None where it came as token ids), its token ids,
    and its cache salt (vLLM's: cached prefixes are shared only among prompts of one salt)."""

    text: str | None
    ids: list[int]
    cache_salt: str | None = None


@dataclass
class GenerateBatch:
    """Prompts to generate from, each with its params, priority, LoRA adapter and, where they
    were enqueued, the request id given out for it."""

    prompts: list[EncodedPrompt]
    params: list[Any]  # SamplingParams
    priorities: list[int]
    loras: list[Any]  # LoRARequest | None
    request_ids: list[str | None]

    def extend(self, other: GenerateBatch) -> None:
        self.prompts += other.prompts
        self.params += other.params
        self.priorities += other.priorities
        self.loras += other.loras
        self.request_ids += other.request_ids


def normalise_prompts(prompts: Any) -> list[Any]:
    """One prompt (text, token ids or a prompt dict) or several, as a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        # bytes would read as token ids, one per byte
        raise TypeError(
            "prompts must be a text, a list of token ids, a prompt dict, or a list of these; "
            f"got {type(prompts).__name__}"
        )
    batch = list(prompts)  # once: a generator would lose what the check below reads
    if batch and all(isinstance(t, int) for t in batch):
        return [batch]  # one prompt of token ids
    return batch


def token_ids(value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError(
            f"a prompt is a text, a list of int token ids or a dict with 'prompt' or "
            f"'prompt_token_ids'; got {value!r:.80}"
        )
    return list(value)


def cache_salt(prompt: dict[str, Any]) -> str | None:
    """A prompt dict's `cache_salt`, checked as the server checks it."""
    salt = prompt.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 1 <= len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ValueError(
            f"cache_salt must be a text of 1 to {MAX_CACHE_SALT_CHARS} characters, got {salt!r:.80}"
        )
    return None if salt is None else utf8_text(salt, "cache_salt")  # it is hashed as UTF-8


def utf8_text(text: str, name: str) -> str:
    """`text`, which the tokenizer can encode: a lone surrogate (from a bad \\ud800 escape)
    cannot be."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        reason = f"{error.reason} at {error.start}"
        raise ValueError(f"{name} is not valid Unicode text: {reason}") from None
    return text


def conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """One conversation (a list of message dicts) or several, as a list of conversations; each
    message a dict with a string role and content that is text, a list of parts or None."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a list of message dicts, or a list of such lists; got "
            f"{type(messages).__name__}"
        )
    batch = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(batch):
        if isinstance(conversation, (str, bytes, dict)) or not isinstance(conversation, Sequence):
            raise TypeError(
                f"messages[{i}] must be a list of message dicts, got {conversation!r:.80}"
            )
        for message in conversation:
            if not isinstance(message, dict):
                raise TypeError(f"a message must be a dict, got {message!r:.80}")
            if not isinstance(message.get("role"), str):
                raise ValueError(f"a message needs a string 'role', got {message!r:.80}")
            content = message.get("content")
            if not (content is None or isinstance(content, (str, list))):
                raise TypeError(
                    "a message's content must be a text, a list of parts or None, got "
                    f"{content!r:.80}"
                )
    return cast(list[list[dict[str, Any]]], batch)


def per_prompt(
    value: _P | Sequence[_P], count: int, name: str, kind: type, optional: bool = False
) -> list[_P]:
    """One params object (a `kind`, or None where optional) for every prompt, or a list of one
    per prompt."""
    if isinstance(value, Sequence) and not isinstance(value, str):  # a name is one value
        values = list(value)
    else:
        values = [cast(_P, value)] * count
    if len(values) != count:
        raise ValueError(f"{name} must be one or one per prompt ({count}), got {len(values)}")
    for item in values:
        if not (isinstance(item, kind) or (optional and item is None)):
            raise TypeError(f"{name} must be {kind.__name__} or a list of them, got {item!r:.80}")
    return values


def chat_prompts(
    engine: Any,
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[Any] | None = None,
    chat_template_content_format: str = "auto",
    mm_processor_kwargs: dict[str, Any] | None = None,
) -> list[EncodedPrompt]:
    """One conversation or several, rendered with the chat template (the model's, or
    `chat_template`) of `engine` (an AsyncEngine) and tokenized, as LLM.chat runs them."""
    from aioinfer.engine.tokenizer import chat_prompt_text, encode_rendered_chat, template_message

    if chat_template_content_format not in ("auto", "string", "openai"):
        raise ValueError(
            "chat_template_content_format must be 'auto', 'string' or 'openai', got "
            f"{chat_template_content_format!r}"
        )
    if mm_processor_kwargs:
        raise ValueError("mm_processor_kwargs: the models served here take text only")
    encoded: list[EncodedPrompt] = []
    for conversation in conversations(messages):
        text = chat_prompt_text(
            engine.tokenizer,
            [template_message(m) for m in conversation],
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template or engine.model_config.chat_template,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        text = utf8_text(text, "messages")
        encoded.append(EncodedPrompt(text, encode_rendered_chat(engine.tokenizer, text)))
    return encoded
