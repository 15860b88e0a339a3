"""The command line: `aioinfer serve|plan|bench|chat|complete|...` (main.py, the Typer app) and
its helpers: client.py (chat and complete against a running server), plan.py (what a start
would choose, without loading weights), vllm_args.py (vLLM's `serve` command lines made ours).

`main` is the console script's entry point (`aioinfer.cli:main`) and `python -m aioinfer`'s.
"""

from aioinfer.cli.main import main

__all__ = ["main"]
