"""vLLM's `vllm.inputs` path (prompt dicts), so that a script's imports change only in their
package name. The types live in aioinfer.offline.llm."""

from aioinfer.offline.llm import TextPrompt, TokensPrompt

__all__ = ["TextPrompt", "TokensPrompt"]
