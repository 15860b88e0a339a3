"""The factory the engine builds its runner with, unless a test hands it a fake one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aioinfer.config import ModelConfig

if TYPE_CHECKING:
    from aioinfer.gpu.compute_threads import CpuSnapshot


class DefaultRunnerFactory:
    """Creates the real ModelRunner; imported lazily so that tests with fakes skip torch work.
    The runner is built with no more compute threads than other processes leave cores free,
    as measured while the model resolves, and follows them while it serves
    (gpu/compute_threads.py)."""

    def __init__(self) -> None:
        self._resolve_began: CpuSnapshot | None = None

    def resolve(self, model_config: ModelConfig) -> Any:
        from aioinfer.gpu.compute_threads import snapshot
        from aioinfer.gpu.runner import ModelRunner

        self._resolve_began = snapshot()
        return ModelRunner.resolve(model_config)

    def __call__(self, *args: Any) -> Any:
        from aioinfer.gpu.compute_threads import start_threads
        from aioinfer.gpu.runner import ModelRunner

        began, self._resolve_began = self._resolve_began, None
        with start_threads(began):
            runner = ModelRunner(*args)
        runner.follow_free_cores()  # torch's own count is back: serving starts from it
        return runner
