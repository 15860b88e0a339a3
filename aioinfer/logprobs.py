"""vLLM's `vllm.logprobs` path, so that a script's imports change only in their package name.
`Logprob` lives in aioinfer.core.step, beside the per-position mapping that holds it."""

from aioinfer.core.step import Logprob

__all__ = ["Logprob"]
