"""A LoRA adapter as requests name it (vLLM's LoRARequest); model/lora.py loads and applies it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a unique integer id, and its folder (PEFT's format)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
