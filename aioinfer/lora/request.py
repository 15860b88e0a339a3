"""vLLM's `vllm.lora.request` path, where its LoRA examples import LoRARequest from, so that a
script's imports change only in their package name. The class lives in aioinfer.core.lora."""

from aioinfer.core.lora import LoRARequest

__all__ = ["LoRARequest"]
