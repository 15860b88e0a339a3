"""RequestStream: when its consumer is woken (every delta, every `interval` tokens, only at the
end) and what the woken consumer gets (the deltas since its last take, merged)."""

from __future__ import annotations

import asyncio

import pytest

from aioinfer.core.outputs import RequestOutput
from aioinfer.core.step import TokenLogprobs
from aioinfer.engine.stream import RequestStream


async def woken(stream: RequestStream) -> RequestOutput | None:
    """What get() returns when the stream's consumer is awake; None while it sleeps."""
    try:
        return await asyncio.wait_for(stream.get(), timeout=0.01)
    except TimeoutError:
        return None


def put(stream: RequestStream, token: int, index: int = 0, finish: str | None = None) -> None:
    stream.put(index, f"<{token}>", [token], None, None, finish)


async def test_interval_1_wakes_the_consumer_at_every_delta() -> None:
    stream = RequestStream("r", None, [1, 2], 1)
    for token in (5, 6, 7):
        put(stream, token)
        out = await woken(stream)
        assert out is not None and out.outputs[0].token_ids == [token]
    put(stream, 8, finish="length")
    out = await woken(stream)
    assert out is not None and out.finished and out.outputs[0].text == "<8>"


async def test_an_interval_wakes_at_the_first_token_every_interval_tokens_and_the_last() -> None:
    stream = RequestStream("r", None, [1, 2], 1, interval=3)
    put(stream, 10)
    first = await woken(stream)
    assert first is not None and first.outputs[0].token_ids == [10]  # time to first token
    put(stream, 11)
    put(stream, 12)
    assert await woken(stream) is None
    put(stream, 13)
    out = await woken(stream)
    assert out is not None and out.outputs[0].token_ids == [11, 12, 13]
    assert out.outputs[0].text == "<11><12><13>"
    put(stream, 14)
    assert await woken(stream) is None
    put(stream, 15, finish="stop")  # the last token goes at once, whatever the count
    out = await woken(stream)
    assert out is not None and out.finished and out.outputs[0].token_ids == [14, 15]
    assert out.outputs[0].finish_reason == "stop"


async def test_each_sequence_of_n_counts_its_own_tokens() -> None:
    stream = RequestStream("r", None, [1], 2, interval=2)
    put(stream, 10, index=0)
    put(stream, 20, index=1)
    out = await woken(stream)
    assert out is not None and [o.token_ids for o in out.outputs] == [[10], [20]]
    put(stream, 11, index=0)
    put(stream, 21, index=1)
    assert await woken(stream) is None  # one token each: neither sequence reached 2
    put(stream, 12, index=0)
    out = await woken(stream)
    assert out is not None
    assert [(o.index, o.token_ids) for o in out.outputs] == [(0, [11, 12]), (1, [21])]


async def test_final_only_wakes_once_per_finished_sequence_with_everything_merged() -> None:
    stream = RequestStream("r", None, [1], 2)
    stream.final_only()
    for step in range(50):
        for index in (0, 1):
            logprobs = [TokenLogprobs(step, -0.5, 1)]
            finish = "length" if step == 49 and index == 0 else None
            stream.put(index, "x", [step], logprobs, -0.5 * (step + 1), finish)
        if step < 49:
            assert await woken(stream) is None
    out = await woken(stream)
    assert out is not None and not out.finished
    assert [len(o.token_ids) for o in out.outputs] == [50, 50]
    assert [lp.token_id for lp in out.outputs[0].logprobs] == list(range(50))
    assert out.outputs[0].finish_reason == "length" and out.outputs[1].finish_reason is None
    stream.put(1, "", [], None, None, "abort")
    out = await woken(stream)
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"


async def test_a_failure_wakes_any_consumer() -> None:
    stream = RequestStream("r", None, [1], 1)
    stream.final_only()
    put(stream, 5)
    assert await woken(stream) is None
    stream.fail(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        await stream.get()
