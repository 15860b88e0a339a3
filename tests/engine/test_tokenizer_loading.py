"""Tokenizers and chat templates as the loaders build them: each path renders ids exactly as
transformers does. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

from aioinfer.engine.tokenizer import (
    FALLBACK_CHAT_TEMPLATE,
    apply_chat_template,
    fallback_tokenizer,
    load_tokenizer,
    plain_tokenizer,
    token_bytes,
)
from aioinfer.model.loader import (
    resolve_model,
)
from tests.support.tiny_models import make_variant
from tests.support.tokenizers import (
    CHAT_TEMPLATE,
    MESSAGES,
    make_tokenizer,
    smollm2_reference_tokenizer,
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a test converts goes to its own cache, never the user's."""
    monkeypatch.setenv("AIOINFER_CACHE", str(tmp_path / "aioinfer-cache"))


def test_folder_tokenizer_and_chat_template(tmp_path: Path) -> None:
    make_variant("llama").save_pretrained(tmp_path)
    ref = make_tokenizer()
    ref.save_pretrained(tmp_path)

    tok = load_tokenizer(resolve_model(str(tmp_path)))
    assert tok.is_fast
    assert tok.encode("Hello 你好 😀") == ref.encode("Hello 你好 😀")
    expected = ref.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert apply_chat_template(tok, MESSAGES) == list(expected)
    without = ref.apply_chat_template(MESSAGES, add_generation_prompt=False)["input_ids"]
    assert apply_chat_template(tok, MESSAGES, add_generation_prompt=False) == list(without)


def test_chat_template_override_from_file_or_text(tmp_path: Path) -> None:
    make_variant("llama").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    resolved = resolve_model(str(tmp_path))

    for value in (template, str(tmp_path / "t.jinja")):
        tok = load_tokenizer(resolved, chat_template=value)
        assert tok.decode(apply_chat_template(tok, MESSAGES)) == "[Be brief.][Hello 👋, 你好?]"
    tok = load_tokenizer(resolved)
    for value in (template, str(tmp_path / "t.jinja")):
        once = apply_chat_template(tok, MESSAGES, chat_template=value)
        assert tok.decode(once) == "[Be brief.][Hello 👋, 你好?]"
    with pytest.raises(ValueError, match="chat_template"):
        load_tokenizer(resolved, chat_template=str(tmp_path / "missing.jinja"))


def test_missing_chat_template_is_an_error(tmp_path: Path) -> None:
    make_tokenizer().save_pretrained(tmp_path)
    plain = AutoTokenizer.from_pretrained(str(tmp_path))
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(plain, MESSAGES)


# A Llama-3-style template: BOS from the tokenizer, header tokens, a default system message that
# a given one replaces, <|eot_id|> after each turn.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = 'You are a helpful assistant.' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
LLAMA3_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATIONS = [
    MESSAGES,
    MESSAGES[1:],
    [*MESSAGES, {"role": "assistant", "content": " Hi! "}, {"role": "user", "content": "🚀?"}],
]
PROBE_TEXTS = ["Hello 你好 😀", "<|im_start|>user\nhi<|im_end|>", "  spaces\tand\nlines  ", ""]


