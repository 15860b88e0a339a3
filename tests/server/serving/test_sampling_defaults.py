"""Sampling defaults (the model's generation_config.json, --override-generation-config) fill
what a request leaves unset; max_new_tokens caps max_tokens, as in vLLM."""

from __future__ import annotations

from tests.server.test_http import MESSAGES, post


async def test_model_defaults_apply_to_unset_fields(client, engine, monkeypatch):
    seen = []
    add_request = engine.add_request

    def spy(prompt_token_ids, params, *args, **kwargs):
        seen.append(params)
        return add_request(prompt_token_ids, params, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    monkeypatch.setattr(engine, "default_sampling", {"temperature": 0.25, "top_k": 4})
    await post(client, "/v1/completions", {"prompt": [5], "max_tokens": 2, "top_k": 9})
    assert (seen[0].temperature, seen[0].top_k) == (0.25, 9)
    # --override-generation-config's max_new_tokens caps max_tokens, as in vLLM.
    monkeypatch.setattr(engine, "default_sampling", {"max_tokens": 5})
    await post(client, "/v1/completions", {"prompt": [5]})  # OpenAI's default 16, capped
    await post(client, "/v1/completions", {"prompt": [5], "max_tokens": 3})
    await post(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 50})
    await post(client, "/v1/chat/completions", {"messages": MESSAGES})  # rest of context, capped
    assert [p.max_tokens for p in seen[1:]] == [5, 3, 5, 5]
