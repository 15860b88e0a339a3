"""Scripts written for vLLM's offline API run unchanged but for the import: its option names,
its logprobs shape ({token_id: Logprob} per position), chat arguments, max_tokens that run
into the context's end, and clear errors for what it would refuse too."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client.core import CounterMetricFamily

from aioinfer import (
    LLM,
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
)
from aioinfer.core.step import Logprob
from aioinfer.engine.tokenizer import template_message
from aioinfer.offline.metrics_reader import Counter, Gauge, Histogram, Metric, Vector, read_metrics
from aioinfer.sampling_params import RequestOutputKind
from aioinfer.server.serving.protocol import ChatCompletionRequest
from tests.support.tokenizers import make_tokenizer


def test_logprobs_are_dicts_of_token_id_to_logprob(tiny):
    llm, _ = tiny
    prompt = [5, 17, 99, 250, 31]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    seq = out.outputs[0]
    for token_id, position in zip(seq.token_ids, seq.logprobs, strict=True):
        chosen = position[token_id]
        assert isinstance(chosen, Logprob)
        assert chosen.logprob == position.logprob and chosen.rank == position.rank
        assert chosen.decoded_token == tok.decode([token_id])
        assert next(iter(position)) == token_id  # the chosen token first, as in vLLM
        assert len(position) in (3, 4)  # the top 3, and the chosen one where it is not among them
        ranked = sorted((entry.rank, entry.logprob) for entry in position.values())
        top = [logprob for rank, logprob in ranked if rank <= 3]
        assert top == sorted(top, reverse=True)
        assert dict(position.items()).keys() == set(position)
        as_dict = {t: position[t] for t in position}  # vLLM's own type compares and prints so
        assert position == as_dict and as_dict == position and repr(position) == repr(as_dict)
    assert out.prompt_logprobs[0] is None
    for token_id, position in zip(prompt[1:], out.prompt_logprobs[1:], strict=True):
        assert position[token_id].decoded_token == tok.decode([token_id])
        with pytest.raises(KeyError):
            position[-1]
    assert seq.finished() is True


def test_prompt_and_max_tokens_past_the_context_stop_at_its_end(tiny):
    llm, _ = tiny  # context 128
    prompt = list(range(5, 105))  # 100 tokens
    out = llm.generate([prompt], SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    seq = out[0].outputs[0]
    assert seq.finish_reason == "length" and len(seq.token_ids) == 28
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([list(range(5, 133))], SamplingParams(max_tokens=1), use_tqdm=False)


def test_stop_set_after_construction_counts(tiny):
    llm, _ = tiny
    prompt = [7, 8, 9, 10]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    free = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip()
    params.stop = [stop]
    cut = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == free[: free.index(stop)]


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", 1.5), ("top_k", 2.5), ("logprobs", -5), ("prompt_logprobs", -5),
     ("temperature", "1"), ("max_tokens", 0), ("allowed_token_ids", [-1]), ("min_p", 2.0)],
)  # fmt: skip
def test_fields_set_after_construction_are_checked_before_the_request_queues(tiny, field, value):
    """Fields set after construction (as vLLM scripts do) are checked again when a request is
    added: each of these once reached the step, where the sampler's error killed the engine
    for good, or gave wrong output (max_tokens 0 made one token, -1 an allowed token wrap)."""
    llm, _ = tiny
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks and not llm.engine.scheduler.requests


def test_chat_text_parts_template_kwargs_and_the_rendered_prompt(tiny):
    llm, _ = tiny
    parts = [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "world"}]
    params = SamplingParams(max_tokens=2)
    out = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)[0]
    assert out.prompt == "<|im_start|>user\nHello,\nworld<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt)
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat(
        [{"role": "user", "content": "there"}],
        params,
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"greeting": "Hi "},
    )[0]
    assert out.prompt == "Hi there"
    tool = {"type": "function", "function": {"name": "get_time"}}
    out = llm.chat(
        [{"role": "user", "content": "Time?"}],
        params,
        use_tqdm=False,
        chat_template="{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{{ messages[0].content }}",
        tools=[tool],
    )[0]
    assert out.prompt == "[get_time]Time?"
    with pytest.raises(ValueError, match="text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], params)


def test_chat_renders_a_tool_call_history_as_the_server_does(tiny):
    """An assistant turn that only called a tool (content None, the arguments OpenAI's JSON
    text) reaches the template as the server hands it over: content "", the arguments the
    object that templates write with `tojson`."""
    llm, _ = tiny
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %};{% endfor %}"
    )
    params = SamplingParams(max_tokens=1)
    out = llm.chat(
        messages, params, use_tqdm=False, chat_template=template, add_generation_prompt=False
    )[0]
    assert out.prompt == 'user:Weather?;assistant:get_weather{"city": "Paris"};tool:sunny;'
    served = ChatCompletionRequest.model_validate({"messages": messages})
    assert [m.to_template() for m in served.messages] == [template_message(m) for m in messages]


def test_params_of_another_type_and_images_are_refused_by_name(tiny):
    llm, _ = tiny
    for params in ({"max_tokens": 2}, [None]):
        with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
            llm.generate([[5, 6]], params, use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lora_request must be LoRARequest"):
        llm.generate([[5, 6]], use_tqdm=False, lora_request={"lora_name": "x"})  # type: ignore[arg-type]
    image = {"prompt": "Describe:", "multi_modal_data": {"image": object()}}
    with pytest.raises(ValueError, match="multi_modal_data: the models served here take text"):
        llm.generate(image, use_tqdm=False)  # type: ignore[arg-type]
    assert llm.engine.num_unfinished == 0 and llm.engine.scheduler.kv.usage == 0.0


@pytest.mark.parametrize(
    "prompt", [[None], ["a", 5], [1.0, 2.0], {"text": "x"}, [[1, True]]], ids=repr
)
def test_bad_prompts_are_refused_by_name_and_leave_nothing_behind(tiny, prompt):
    llm, _ = tiny
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.num_unfinished == 0 and llm.engine.scheduler.kv.usage == 0.0


def test_vllm_options_and_a_running_event_loop(tiny, tmp_path):
    """vLLM's options at values that change nothing here are accepted; others are refused
    with the reason. The LLM is built, used and shut down from inside a running event loop
    (a notebook's, an async program's), where a second loop cannot run on the same thread."""
    llm, _ = tiny
    path = llm.engine.model_config.model
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        LLM(path, tensor_parallel_size=2)
    with pytest.raises(
        ValueError, match=r"quantization must be None \(quantized checkpoints are refused"
    ):
        LLM(path, quantization="awq")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(path, kv_cache_dtype="fp8")
    tokenizer_dir = tmp_path / "tokenizer"
    make_tokenizer().save_pretrained(tokenizer_dir)
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (tokenizer_dir / "chat_template.jinja").write_text(template)
    prompt = [5, 6, 7]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids

    async def in_a_running_loop() -> tuple[LLM, list[int], str]:
        other = LLM(
            path,
            dtype=torch.float32,
            seed=None,
            tokenizer=str(tokenizer_dir),
            trust_remote_code=True,
            tensor_parallel_size=1,
            disable_log_stats=True,
            enable_chunked_prefill=True,
            kv_cache_dtype="auto",
            download_dir=None,
            hf_overrides={},
            kv_cache_memory=0.01,
            max_model_len=64,
        )
        try:
            out = other.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
            chat = other.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False)
        finally:
            other.shutdown()
        return other, out, chat[0].prompt

    other, tokens, chat_prompt = asyncio.run(in_a_running_loop())
    assert other.engine.model_config.dtype == "float32" and other.engine.model_config.seed is None
    assert tokens == expected
    assert chat_prompt == "<<hi>>"  # the tokenizer option's chat template
    with pytest.raises(RuntimeError, match="shut down"):
        other.generate([[5, 6]], use_tqdm=False)


def test_prompts_from_a_generator_and_vllm_names(tiny):
    llm, _ = tiny
    prompts = [[5, 6], [7, 8, 9], {"prompt_token_ids": [10, 11]}]
    outs = llm.generate((p for p in prompts), SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[5, 6], [7, 8, 9], [10, 11]]
    assert isinstance(outs[0], RequestOutput) and isinstance(outs[0].outputs[0], CompletionOutput)
    assert (outs[0].encoder_prompt, outs[0].kv_transfer_params) == (None, None)
    assert outs[0].multi_modal_placeholders == {} and outs[0].encoder_prompt_token_ids is None
    typed = [TokensPrompt(prompt_token_ids=[5, 6]), TextPrompt(prompt="hello")]
    outs = llm.generate(typed, SamplingParams(max_tokens=2), use_tqdm=False)
    assert outs[1].prompt == "hello" and outs[1].prompt_token_ids == llm.get_tokenizer().encode(
        "hello"
    )
    params = SamplingParams(stop="x", extra_args={"mine": 1})
    assert params.stop == ["x"] and SamplingParams().stop == []
    params.stop.append("y")  # as vLLM scripts do
    assert params.stop_strings == ["x", "y"]
    message = [{"role": "user", "content": "hi"}]
    plain = llm.chat(message, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt
    as_string = llm.chat(
        message, SamplingParams(max_tokens=1), use_tqdm=False, chat_template_content_format="string"
    )[0].prompt
    assert as_string == plain
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(message, chat_template_content_format="images")
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.chat(message, mm_processor_kwargs={"num_crops": 4})


def test_tokenization_kwargs_reach_the_tokenizer(tiny):
    """vLLM's generate(..., tokenization_kwargs=...): for text prompts, plain or in a dict."""
    llm, _ = tiny
    text = "The quick brown fox jumps over the lazy dog."
    full = llm.get_tokenizer().encode(text)
    cut = {"truncation": True, "max_length": 3}
    outs = llm.generate(
        [text, {"prompt": text}, full], SamplingParams(max_tokens=1), False, tokenization_kwargs=cut
    )
    assert [o.prompt_token_ids for o in outs] == [full[:3], full[:3], full]
    with pytest.raises(TypeError, match="tokenization_kwargs must be a dict"):
        llm.generate(text, tokenization_kwargs=["add_special_tokens"])  # type: ignore[arg-type]


