"""POST /tokenize and /detokenize (vLLM's): a prompt or chat messages (through the chat
template) to token ids, and token ids back to text."""

from __future__ import annotations

import functools

from aiohttp import web

from aioinfer.server.http.bodies import BODY_SIZE, json_response, parse_request
from aioinfer.server.http.errors import BadRequestError
from aioinfer.server.openai.shapes import TokenizeResponse
from aioinfer.server.openai.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from aioinfer.server.serving.prompts import off_loop_if_long, render_chat_off_loop


async def tokenize(request: web.Request) -> web.Response:
    engine, req = await parse_request(request, TokenizeRequest)
    if req.messages is not None:
        rendered = await render_chat_off_loop(
            request,
            engine.tokenizer,
            req.messages,
            req,
            engine.max_model_len,
            request[BODY_SIZE],
        )
        ids = rendered.token_ids
    else:
        special = req.add_special_tokens is not False
        text = req.prompt or ""
        tokenize_text = functools.partial(engine.tokenizer, add_special_tokens=special)
        encoded = await off_loop_if_long(request, len(text), tokenize_text, text)
        ids = list(encoded["input_ids"])
    body: TokenizeResponse = {
        "tokens": ids,
        "count": len(ids),
        "max_model_len": engine.max_model_len,
    }
    if req.return_token_strs:
        body["token_strs"] = list(engine.tokenizer.convert_ids_to_tokens(ids))
    return json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    engine, req = await parse_request(request, DetokenizeRequest)
    vocab = int(engine.info.vocab_size)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequestError(f"tokens must be in [0, {vocab}), got {bad[0]}", param="tokens")
    return json_response({"prompt": engine.tokenizer.decode(req.tokens)})
