"""Prompts to token ids: the completions prompt shapes and chat messages (through the model's
chat template), refusing what cannot be rendered with a 400.

Off the event loop, on OFF_LOOP's threads (a bounded queue: 503 when full) and under the
disconnect watcher (a client that leaves cancels the work while it waits for a thread): texts
past OFF_LOOP_CHARS are tokenized there, and chats whose body is
larger than that are rendered there, from the messages' conversion (tool calls' arguments
parsed) to the tokens. A chat whose body is small renders on the loop: what the template sees
is bounded by the body. Before rendering, what the template would see is measured and refused
past `template_char_limit`. A request's own chat template always renders off the loop, in a
child process under a budget (`engine.template_budget`), one at a time (REQUEST_TEMPLATES).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from aiohttp import web

from aioinfer.config import ServerConfig
from aioinfer.server.http.errors import BadRequestError
from aioinfer.server.http.state import STATE
from aioinfer.server.http.work_queue import OFF_LOOP, WorkQueue
from aioinfer.server.serving.context import Prompt

if TYPE_CHECKING:
    from aioinfer.server.serving.protocol import ChatMessage, ChatTemplateOptions

_T = TypeVar("_T")

# Texts longer than this are tokenized on a worker thread (tokenizers release the GIL): a
# prompt of megabytes takes seconds, which on the event loop would stall every other stream.
# Chats are rendered there when their body is larger than this.
OFF_LOOP_CHARS = 16_384
# What a chat template may see (message texts, tool calls' arguments, tools, documents,
# chat_template_kwargs) is refused past this many characters per token of the context, with
# a floor: no tokenizer writes a prompt of more characters per token, so a larger input could
# only be refused after it was rendered and tokenized (seconds of work per megabyte).
TEMPLATE_CHARS_PER_TOKEN = 64
MIN_TEMPLATE_CHARS = 1 << 20
# A request's own chat template (--trust-request-chat-template; its text is at most
# protocol.MAX_REQUEST_TEMPLATE_CHARS): the CPU time of one rendering.
REQUEST_TEMPLATE_CPU_SECONDS = 1.0


def template_char_limit(max_model_len: int) -> int:
    """The most characters a chat template may see, or a request's template write."""
    return max(MIN_TEMPLATE_CHARS, TEMPLATE_CHARS_PER_TOKEN * max_model_len)


async def off_loop(request: web.Request, fn: Callable[..., _T], *args: Any) -> _T:
    """fn(*args) on one of OFF_LOOP's threads, under the disconnect watcher: a client that
    leaves while it waits for a thread cancels it (ClientDisconnected); one that has started
    runs to its end. 503 while too many wait."""
    return await OFF_LOOP.run(request, fn, *args)


async def off_loop_if_long(
    request: web.Request, num_chars: int, fn: Callable[..., _T], *args: Any
) -> _T:
    """fn(*args) at once for short texts (or bodies), else `off_loop`."""
    if num_chars <= OFF_LOOP_CHARS:
        return fn(*args)
    return await off_loop(request, fn, *args)


REQUEST_TEMPLATES = WorkQueue("request chat templates", "template", threads=1, max_waiting=8)