def test_detokenize_false_gives_the_same_tokens_and_no_text(tiny):
    llm, _ = tiny
    prompt = [9, 8, 7, 6]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate([prompt], params.clone(detokenize=False), use_tqdm=False)[0]
    assert ids_only.outputs[0].token_ids == with_text.token_ids and with_text.text
    assert ids_only.outputs[0].text == "" and ids_only.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_reset_prefix_cache_makes_the_next_batch_compute_its_prompts_again(tiny):
    llm, _ = tiny
    prompt = list(range(40, 90))  # 50 tokens: whole blocks of them can be cached
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert llm.reset_prefix_cache(device=None) is True
    fresh = llm.generate([prompt], params, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert fresh.outputs[0].token_ids == again.outputs[0].token_ids == first.outputs[0].token_ids
    # vLLM's skip_reading_prefix_cache: the prompt is cached now, yet computed again.
    skipping = params.clone(skip_reading_prefix_cache=True)
    recomputed = llm.generate([prompt], skipping, use_tqdm=False)[0]
    assert recomputed.num_cached_tokens == 0
    assert recomputed.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens > 0


def test_vllm_s_module_paths():
    """vLLM scripts import from its submodules too: the same paths exist here."""
    import aioinfer
    from aioinfer.core.step import TokenLogprobs
    from aioinfer.inputs import TextPrompt, TokensPrompt
    from aioinfer.logprobs import Logprob as LogprobAgain
    from aioinfer.outputs import CompletionOutput, RequestOutput
    from aioinfer.pooling_params import PoolingParams
    from aioinfer.sampling_params import SamplingParams, SamplingType, StructuredOutputsParams

    assert (SamplingParams, StructuredOutputsParams) == (
        aioinfer.SamplingParams,
        aioinfer.StructuredOutputsParams,
    )
    assert (TextPrompt, TokensPrompt, PoolingParams) == (
        aioinfer.TextPrompt,
        aioinfer.TokensPrompt,
        aioinfer.PoolingParams,
    )
    assert (RequestOutput, CompletionOutput) == (aioinfer.RequestOutput, aioinfer.CompletionOutput)
    assert LogprobAgain is Logprob and TokenLogprobs(1, -0.1, 1)[1] == Logprob(-0.1, 1)
    from aioinfer.lora.request import LoRARequest

    assert LoRARequest is aioinfer.LoRARequest
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY


def test_vllm_0_10_s_guided_decoding_constrains_the_output(tiny):
    """vLLM 0.10's names for structured outputs: GuidedDecodingParams, and guided_decoding
    given to SamplingParams or set on it afterwards, as outlines does."""
    from aioinfer.sampling_params import GuidedDecodingParams

    llm, _ = tiny
    choices = ["yes", "no", "maybe"]
    given = SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(choice=choices))
    later = SamplingParams(max_tokens=8, seed=5)
    later.guided_decoding = GuidedDecodingParams(choice=choices)
    for params in (given, later):
        outs = llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)
        assert all(o.outputs[0].text in choices for o in outs)
    assert given.structured_outputs == GuidedDecodingParams(choice=choices)
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(
            guided_decoding=GuidedDecodingParams(regex="a"),
            structured_outputs=GuidedDecodingParams(regex="b"),
        )


