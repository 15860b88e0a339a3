"""vLLM's `vllm.inputs` path (prompt dicts), so that a script's imports change only in their
package name. The types live in aioinfer.engine.llm."""

from aioinfer.engine.llm import TextPrompt, TokensPrompt

__all__ = ["TextPrompt", "TokensPrompt"]
