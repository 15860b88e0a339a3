"""The factory the engine builds its runner with, unless a test hands it a fake one."""

from __future__ import annotations

from typing import Any

from aioinfer.config import ModelConfig


class DefaultRunnerFactory:
    """Creates the real ModelRunner; imported lazily so that tests with fakes skip torch work."""

    @staticmethod
    def resolve(model_config: ModelConfig) -> Any:
        from aioinfer.gpu.runner import ModelRunner

        return ModelRunner.resolve(model_config)

    def __call__(self, *args: Any) -> Any:
        from aioinfer.gpu.runner import ModelRunner

        return ModelRunner(*args)


default_runner_factory = DefaultRunnerFactory()