@torch.no_grad()
def test_beam_search_matches_the_search_over_transformers_logits(tiny):
    """LLM.beam_search against the same search (2 x beam_width candidates a beam, score
    cum_logprob / length ** length_penalty) run on transformers' float32 logits."""
    from aioinfer import BeamSearchParams

    llm, hf = tiny
    width, steps, penalty = 3, 6, 0.7
    eos = llm.engine.eos_token_ids

    def eos_among_candidates(prompt: list[int]) -> bool:
        logits = hf(torch.tensor([prompt])).logits[0, -1]
        return bool(set(torch.topk(logits, 2 * width).indices.tolist()) & eos)

    # A prompt whose first step already offers an end-of-sequence token, so that finished
    # beams compete with live ones under the length penalty.
    ends = next([k, k + 1] for k in range(3, 500) if eos_among_candidates([k, k + 1]))
    prompts = [[5, 17, 99, 250], [31, 7, 400], ends]
    params = BeamSearchParams(beam_width=width, max_tokens=steps, length_penalty=penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)

    def score(beam: tuple[list[int], float]) -> float:
        length = len(beam[0]) - (beam[0][-1] in eos)
        return beam[1] / length**penalty

    finished_early = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        beams, completed = [(prompt, 0.0)], []
        for _ in range(steps):
            grown = []
            for tokens, cum in beams:
                logprobs = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), -1)
                top = torch.topk(logprobs, 2 * width)
                for lp, t in zip(top.values, top.indices, strict=True):
                    beam = ([*tokens, int(t)], cum + float(lp))
                    (completed if int(t) in eos else grown).append(beam)
            beams = sorted(grown, key=score, reverse=True)[:width]
        best = sorted(completed + beams, key=score, reverse=True)[:width]
        got = output.sequences
        assert [s.tokens for s in got] == [tokens for tokens, _ in best]
        for seq, (_, cum) in zip(got, best, strict=True):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
            assert seq.text == llm.get_tokenizer().decode(seq.tokens)
            finished_early += seq.finish_reason == "stop"
            assert seq.finish_reason == ("stop" if seq.tokens[-1] in eos else "length")
    assert finished_early  # the search met end-of-sequence tokens (this tiny model's)
    with pytest.raises(ValueError, match=r"beam_width must be <= 10 .*got 11"):
        llm.beam_search([prompts[0]], BeamSearchParams(beam_width=11, max_tokens=2))