def num_chars(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """Characters of text in a completions prompt (token ids count none)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


def count_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """How many prompts a (validated) completions prompt holds, without tokenizing it."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def encode_prompts(
    tokenizer: Any,
    prompt: str | list[str] | list[int] | list[list[int]],
    add_special_tokens: bool = True,
) -> list[Prompt]:
    """One Prompt per text or token-id list (the shapes were checked by the protocol)."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt[0], str):
        texts = prompt
    elif isinstance(prompt[0], int):
        return [Prompt(list(prompt))]
    else:
        return [Prompt(list(ids)) for ids in prompt]
    encoded = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [Prompt(list(ids), text) for ids, text in zip(encoded, texts, strict=True)]


@dataclass
class RenderedChat:
    """A chat through its template: the prompt's token ids, and the messages and options as
    the template saw them."""

    token_ids: list[int]
    messages: list[dict[str, Any]]
    options: dict[str, Any]


def template_input_chars(
    messages: Sequence[ChatMessage], options: dict[str, Any]
) -> dict[str, int]:
    """The characters a chat template can see, by field: messages (texts, names, reasoning,
    tool calls with their arguments as sent), tools, documents and chat_template_kwargs (as
    JSON). Cheap: the arguments are measured, not parsed."""
    in_messages = 0
    for message in messages:
        in_messages += len(message.text()) + len(message.name or "")
        in_messages += len(message.reasoning or "") + len(message.reasoning_content or "")
        in_messages += len(message.tool_call_id or "")
        for call in message.tool_calls or ():
            arguments = call.function.arguments
            size = len(arguments) if isinstance(arguments, str) else len(_json(arguments))
            in_messages += len(call.id or "") + len(call.function.name) + size
    return {
        "messages": in_messages,
        "tools": len(_json(options.get("tools"))),
        "documents": len(_json(options.get("documents"))),
        "chat_template_kwargs": len(_json(options.get("chat_template_kwargs"))),
    }


def _json(value: Any) -> bytes:
    return b"" if value is None else orjson.dumps(value, default=str)


def render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    source: ChatTemplateOptions,
    config: ServerConfig,
    max_model_len: int,
    cancelled: threading.Event | None = None,
) -> RenderedChat:
    """Prompt token ids of chat messages through the model's chat template, with the
    template's options from `source` (a request's), under which the server's
    chat_template_kwargs lie. A request's own chat template needs the server's trust and
    renders in a child process under a budget (stopped once `cancelled` is set). Everything
    else (measuring, parsing tool-call arguments, rendering, tokenizing) runs on the calling
    thread. 400 when the template would see more than `template_char_limit(max_model_len)`
    characters, before anything is rendered."""
    import jinja2

    from aioinfer.engine.tokenizer import apply_chat_template

    options = source.template_options()
    request_template = options.get("chat_template")
    _check_trust(request_template, config)
    defaults = config.chat_template_defaults
    if defaults:
        given = options.get("chat_template_kwargs") or {}
        options["chat_template_kwargs"] = {**defaults, **given}
    limit = template_char_limit(max_model_len)
    sizes = template_input_chars(messages, options)
    if sum(sizes.values()) > limit:
        field = max(sizes, key=sizes.__getitem__)
        shown = ", ".join(f"{name} {size}" for name, size in sizes.items() if size)
        raise BadRequestError(
            f"The chat template would see {sum(sizes.values())} characters ({shown}); at most "
            f"{limit} are allowed for this model's context of {max_model_len} tokens",
            param=field,
        )
    try:
        templated = [message.to_template() for message in messages]
        if request_template is None:
            ids = apply_chat_template(tokenizer, templated, **options)
        else:
            ids = _render_request_template(tokenizer, templated, options, limit, cancelled)
        return RenderedChat(ids, templated, options)
    # What a template can raise from Jinja's sandbox: its own errors, raise_exception, 1/0,
    # range(10**9), a macro calling itself; a request template's budget exceeded.
    except (
        ValueError,
        TypeError,
        KeyError,
        ArithmeticError,
        RecursionError,
        jinja2.TemplateError,
    ) as exc:
        param = "chat_template" if request_template is not None else "messages"
        raise BadRequestError(f"The chat template failed: {exc}", param=param) from None


def _check_trust(request_template: str | None, config: ServerConfig) -> None:
    if request_template is not None and not config.trust_request_chat_template:
        raise BadRequestError(
            "chat_template in a request is refused: the server was not started with "
            "--trust-request-chat-template",
            param="chat_template",
        )


def _render_request_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    options: dict[str, Any],
    max_chars: int,
    cancelled: threading.Event | None,
) -> list[int]:
    """Prompt token ids of `messages` through the request's own template, rendered by the
    budgeted child process with what `apply_chat_template` would hand the template."""
    from aioinfer.engine.template_budget import RENDERER
    from aioinfer.engine.tokenizer import encode_rendered_chat

    tools = options["tools"]
    text = RENDERER.render(
        options["chat_template"],
        messages,
        {
            "add_generation_prompt": options["add_generation_prompt"],
            "continue_final_message": options["continue_final_message"],
            "tools": list(tools) if tools else None,
            "documents": options["documents"],
        },
        {**tokenizer.special_tokens_map, **(options["chat_template_kwargs"] or {})},
        max_chars,
        REQUEST_TEMPLATE_CPU_SECONDS,
        cancelled,
    )
    return encode_rendered_chat(tokenizer, text)


async def render_chat_off_loop(
    request: web.Request,
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    source: ChatTemplateOptions,
    max_model_len: int,
    body_size: int,
) -> RenderedChat:
    """`render_chat` on a worker thread when the body (`body_size` bytes, with whatever it
    continues) is large, on REQUEST_TEMPLATES' thread when the request brought its own
    template, else at once."""
    config = request.app[STATE].config
    if source.chat_template is None:
        if body_size <= OFF_LOOP_CHARS:
            return render_chat(tokenizer, messages, source, config, max_model_len)
        return await off_loop(
            request, render_chat, tokenizer, messages, source, config, max_model_len
        )
    _check_trust(source.chat_template, config)
    cancelled = threading.Event()
    try:
        return await REQUEST_TEMPLATES.run(
            request, render_chat, tokenizer, messages, source, config, max_model_len, cancelled
        )
    finally:
        cancelled.set()  # a rendering still running is stopped (its child process killed)