def _llama3_style_tokenizer() -> PreTrainedTokenizerFast:
    backend = make_tokenizer().backend_tokenizer
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        extra_special_tokens=LLAMA3_SPECIAL,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def _save_v4_style(folder: Path) -> None:
    """A tokenizer_config.json the way transformers 4 wrote it: the class name
    PreTrainedTokenizerFast, added_tokens_decoder, additional_special_tokens and AddedToken
    dicts."""
    make_tokenizer().save_pretrained(folder, save_jinja_files=False)
    backend = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("extra_special_tokens", None)
    config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        additional_special_tokens=["<|im_start|>"],
        added_tokens_decoder={
            str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in backend["added_tokens"]
        },
        eos_token={"__type": "AddedToken", "content": "<|im_end|>", "special": True},
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(params=["chatml-jinja-file", "chatml-in-config", "v4-config", "llama3-style"])
def tokenizer_folder(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "chatml-jinja-file":
        make_tokenizer().save_pretrained(tmp_path)
    elif request.param == "chatml-in-config":
        make_tokenizer().save_pretrained(tmp_path, save_jinja_files=False)
    elif request.param == "v4-config":
        _save_v4_style(tmp_path)
    else:
        _llama3_style_tokenizer().save_pretrained(tmp_path)
    return tmp_path


def test_plain_tokenizer_equals_autotokenizer(tokenizer_folder: Path) -> None:
    ours = plain_tokenizer(tokenizer_folder)
    ref = AutoTokenizer.from_pretrained(str(tokenizer_folder))

    assert ours is not None and type(ours) is type(ref)
    assert ours.chat_template == ref.chat_template and ours.chat_template
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.all_special_ids == ref.all_special_ids
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert ours.get_added_vocab() == ref.get_added_vocab() and len(ours) == len(ref)
    for text in PROBE_TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            assert ours.decode(ids) == ref.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == ref.decode(
                ids, skip_special_tokens=True
            )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_templates_render_as_transformers(
    tokenizer_folder: Path, add_generation_prompt: bool
) -> None:
    make_variant("llama").config.save_pretrained(tokenizer_folder)
    tok = load_tokenizer(resolve_model(str(tokenizer_folder), load_format="dummy"))
    ref = AutoTokenizer.from_pretrained(str(tokenizer_folder))

    assert tok.chat_template in (CHAT_TEMPLATE, LLAMA3_TEMPLATE)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        got = apply_chat_template(tok, messages, add_generation_prompt=add_generation_prompt)
        assert got == list(expected["input_ids"])


def test_model_specific_tokenizer_classes_go_through_autotokenizer(tmp_path: Path) -> None:
    make_tokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"})
    )
    assert plain_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text("{}")
    assert plain_tokenizer(tmp_path) is None


def test_bundled_dummy_uses_the_byte_fallback_tokenizer() -> None:
    resolved = resolve_model("Qwen/Qwen2.5-1.5B-Instruct", load_format="dummy")
    tok = load_tokenizer(resolved)
    cfg = resolved.hf_config

    text = "héllo 你好 😀"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
    assert len(tok) == cfg.vocab_size
    assert tok.eos_token_id == cfg.eos_token_id and tok.bos_token_id == cfg.bos_token_id
    assert tok.decode([cfg.vocab_size - 1]) == f"<|tok_{cfg.vocab_size - 1}|>"
    assert tok.chat_template == FALLBACK_CHAT_TEMPLATE
    assert tok.decode(apply_chat_template(tok, MESSAGES[1:])) == (
        "user: Hello 👋, 你好?\nassistant: "
    )


def test_fallback_tokenizer_needs_room_for_bytes() -> None:
    cfg = AutoConfig.for_model("llama", vocab_size=200, eos_token_id=2)
    with pytest.raises(ValueError, match="vocab_size=200"):
        fallback_tokenizer(cfg)


@pytest.mark.parametrize("text", ["\U0001d11e clef", "naïve café 😀🎉", "中文字符", "\x00\xff"])
def test_token_bytes_join_back_into_the_text(text: str) -> None:
    """Each token's own bytes, joined in order, give the text's UTF-8, also where a token is
    one piece of a character (its decoded text only U+FFFD)."""
    tokenizers = [make_tokenizer(), smollm2_reference_tokenizer()]
    for tok in filter(None, tokenizers):
        ids = tok.encode(text, add_special_tokens=False)
        assert any("\ufffd" in tok.decode([i]) for i in ids)  # pieces of characters are there
        pieces = [token_bytes(tok, i, tok.decode([i])) for i in ids]
        assert b"".join(pieces) == text.encode()


def test_token_bytes_of_a_byte_fallback_token() -> None:
    """SentencePiece vocabularies (Llama 2, Mistral, Gemma) write a lone byte as <0xF0>."""

    class ByteFallback:
        def convert_ids_to_tokens(self, token_id: int) -> str:
            return {1: "<0xF0>", 2: "▁hello"}[token_id]

    tok = ByteFallback()
    assert token_bytes(tok, 1, "\ufffd") == b"\xf0"  # type: ignore[arg-type]
    assert token_bytes(tok, 2, " hello") == b" hello"  # type: ignore[arg-type]