def test_get_metrics_counts_a_batch_as_vllm_s_reader_shapes_it(tiny):
    llm, _ = tiny

    def by_name() -> dict[str, Metric]:
        return {m.name: m for m in llm.get_metrics() if "reason" not in "".join(m.labels)}

    before = by_name()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    after = by_name()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == 8
    prefilled = 8 - sum(o.num_cached_tokens for o in outs)
    for name, grew_by in (("aioinfer:generation_tokens", generated),
                          ("aioinfer:prompt_tokens", prefilled)):  # fmt: skip
        assert isinstance(after[name], Counter)
        assert after[name].value - before[name].value == grew_by  # type: ignore[attr-defined]
    lengths, earlier = (
        after["aioinfer:request_generation_tokens"],
        before["aioinfer:request_generation_tokens"],
    )
    assert isinstance(lengths, Histogram) and isinstance(earlier, Histogram)
    assert (lengths.count - earlier.count, lengths.sum - earlier.sum) == (2, 8)
    counts = list(lengths.buckets.values())
    assert counts == sorted(counts) and lengths.buckets["+Inf"] == lengths.count
    assert lengths.labels == {"model_name": llm.engine.model_name}
    running = after["aioinfer:num_requests_running"]
    assert isinstance(running, Gauge) and running.value == 0.0
    finished = [m for m in llm.get_metrics() if m.name == "aioinfer:request_success"]
    assert {m.labels["finished_reason"] for m in finished} >= {"length", "stop", "abort"}


