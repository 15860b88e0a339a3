"""What every response of one generation request shares (`ResponseContext`): its id, its
prompts as the engine sees them (`Prompt`), how token ids read as text, and what the request
asked of its outputs; and `new_id`, the ids of responses and their items.

PURE (no torch, no asyncio).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from aioinfer.core.outputs import RequestOutput
from aioinfer.server.serving.logprobs_render import TokenBytes, TokenText
from aioinfer.server.serving.reasoning import ReasoningSplit


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Prompt:
    """One prompt as the engine sees it: token ids, and the text when there was one."""

    token_ids: list[int]
    text: str | None = None


@dataclass
class ResponseContext:
    """What every response of one request shares."""

    response_id: str
    model: str
    prompts: list[Prompt]
    n: int
    token_text: TokenText
    token_bytes: TokenBytes | None = None  # see chat_logprobs
    engine_id: str = ""  # the engine's request id (base); the response id where empty
    created: int = field(default_factory=lambda: int(time.time()))
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's ids as well
    # vLLM's prompt_logprobs: alternatives per prompt token in the body (None: not asked).
    prompt_logprobs: int | None = None
    # Completions' logprobs: alternatives per token; the echoed prompt's are cut to it, as
    # the engine computes prompt logprobs as wide as the wider of the two requests.
    echo_logprobs: int = 0
    reasoning: ReasoningSplit | None = None  # chat with --reasoning-parser
    lora: str | None = None  # the LoRA adapter the request named as its model (--lora-modules)
    cache_salt: str | None = None  # vLLM's: prefixes shared only within one salt
    # With --enable-prompt-tokens-details: each prompt's tokens found in the prefix cache.
    cached_tokens: dict[int, int] | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    def saw(self, prompt_index: int, output: RequestOutput) -> None:
        """Note what an output (or delta) of prompt `prompt_index` says about its prompt."""
        if self.cached_tokens is not None:
            known = self.cached_tokens.get(prompt_index, 0)
            self.cached_tokens[prompt_index] = max(known, output.num_cached_tokens)

    def choice_index(self, prompt_index: int, seq_index: int) -> int:
        return prompt_index * self.n + seq_index

    def prompt_text(self, prompt_index: int, decode: Callable[[list[int]], str]) -> str:
        prompt = self.prompts[prompt_index]
        return prompt.text if prompt.text is not None else decode(prompt.token_ids)
