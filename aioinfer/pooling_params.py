"""vLLM's `vllm.pooling_params` path, so that a script's imports change only in their package
name. The class lives in aioinfer.core.pooling."""

from aioinfer.core.pooling import PoolingParams

__all__ = ["PoolingParams"]
