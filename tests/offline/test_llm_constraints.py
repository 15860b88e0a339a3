"""allowed_token_ids, bad_words, structured outputs and truncate_prompt_tokens through the whole
engine on a tiny random model, whose unconstrained output is anything but well formed."""

from __future__ import annotations

import json
import re

import pytest

from aioinfer import LLM, SamplingParams
from aioinfer.core.constraints import GrammarCompiler
from aioinfer.core.sampling_params import StructuredOutputsParams
from tests.offline.test_llm_features import random_prompts
from tests.support.tokenizers import make_tokenizer


def _sample(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def test_allowed_token_ids_limit_every_sampled_token(tiny):
    llm, _ = tiny
    allowed = [40, 41, 300, 301, 302]
    for params in (_sample(allowed_token_ids=allowed), _sample(allowed_token_ids=allowed, n=3)):
        for out in llm.generate(random_prompts(1, 4), params, use_tqdm=False):
            for seq in out.outputs:
                assert len(seq.token_ids) == 12
                assert set(seq.token_ids) <= set(allowed)


def test_allowed_token_ids_pick_the_best_allowed_token_greedily(tiny):
    llm, hf = tiny
    prompt = [5, 17, 99, 250, 31]
    allowed = [10, 20, 30, 40]
    params = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed, logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    assert out.token_ids == [allowed[int(logits[allowed].argmax())]]


def test_allowed_token_ids_outside_the_vocabulary_are_refused(tiny):
    llm, _ = tiny
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([[1, 2]], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_bad_words_never_appear_and_change_nothing_else(tiny):
    llm, _ = tiny
    prompts = random_prompts(2, 3)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    tokenizer = make_tokenizer()
    # Ban, by its text, the first token of the greedy output that is a word of its own.
    position, word = next(
        (i, tokenizer.decode([t]))
        for i, t in enumerate(plain[0])
        if [t] in _encodings(tokenizer, tokenizer.decode([t]))
    )
    banned_ids = {ids[0] for ids in _encodings(tokenizer, word) if len(ids) == 1}
    outs = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, greedy.clone(bad_words=[word]), use_tqdm=False)
    ]
    for ids in outs:
        assert not banned_ids & set(ids)
    assert outs[0][:position] == plain[0][:position]  # the same up to the banned token


def _encodings(tokenizer, word: str) -> list[list[int]]:
    return [
        tokenizer.encode(word.lstrip(), add_special_tokens=False),
        tokenizer.encode(" " + word.lstrip(), add_special_tokens=False),
    ]


