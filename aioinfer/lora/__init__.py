"""vLLM's `vllm.lora` package path; see request.py."""