def test_metrics_reader_makes_a_vector_of_counters_per_position():
    family = CounterMetricFamily(
        "aioinfer:accepted_per_pos", "x", labels=("model_name", "position")
    )
    for position, count in ((1, 3), (0, 5), (3, 1)):
        family.add_metric(["m", str(position)], float(count))

    class One:
        def collect(self):
            yield family

    (vector,) = read_metrics(One())
    assert vector == Vector("aioinfer:accepted_per_pos", {"model_name": "m"}, [5, 3, 0, 1])


def test_output_kind_is_vllm_s_and_the_offline_llm_returns_final_outputs(tiny):
    llm, _ = tiny
    prompt = [21, 22, 23]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    whole = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    for kind in RequestOutputKind:  # vLLM's LLM asks every request for its final output only
        out = llm.generate([prompt], greedy.clone(output_kind=kind), use_tqdm=False)[0]
        assert out.finished and out.outputs[0].token_ids == whole.token_ids
        assert out.outputs[0].text == whole.text and len(whole.token_ids) == 6
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    for bad in ("delta", 3, True, None):
        with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
            SamplingParams(output_kind=bad)  # type: ignore[arg-type]


def test_a_prompt_s_cache_salt_shares_cached_prefixes_only_within_it(tiny):
    llm, _ = tiny
    llm.reset_prefix_cache()
    ids = list(range(300, 350))  # 50 tokens: three whole blocks can be cached
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(prompt: dict) -> int:
        return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

    assert cached({"prompt_token_ids": ids, "cache_salt": "a"}) == 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "a"}) > 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "b"}) == 0
    assert cached({"prompt_token_ids": ids}) == 0
    assert cached({"prompt_token_ids": ids}) > 0
    text = llm.get_tokenizer().decode(ids)
    assert cached({"prompt": text, "cache_salt": "c"}) == 0
    for bad in ("", 5, "x" * 1025):
        with pytest.raises(ValueError, match="cache_salt must be a text of 1 to 1024"):
            llm.generate({"prompt_token_ids": ids, "cache_salt": bad}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt is not valid Unicode text"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": "\ud800"}, params, use_tqdm=False)
    assert llm.engine.num_unfinished == 0 and llm.engine.scheduler.kv.usage == 0.0