def test_a_multi_token_bad_word_bans_only_its_last_token_after_the_rest(tiny):
    llm, _ = tiny
    prompt = random_prompts(3, 1)[0]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    tokenizer = make_tokenizer()
    # The first pair of output tokens that is also how its text tokenizes.
    start = next(
        i
        for i in range(1, len(plain) - 1)
        if tokenizer.encode(tokenizer.decode(plain[i : i + 2]).lstrip(), add_special_tokens=False)
        == plain[i : i + 2]
    )
    text = tokenizer.decode(plain[start : start + 2])
    out = llm.generate([prompt], greedy.clone(bad_words=[text]), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    assert ids[: start + 1] == plain[: start + 1]  # its first token is allowed
    assert ids[start + 1] != plain[start + 1]


def _json_params(n: int = 1, **spec: object) -> SamplingParams:
    return SamplingParams(
        n=n,
        temperature=1.0,
        seed=3,
        max_tokens=120,
        structured_outputs=StructuredOutputsParams(**spec),  # type: ignore[arg-type]
    )


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_validates(tiny):
    llm, _ = tiny
    outs = llm.generate(random_prompts(4, 4), _json_params(json=SCHEMA, n=2), use_tqdm=False)
    finished = [seq for o in outs for seq in o.outputs if seq.finish_reason == "stop"]
    assert finished, "no output completed its JSON within max_tokens"
    for seq in finished:
        # strict=False: xgrammar's rule for strings with a maxLength lets control characters
        # through unescaped (the random model picks them; vLLM shares the grammar).
        value = json.loads(seq.text, strict=False)
        assert set(value) == {"name", "age", "tags"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 8
        assert isinstance(value["age"], int)
        assert set(value["tags"]) <= {"a", "b"} and len(value["tags"]) <= 3


def test_choice_regex_and_grammar(tiny):
    llm, _ = tiny
    prompts = random_prompts(5, 3)
    choices = ["yes", "no", "maybe so"]
    for out in llm.generate(prompts, _json_params(choice=choices), use_tqdm=False):
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"
    for out in llm.generate(prompts, _json_params(regex=r"[0-9]{3}-[a-c]+"), use_tqdm=False):
        seq = out.outputs[0]
        assert re.fullmatch(r"[0-9]{3}-[a-c]+", seq.text) or seq.finish_reason == "length"
        assert re.match(r"[0-9]{3}-", seq.text)
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    for out in llm.generate(prompts, _json_params(grammar=grammar), use_tqdm=False):
        seq = out.outputs[0]
        if seq.finish_reason == "stop":
            assert re.fullmatch(r"\([1-9](\+[1-9])*\)", seq.text)


def test_json_object_with_min_tokens_and_greedy(tiny):
    llm, _ = tiny
    params = SamplingParams(
        temperature=0,
        max_tokens=100,
        min_tokens=50,
        structured_outputs=StructuredOutputsParams(json_object=True),
    )
    for out in llm.generate(random_prompts(6, 2), params, use_tqdm=False):
        seq = out.outputs[0]
        if seq.finish_reason == "stop":
            assert isinstance(json.loads(seq.text), dict)
        else:
            assert seq.text.startswith("{")


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"json": "{not json"}, "json"),
        ({"regex": "a("}, "regex"),
        ({"grammar": "root ::= "}, "grammar"),
    ],
)
def test_invalid_specs_are_refused_naming_the_field(tiny, spec, field):
    llm, _ = tiny
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert llm.engine.num_unfinished == 0


def test_structured_outputs_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_vllm_s_switches_are_taken_and_hold():
    """vLLM's switches for no free whitespace, no properties a schema does not name and no
    fallback ask for what holds here: accepted (booleans), and the compiled grammar obeys
    them; another whitespace pattern is refused."""
    import xgrammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    switches = dict.fromkeys(
        ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"), True
    )
    spec = StructuredOutputsParams(json=schema, **switches)
    tok = make_tokenizer()
    compiled = GrammarCompiler(tok, len(tok), [tok.eos_token_id]).compile(spec)
    for text, allowed in (('{"a": 1}', True), ('{"a": 1, "b": 2}', False), ('{ "a": 1}', False)):
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert (matcher.accept_string(text) and matcher.is_terminated()) is allowed, text
    for name in switches:
        with pytest.raises(ValueError, match=f"{name} must be a boolean"):
            StructuredOutputsParams(json_object=True, **{name: "yes"})
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams(json_object=True, whitespace_pattern=" ?")


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny):
    llm: LLM = tiny[0]
    prompt = random_prompts(7, 1)[0] + [5, 6, 7, 8]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tail = llm.generate([prompt[-4:]], greedy, use_tqdm=False)[0]
    cut = llm.generate([prompt], greedy.clone(truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-4:]
    text = llm.get_tokenizer().decode(prompt)  # a text prompt keeps its text, as in vLLM
    by_text = llm.generate(text, greedy.clone(truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert by_text.prompt == text and len(by_text.prompt_token_ids) == 4
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    long = list(range(3, 200))  # longer than the context of 128
    full = llm.generate([long], greedy.clone(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert full.prompt_token_ids == long[-(128 - 6) :]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([long], greedy.clone(truncate_prompt_tokens=129), use_tqdm=False)
