"""Background responses of the Responses API: answered "queued" or streamed at once,
generated whatever the client does, read back, streamed again from a cursor, cancelled and
deleted while they run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from aioinfer.config import ServerConfig
from aioinfer.server.app import create_app
from aioinfer.server.http.state import STATE
from aioinfer.server.responses import api as responses_api
from aioinfer.server.responses.render import ResponseEvents
from aioinfer.server.responses.state import RESPONSES
from tests.server.conftest import API_KEYS, assert_pool_free
from tests.server.test_disconnect import wait_until


async def poll(oai: openai.AsyncOpenAI, response_id: str) -> Any:
    """The stored response once it left "queued" and "in_progress"."""
    for _ in range(500):
        response = await oai.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        await asyncio.sleep(0.01)
    raise AssertionError(f"{response_id} still {response.status}")


@pytest.fixture
async def slow(live_factory, slow_engine) -> AsyncIterator[tuple[Any, openai.AsyncOpenAI]]:
    """The app over an engine whose steps take 20 ms, and a client of it."""
    server = await live_factory(slow_engine)
    oai = server.openai()
    yield server, oai
    await oai.close()


async def test_a_background_response_is_answered_queued_and_read_back_complete(
    live_factory, engine
):
    server = await live_factory(engine)
    oai = server.openai()
    queued = await oai.responses.create(
        model=engine.model_name, input="Hi", max_output_tokens=5, background=True
    )
    assert queued.status == "queued" and queued.background and queued.output == []
    assert queued.usage is None
    final = await poll(oai, queued.id)
    reference = await oai.responses.create(model=engine.model_name, input="Hi", max_output_tokens=5)
    assert final.status == reference.status == "incomplete"  # max_output_tokens reached
    assert final.background and not reference.background
    assert final.output_text == reference.output_text
    assert final.usage is not None and reference.usage is not None
    assert final.usage.output_tokens == reference.usage.output_tokens == 5
    assert final.usage.input_tokens == reference.usage.input_tokens  # the second one hits the cache
    assert server.app[STATE].in_flight == 0 and not server.app[RESPONSES].background
    # Only a response still generating can be cancelled.
    with pytest.raises(openai.BadRequestError) as info:
        await oai.responses.cancel(final.id)
    assert info.value.body["param"] == "response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        await oai.responses.cancel(reference.id)
    with pytest.raises(openai.NotFoundError):
        await oai.responses.cancel("resp_unknown")
    assert_pool_free(engine)
    await oai.close()


async def test_a_background_response_can_be_cancelled_or_deleted_while_it_runs(slow, slow_engine):
    server, oai = slow
    create = {"model": slow_engine.model_name, "input": "Hi", "max_output_tokens": 100}
    queued = await oai.responses.create(**create, background=True)
    await wait_until(lambda: slow_engine.scheduler.num_running == 1)
    cancelled = await oai.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert (await oai.responses.retrieve(queued.id)).status == "cancelled"
    assert (await oai.responses.cancel(queued.id)).status == "cancelled"  # again: the same
    await wait_until(lambda: slow_engine.num_unfinished == 0)
    assert_pool_free(slow_engine)
    # Deleted while it runs: it stops, and does not come back when it would have finished.
    second = await oai.responses.create(**create, background=True)
    await wait_until(lambda: slow_engine.scheduler.num_running == 1)
    await oai.responses.delete(second.id)
    await wait_until(lambda: slow_engine.num_unfinished == 0)
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(second.id)
    assert server.app[STATE].in_flight == 0 and not server.app[RESPONSES].background
    assert_pool_free(slow_engine)


async def test_a_background_response_is_found_by_its_task_and_ends_even_when_finishing_fails(
    slow, slow_engine, monkeypatch
):
    """Cancel reaches a running response the store has dropped (and it does not come back);
    a continuation of an unfinished one is refused; delete and cancel at once leave no stale
    answer; an error while the response is built ends it "failed"."""
    server, oai = slow
    state, responses = server.app[STATE], server.app[RESPONSES]
    create = {"model": slow_engine.model_name, "input": "Hi", "max_output_tokens": 100}
    queued = await oai.responses.create(**create, background=True)
    await wait_until(lambda: slow_engine.scheduler.num_running == 1)
    with pytest.raises(openai.BadRequestError) as info:
        await oai.responses.create(**create, previous_response_id=queued.id)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    responses.store.capacity = 1
    await oai.responses.create(**{**create, "max_output_tokens": 1})  # evicts the running one
    assert (await oai.responses.cancel(queued.id)).status == "cancelled"
    again = await oai.responses.create(**create, background=True)
    await wait_until(lambda: slow_engine.scheduler.num_running == 1)
    deleted, cancelled = await asyncio.gather(
        oai.responses.delete(again.id), oai.responses.cancel(again.id), return_exceptions=True
    )
    assert not isinstance(deleted, Exception)
    assert isinstance(cancelled, openai.NotFoundError) or cancelled.status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        await oai.responses.retrieve(again.id)

    def broken(self, final):
        raise RuntimeError("no output today")

    monkeypatch.setattr(ResponseEvents, "complete", broken)
    failing = await oai.responses.create(**{**create, "max_output_tokens": 2}, background=True)
    failed = await poll(oai, failing.id)
    assert failed.status == "failed" and "no output today" in failed.error.message
    await wait_until(lambda: slow_engine.num_unfinished == 0)
    assert state.in_flight == 0 and not responses.background
    assert_pool_free(slow_engine)


async def test_a_streamed_background_response_goes_on_without_its_reader_and_streams_again(
    slow, slow_engine
):
    server, oai = slow
    create = {"model": slow_engine.model_name, "input": "Hi", "max_output_tokens": 12}
    stream = await oai.responses.create(**create, background=True, stream=True)
    seen = []
    async for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta" and len(seen) > 5:
            break
    await stream.close()  # the reader leaves; the response goes on
    response_id = seen[0].response.id  # type: ignore[union-attr]
    final = await poll(oai, response_id)
    reference = await oai.responses.create(**create)
    assert final.status == "incomplete" and final.output_text == reference.output_text
    # Picked up after the last event seen: the rest, in order, ending with the final state.
    rest = await oai.responses.retrieve(response_id, stream=True, starting_after=len(seen) - 1)
    events = seen + [event async for event in rest]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]  # type: ignore[union-attr]
    assert "".join(deltas) == final.output_text
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.model_dump() == final.model_dump()  # type: ignore[union-attr]
    # From the start again; past the end, an empty stream.
    again = await oai.responses.retrieve(response_id, stream=True)
    assert [e.model_dump() for e in events] == [e.model_dump() async for e in again]
    after_end = await oai.responses.retrieve(response_id, stream=True, starting_after=len(events))
    assert [e async for e in after_end] == []
    assert server.app[STATE].in_flight == 0 and not server.app[RESPONSES].background
    assert_pool_free(slow_engine)
    # Only a streamed background response streams again; a cursor is a sequence number.
    url = f"{server.url}/v1/responses/{reference.id}"
    async with aiohttp.ClientSession() as session:
        for target, params, param in (
            (url, {"stream": "true"}, "stream"),
            (url, {"stream": "yes"}, "stream"),
            *(
                (
                    f"{server.url}/v1/responses/{response_id}",
                    {"stream": "true", "starting_after": after},
                    "starting_after",
                )
                for after in ("x", "--5", "-2", "9" * 5000, "٣")  # 5000 digits: was a 500
            ),
        ):
            async with session.get(target, params=params) as response:
                assert response.status == 400
                assert (await response.json())["error"]["param"] == param


async def test_a_reader_of_a_cancelled_background_stream_is_not_left_waiting(slow, slow_engine):
    server, oai = slow
    create = {"model": slow_engine.model_name, "input": "Hi", "max_output_tokens": 100}
    stream = await oai.responses.create(**create, background=True, stream=True)
    first = await stream.__anext__()
    response_id = first.response.id  # type: ignore[union-attr]
    await wait_until(lambda: slow_engine.scheduler.num_running == 1)
    second_reader = await oai.responses.retrieve(response_id, stream=True, starting_after=0)

    async def read_all(events: Any) -> list[Any]:
        return [event async for event in events]

    readers = [asyncio.ensure_future(read_all(s)) for s in (stream, second_reader)]
    assert (await oai.responses.cancel(response_id)).status == "cancelled"
    done = await asyncio.wait_for(asyncio.gather(*readers), 10)
    # Both streams simply end: the stored response tells that it was cancelled.
    finals = ("response.completed", "response.incomplete", "response.failed")
    assert not [e for events in done for e in events if e.type in finals]
    await wait_until(lambda: slow_engine.num_unfinished == 0)
    assert server.app[STATE].in_flight == 0 and not server.app[RESPONSES].background
    assert_pool_free(slow_engine)


async def test_background_responses_are_bounded_per_api_key(
    aiohttp_client, slow_engine, monkeypatch
):
    """A background response goes on whatever its client does: one client could queue any
    number of them. Each API key may have MAX_BACKGROUND_PER_KEY being generated; beyond, a
    429 naming `background` (others' keys are not held up), before any work."""
    monkeypatch.setattr(responses_api, "MAX_BACKGROUND_PER_KEY", 2)
    client = await aiohttp_client(create_app(slow_engine, ServerConfig(api_key=API_KEYS)))
    body = {"input": "Hi", "max_output_tokens": 100, "background": True}
    first, second = ({"Authorization": f"Bearer {key}"} for key in API_KEYS)
    started = []
    for _ in range(2):
        response = await client.post("/v1/responses", json=body, headers=first)
        assert response.status == 200
        started.append((await response.json())["id"])
    response = await client.post("/v1/responses", json=body, headers=first)
    error = (await response.json())["error"]
    assert response.status == 429 and error["param"] == "background", error
    assert response.headers["Retry-After"] == "1" and "cancel" in error["message"]
    assert slow_engine.num_unfinished == 2  # refused before it reached the engine
    response = await client.post("/v1/responses", json=body, headers=second)
    assert response.status == 200
    other = (await response.json())["id"]
    # Once one ends, the key may start another.
    cancel = await client.post(f"/v1/responses/{started[0]}/cancel", headers=first)
    assert (await cancel.json())["status"] == "cancelled"
    response = await client.post("/v1/responses", json=body, headers=first)
    assert response.status == 200
    started.append((await response.json())["id"])
    for response_id, headers in ((started[1], first), (started[2], first), (other, second)):
        await client.post(f"/v1/responses/{response_id}/cancel", headers=headers)
    await wait_until(lambda: slow_engine.num_unfinished == 0)
    assert not client.server.app[RESPONSES].background
    assert_pool_free(slow_engine)
