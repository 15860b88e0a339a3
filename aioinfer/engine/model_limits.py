"""What fits the served model: a prompt's truncation, length and token ids, and the values of
SamplingParams and PoolingParams that only the model can check. Each check raises ValueError
with a message that starts with, or names, the field (the server makes it a 400 naming it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aioinfer.core.pooling import PoolingParams
from aioinfer.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    max_logprobs: int  # --max-logprobs, its -1 (no cap) as the vocabulary size
    hidden_size: int = 0  # the size of an embedding before `dimensions` (pooling models)

    def truncate(
        self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams
    ) -> list[int]:
        """The last `truncate_prompt_tokens` tokens of the prompt (-1: as many as the context
        holds, leaving room for max_tokens, or one token, of output; an embedding outputs
        none); the prompt itself when it is shorter or no limit is set."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return prompt_token_ids
        if keep > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens must be <= {self.max_model_len} (the maximum context "
                f"length), got {keep}"
            )
        if keep == -1:
            output = (params.max_tokens or 1) if isinstance(params, SamplingParams) else 0
            keep = max(1, self.max_model_len - output)
        return prompt_token_ids[-keep:] if len(prompt_token_ids) > keep else prompt_token_ids

    def check_generation(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt and its params for generation; returns the resolved max_tokens.
        Raises ValueError with both numbers when it does not fit."""
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_prompt} tokens, which leaves no room for output."
            )
        self._check_tokens(prompt_token_ids, "prompt")
        self._check_sampling(params)
        room = self.max_model_len - num_prompt
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the "
                f"prompt, {params.max_tokens} for the completion). Please reduce the prompt or "
                f"max_tokens."
            )
        return params.max_tokens

    def check_embedding(self, prompt_token_ids: list[int], params: PoolingParams) -> None:
        """Check an input and its params for an embedding: a whole context may be pooled."""
        num_prompt = len(prompt_token_ids)
        if num_prompt > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt} tokens in the input for embedding generation. "
                f"Please reduce the length of the input."
            )
        self._check_tokens(prompt_token_ids, "input")
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise ValueError(
                f"dimensions must be <= {self.hidden_size} (the model's embedding size), got "
                f"{params.dimensions}"
            )

    def _check_tokens(self, token_ids: Sequence[int], what: str) -> None:
        if not token_ids:
            raise ValueError(f"{what} must not be empty")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} token ids must be in [0, {vocab}), got {bad[0]}")

    def whole_vocabulary(self, params: SamplingParams) -> SamplingParams:
        """`params` with logprobs (or prompt_logprobs) -1 as the vocabulary's size."""
        changes = {
            name: self.vocab_size
            for name in ("logprobs", "prompt_logprobs")
            if getattr(params, name) == -1
        }
        return params.clone(**changes) if changes else params

    def _check_sampling(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: limits of this model and server."""
        cap = self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is None or (self.vocab_size if value == -1 else value) <= cap:
                continue
            whole = " (the whole vocabulary)" if value == -1 else ""
            raise ValueError(f"{name} must be <= {cap} (--max-logprobs), got {value}{whole}")
        vocab = self.vocab_size
        for token in params.logit_bias or {}:
            if token >= vocab:
                raise ValueError(
                    f"logit_bias token id {token} is outside the vocabulary [0, {vocab})"
                )
        for token in params.stop_token_ids or ():
            if token >= vocab:
                raise ValueError(
                    f"stop_token_ids token id {token} is outside the vocabulary [0, {vocab})"
                )