def test_use_tqdm_as_a_callable_makes_the_bar(tiny):
    """vLLM's use_tqdm may be a tqdm-like callable (functools.partial(tqdm, leave=False)): it
    is called with the total and advanced once per finished prompt."""
    llm, _ = tiny
    bars: list[FakeBar] = []

    class FakeBar:
        def __init__(self, **kwargs):
            self.kwargs, self.count, self.closed, self.postfix = kwargs, 0, False, None
            bars.append(self)

        def update(self, n: int) -> None:
            self.count += n

        def close(self) -> None:
            self.closed = True

    llm.generate([[5, 6], [7, 8], [9]], SamplingParams(max_tokens=3), use_tqdm=FakeBar)
    (bar,) = bars
    assert bar.kwargs["total"] == 3 and bar.count == 3 and bar.closed
    assert bar.postfix.endswith("output tok/s")


def test_enqueue_runs_nothing_until_wait_for_completion(tiny):
    """vLLM's enqueue / wait_for_completion: prompts queue (their request ids come back) and
    run together when waited for, outputs in the order queued, as generate() gives them."""
    llm, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 6, 7], "hello world", {"prompt_token_ids": [9, 10, 11, 12]}]
    expected = llm.generate(prompts, params, use_tqdm=False)
    first = llm.enqueue(prompts[:2], params, priority=0)
    second = llm.enqueue(p for p in prompts[2:])  # a generator, the default params
    assert llm.engine.num_unfinished == 0  # queued here, not in the engine
    assert len(set(first + second)) == 3
    outputs = llm.wait_for_completion(RequestOutput, use_tqdm=False)
    assert [o.request_id for o in outputs] == first + second
    assert [o.outputs[0].token_ids for o in outputs[:2]] == [
        o.outputs[0].token_ids for o in expected[:2]
    ]
    assert outputs[2].prompt_token_ids == [9, 10, 11, 12]
    assert outputs[2].outputs[0].token_ids  # what the default params gave
    assert llm.wait_for_completion() == []


def test_a_refused_enqueued_prompt_fails_the_wait_and_leaves_nothing(tiny):
    llm, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.enqueue([[5, 6, 7]], params)
    llm.enqueue([[5] * (llm.engine.max_model_len + 1)], params)  # longer than the context
    with pytest.raises(ValueError, match="maximum context length is 128 tokens"):
        llm.wait_for_completion(use_tqdm=False)
    assert llm.engine.num_unfinished == 0 and llm.engine.scheduler.kv.usage == 0.0
    assert llm.wait_for_completion() == []
    with pytest.raises(ValueError, match="priority must have one entry per prompt"):
        llm.enqueue([[5, 6], [7, 8]], params, priority=[0])
    llm.enqueue([[5, 6]], params)
    with pytest.raises(TypeError, match="give RequestOutput"):
        llm.wait_for_completion(CompletionOutput)
    assert llm.wait_for_completion() == []  # the failed call took what was queued


def test_enqueue_chat_renders_as_chat_and_queues_with_the_prompts(tiny):
    """vLLM's enqueue_chat: conversations rendered with chat()'s options, queued beside
    enqueue()'s prompts, run by the same wait_for_completion."""
    llm, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    conversation = [{"role": "user", "content": "there"}]
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    options = {"chat_template": template, "chat_template_kwargs": {"greeting": "Hi "}}
    expected = llm.chat(conversation, params, use_tqdm=False, **options)[0]
    ids = llm.enqueue([5, 6, 7], params) + llm.enqueue_chat(conversation, params, **options)
    both = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    ids += llm.enqueue_chat(both, params)
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == ids and len(ids) == 4
    assert outputs[1].prompt == "Hi there" == expected.prompt
    assert outputs[1].outputs[0].token_ids == expected.outputs[0].token_ids
    assert outputs[3].prompt == "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(TypeError, match="no_such_option"):
        llm.enqueue_chat(conversation, params, no_such_option=True)
    assert llm.wait_for_completion() == []
