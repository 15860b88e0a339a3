"""The tokenizer of a resolved model, and chat templates.

Where the tokenizer comes from:

    --tokenizer given          that hub id or folder (a folder as below)
    a .gguf checkpoint         AutoTokenizer(folder, gguf_file=...): vocabulary, merges, special
                               tokens and chat template are all rebuilt from the GGUF metadata
                               (a GGUF from the converted-model cache is a folder, below)
    a folder with tokenizer    its tokenizer.json as it is, when tokenizer_config.json names the
    files (hub snapshot too)   plain fast class: built directly (`plain_tokenizer`); otherwise
                               AutoTokenizer(folder), which knows each model-specific class
    a bundled config           no tokenizer files exist, so `fallback_tokenizer` builds one: each
    (--load-format dummy)      UTF-8 byte is one token (ids 0-255), every other id up to the
                               model's vocab_size decodes to a placeholder "<|tok_N|>", the
                               config's BOS/EOS ids are special tokens, and a plain
                               "role: content" chat template is set. It exists so random-weight
                               runs (benchmarks, memory checks) work end to end; its text is
                               meaningless.

Only fast (Rust) tokenizers are returned, and chat templates are always rendered by transformers'
own `apply_chat_template`, so prompts match what transformers builds. This module imports no torch
itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Protocol

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# What chat_template_kwargs may not set lives with the settings (ServerConfig checks its defaults).
from aioinfer.config import check_template_kwargs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
_NUM_BYTES = 256
# tokenizer_config.json classes that mean "tokenizer.json as it is"; model-specific classes
# rebuild or patch the backend, so only AutoTokenizer loads them correctly.
PLAIN_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# Files whose legacy merge rules only AutoTokenizer applies.
_LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json", "additional_chat_templates")
# tokenizer_config.json entries that are loader bookkeeping, not tokenizer arguments; BOS/EOS
# flags are ignored next to a tokenizer.json (its post-processor decides), as transformers does.
_NOT_ARGUMENTS = (
    "tokenizer_class", "name_or_path", "is_local", "local_files_only", "add_bos_token",
    "add_eos_token",
)  # fmt: skip


class TokenizerSource(Protocol):
    """What `load_tokenizer` reads of a resolved model (`aioinfer.model.loader.ResolvedModel`)."""

    @property
    def folder(self) -> Path: ...
    @property
    def gguf_file(self) -> Path | None: ...
    @property
    def converted_from(self) -> Path | None: ...
    @property
    def hf_config(self) -> Any: ...


def load_tokenizer(
    resolved: TokenizerSource, chat_template: str | None = None, tokenizer: str | None = None
) -> PreTrainedTokenizerBase:
    """The fast tokenizer for `resolved` (see the module doc for where it comes from).

    `chat_template` (Jinja text or a path to a file holding it) replaces the model's template;
    `tokenizer` (hub id or folder) replaces the model's tokenizer.
    """
    if tokenizer:
        path = Path(tokenizer).expanduser()
        if path.is_dir():
            tok = _folder_tokenizer(path)
        elif path.is_file() and path.suffix == ".gguf":  # vLLM scripts name the model's here
            tok = _gguf_tokenizer(path)
        else:
            tok = AutoTokenizer.from_pretrained(tokenizer)
    elif resolved.gguf_file is not None:
        tok = _gguf_tokenizer(Path(resolved.gguf_file))
    elif any((Path(resolved.folder) / name).is_file() for name in TOKENIZER_FILES):
        tok = _folder_tokenizer(Path(resolved.folder))
    elif resolved.converted_from is not None:  # a GGUF cache entry written without one
        tok = _gguf_tokenizer(Path(resolved.converted_from))
    else:
        tok = fallback_tokenizer(resolved.hf_config)
    if not tok.is_fast:
        raise ValueError(f"tokenizer {type(tok).__name__} is not a fast (Rust) tokenizer")
    template = read_chat_template(chat_template)
    if template is not None:
        tok.chat_template = template
    return tok


def plain_tokenizer(folder: Path) -> PreTrainedTokenizerFast | None:
    """The folder's tokenizer.json with the special tokens and chat template of its
    tokenizer_config.json, built directly: what AutoTokenizer builds for a plain fast class, in
    less time (no class lookup, no search for a dozen optional files).

    None when the folder needs AutoTokenizer: a model-specific class, remote code, legacy
    special-token files, several chat templates.
    """
    tokenizer_file = folder / "tokenizer.json"
    config_file = folder / "tokenizer_config.json"
    if not (tokenizer_file.is_file() and config_file.is_file()):
        return None
    with config_file.open(encoding="utf-8") as f:
        config = json.load(f)
    if (
        not isinstance(config, dict)
        or config.get("tokenizer_class") not in PLAIN_TOKENIZER_CLASSES
        or config.get("auto_map")
        or config.get("init_inputs")
        or any((folder / name).exists() for name in _LEGACY_FILES)
    ):
        return None
    kwargs = {k: v for k, v in config.items() if k not in (*_NOT_ARGUMENTS, "init_inputs")}
    template = folder / "chat_template.jinja"
    if template.is_file():
        kwargs["chat_template"] = template.read_text(encoding="utf-8")
    _special_token_arguments(kwargs)
    return PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file),
        name_or_path=str(folder),
        is_local=True,
        local_files_only=False,
        **kwargs,
    )


def _special_token_arguments(kwargs: dict[str, Any]) -> None:
    """Rewrite tokenizer_config.json's special-token entries in place the way transformers'
    `from_pretrained` hands them to the class."""
    if "additional_special_tokens" in kwargs and not kwargs.get("extra_special_tokens"):
        kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
    named = set(PreTrainedTokenizerFast.SPECIAL_TOKENS_ATTRIBUTES)
    specific = {
        key: kwargs.pop(key)
        for key in list(kwargs)
        if key not in named and key.endswith("_token") and isinstance(kwargs[key], str)
    }
    if isinstance(kwargs.get("extra_special_tokens"), dict):
        specific.update(kwargs.pop("extra_special_tokens"))
    if specific:
        kwargs["model_specific_special_tokens"] = specific
    decoder = {
        int(index): AddedToken(**token) if isinstance(token, dict) else token
        for index, token in (kwargs.pop("added_tokens_decoder", None) or {}).items()
    }
    kwargs["added_tokens_decoder"] = decoder
    kwargs.update(PreTrainedTokenizerFast.convert_added_tokens(kwargs, save=False))
    by_text = {str(token): token for token in decoder.values()}
    for key in named:
        if kwargs.get(key) is not None and str(kwargs[key]) in by_text:
            kwargs[key] = by_text[str(kwargs[key])]


def _folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    return plain_tokenizer(folder) or AutoTokenizer.from_pretrained(str(folder))


def _byte_of_char() -> dict[str, int]:
    """The byte each character of a byte-level BPE's vocabulary stands for (GPT-2's alphabet:
    printable Latin-1 bytes are themselves, the other 68 bytes the characters from U+0100 up)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return table


