"""The offline API, vLLM's `LLM`: batches of prompts run to completion on the AsyncEngine,
driven by a private event loop from synchronous code (`aioinfer.LLM` is offline/llm.py's).

Above engine/ and beside server/: neither imports the other.
"""