_BYTE_OF_CHAR = _byte_of_char()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's tokens of one byte


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int, text: str) -> bytes:
    """The bytes of one token whose decoded text is `text`. A token that holds part of a
    multi-byte character decodes to U+FFFD; its own bytes come from its vocabulary entry
    (a byte-fallback `<0xF0>`, or a byte-level BPE's characters), as OpenAI's logprobs give
    them so that a client can join a character's pieces."""
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and (match := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(match.group(1), 16)])
        if isinstance(piece, str) and piece and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
    return text.encode("utf-8", errors="replace")


def tokenizer_eos(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's EOS id, where it names one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset([eos]) if isinstance(eos, int) else frozenset()


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def read_chat_template(value: str | None) -> str | None:
    """A chat template given as Jinja text or as a path to a file with it."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{" not in value:
        if not path.is_file():
            raise ValueError(f"chat_template is neither Jinja text nor a file: {value!r}")
        return path.read_text(encoding="utf-8")
    return value


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **options: Any
) -> list[int]:
    """`chat_prompt_text(tokenizer, messages, **options)`, tokenized."""
    return encode_rendered_chat(tokenizer, chat_prompt_text(tokenizer, messages, **options))


def encode_pairs(
    tokenizer: PreTrainedTokenizerBase,
    firsts: list[str],
    seconds: list[str],
    truncate_prompt_tokens: int | None,
    max_model_len: int,
) -> list[list[int]]:
    """Each (first, second) pair as one prompt, the way the tokenizer joins a text pair (its
    special tokens included): what a cross-encoder reads, as transformers and vLLM feed it.
    `truncate_prompt_tokens` (-1: the context; checked by the caller) cuts the longer text
    first, so that both keep a part (not the pair's tail)."""
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    cut = {"truncation": True, "max_length": keep} if keep is not None else {}
    encoded = tokenizer(firsts, seconds, **cut)["input_ids"]
    return [list(ids) for ids in encoded]


def encode_rendered_chat(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The template writes its own special tokens (BOS included), so none are added on top.
    return list(tokenizer.encode(text, add_special_tokens=False))


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as the server hands it to the chat template: content None (an
    assistant turn that only called tools) as "", a list of text parts joined, and each tool
    call's arguments as the object that templates write with `tojson`."""
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ValueError(f"only text content parts are supported, got {part!r:.80}")
            texts.append(str(part.get("text", "")))
        content = "\n".join(texts)
    templated = {**message, "content": content}
    if message.get("tool_calls"):
        templated["tool_calls"] = [_template_tool_call(call) for call in message["tool_calls"]]
    return templated


def _template_tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = template_arguments(function.get("arguments"))
    return {**call, "function": {**function, "arguments": arguments}}


def template_arguments(arguments: Any) -> Any:
    """A tool call's arguments for the template: the object parsed from OpenAI's JSON text
    (text that is not JSON stays text), {} for none."""
    if not arguments:
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # a model can write a thousand "["
        return arguments


def chat_prompt_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
) -> str:
    """The prompt text of `messages` through the chat template.

    `chat_template` (Jinja text or a path) overrides the tokenizer's own for this call. With
    `continue_final_message` the last message is left open, for the model to go on with it.
    `chat_template_kwargs` become variables of the template (e.g. enable_thinking). `tools`
    (OpenAI function tools) and `documents` (for retrieval) are the template's to show; one
    without support for them ignores them.
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    check_template_kwargs(chat_template_kwargs)
    template = read_chat_template(chat_template)
    if template is None and not tokenizer.chat_template:
        raise ValueError("the model's tokenizer has no chat template; pass one (--chat-template)")
    text = tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template=template,
        tools=list(tools) if tools else None,  # type: ignore[arg-type]
        documents=documents,
        **(chat_template_kwargs or {}),
    )
    return str(text)


def fallback_tokenizer(hf_config: Any) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer covering every id of the model (see the module doc)."""
    vocab_size = int(hf_config.vocab_size)
    bos_id = _first_id(getattr(hf_config, "bos_token_id", None))
    eos_id = _first_id(getattr(hf_config, "eos_token_id", None))
    special = {i for i in (bos_id, eos_id) if i is not None}
    if vocab_size <= _NUM_BYTES or any(i < _NUM_BYTES or i >= vocab_size for i in special):
        raise ValueError(
            f"cannot build a byte-level fallback tokenizer for vocab_size={vocab_size} with "
            f"bos_token_id={bos_id}, eos_token_id={eos_id}; add tokenizer files to the model"
        )
    byte_chars = _bytes_to_unicode()
    names: dict[int, str] = {}
    if bos_id is not None:
        names[bos_id] = "<|bos|>"
    if eos_id is not None:
        names[eos_id] = "<|eos|>"  # wins when BOS and EOS share an id
    vocab = {byte_chars[b]: b for b in range(_NUM_BYTES)}
    vocab.update({names.get(i, f"<|tok_{i}|>"): i for i in range(_NUM_BYTES, vocab_size)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([names[i] for i in sorted(names)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=names.get(bos_id) if bos_id is not None else None,
        eos_token=names.get(eos_id) if eos_id is not None else None,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    return tok


def _first_id(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(_NUM_BYTES):
        if b not in table:
            table[b] = chr(_NUM_BYTES + extra)
            extra += 1
    return table
