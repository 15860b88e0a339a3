"""Rich logging and the startup lines: the numbers the engine will live by, each easy to grep."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

logger = logging.getLogger("aioinfer")

# The level `aioinfer serve` logs at (vLLM's VLLM_LOGGING_LEVEL); INFO when unset.
LOGGING_LEVEL_ENV = "AIOINFER_LOGGING_LEVEL"
LOGGING_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def logging_level_from_env() -> str:
    """AIOINFER_LOGGING_LEVEL in upper case, INFO when unset; ValueError for another value."""
    value = os.environ.get(LOGGING_LEVEL_ENV, "").strip()
    if not value:
        return "INFO"
    if value.upper() not in LOGGING_LEVELS:
        raise ValueError(
            f"{LOGGING_LEVEL_ENV} must be one of {', '.join(LOGGING_LEVELS)}, got {value!r}"
        )
    return value.upper()


def setup_logging(level: str | None = None) -> None:
    """Log to stderr at `level`; None: the level AIOINFER_LOGGING_LEVEL names (ValueError for
    one it does not know)."""
    import sys

    if level is None:
        level = logging_level_from_env()
    handler: logging.Handler
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(
            console=Console(stderr=True),
            show_path=False,
            rich_tracebacks=True,
            markup=False,
            log_time_format="%X",
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        # Piped into a file or a log collector: one greppable line per message, the same
        # fields as on a terminal, and no padding to a console's width.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-8s %(message)s", "%X"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # Library chatter that says nothing an operator needs.
    for name in ("aiohttp.access", "httpx", "urllib3", "filelock"):
        logging.getLogger(name).setLevel(logging.WARNING)


def log_non_default_args(args: dict[str, Any]) -> None:
    logger.info("non-default args: %s", args)


def log_engine_started(engine: Any) -> None:
    """The lines after the engine is up, in vLLM's order and wording where users grep them."""
    info = engine.info
    mc, cc = engine.model_config, engine.cache_config
    logger.info(
        "Initializing engine with config: model=%r, served_model_name=%r, dtype=%s, device=%s, "
        "max_model_len=%d, block_size=%d, enable_prefix_caching=%s, enforce_eager=%s, "
        "attention_backend=%s, cpu_kernels=%s",
        mc.model or "(bundled SmolLM2-135M-Instruct)", engine.model_name, info.dtype,
        info.device, info.max_model_len, cc.block_size, cc.enable_prefix_caching,
        mc.enforce_eager, info.attention_backend, info.cpu_kernels,
    )  # fmt: skip
    pooler = getattr(info, "pooler", None)
    if pooler is not None:
        routes = "/classify, /score and /rerank" if pooler.classifies else "/v1/embeddings"
        logger.info("Runner: pooling (%s): serving %s", pooler.describe(), routes)
    logger.info(
        "Chunked prefill is enabled with max_num_batched_tokens=%d.", info.max_num_batched_tokens
    )
    logger.info("Using max model len %d", info.max_model_len)
    logger.info("Loading weights took %.2f seconds", info.weights_load_seconds)
    logger.info(
        "Model loading took %.4f GiB memory and %.6f seconds",
        info.weights_gib,
        info.model_load_seconds,
    )
    logger.info("Available KV cache memory: %.2f GiB", info.available_kv_gib)
    logger.info(
        "KV cache blocks: %d usable of %d (block 0 is reserved), %d tokens each",
        info.num_blocks - 1,
        info.num_blocks,
        info.block_size,
    )
    logger.info(
        "KV cache size: %d tokens, Maximum concurrency for %d tokens per request: %.2fx",
        info.kv_capacity_tokens,
        info.max_model_len,
        info.max_concurrency,
    )
    if info.graph_capture_seconds is not None:
        logger.info(
            "Graph capturing finished in %.0f secs, took %.2f GiB",
            info.graph_capture_seconds,
            info.graph_memory_gib or 0.0,
        )
    else:
        logger.info("CUDA graphs are off: %s; every step runs eagerly.", info.graphs_off_reason)
    _log_default_sampling(engine.default_sampling, mc.generation_overrides, mc.generation_config)
    logger.info(
        "init engine (profile, create kv cache, warmup model) took %.2f seconds",
        info.init_seconds,
    )


def _log_default_sampling(
    defaults: dict[str, Any], overrides: dict[str, Any], setting: str
) -> None:
    """Where the sampling defaults come from. The model's generation_config.json changes what
    a request without those fields gets, unasked: a warning, as in vLLM. A folder given to
    --generation-config, and what --override-generation-config set, were asked for: each is
    reported under its own name."""
    from_file = {k: v for k, v in defaults.items() if k not in overrides}
    if from_file and setting == "auto":
        logger.warning(
            "Default sampling parameters have been overridden by the model's generation config: "
            "%s (--generation-config vllm ignores it)",
            from_file,
        )
    elif from_file:
        logger.info(
            "Default sampling parameters set by the generation config in %s: %s",
            setting,
            from_file,
        )
    if overrides:
        logger.info(
            "Default sampling parameters set by --override-generation-config: %s", overrides
        )


async def log_stats_periodically(engine: Any, interval: float) -> None:
    """Every `interval` seconds while busy: throughput, queue sizes, KV usage, prefix hits."""
    last_prompt, last_gen = engine.stats.prompt_tokens, engine.stats.generation_tokens
    last_time = time.monotonic()
    last_spec = (0, 0, 0)
    while True:
        await asyncio.sleep(interval)
        scheduler = engine.scheduler
        if scheduler is None:
            continue
        now = time.monotonic()
        prompt, gen = engine.stats.prompt_tokens, engine.stats.generation_tokens
        busy = prompt != last_prompt or gen != last_gen or scheduler.has_work()
        if busy:
            elapsed = max(now - last_time, 1e-9)
            prefix = scheduler.kv.stats
            hit_rate = prefix.hits / prefix.queries if prefix.queries else 0.0
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                (prompt - last_prompt) / elapsed, (gen - last_gen) / elapsed,
                scheduler.num_running, scheduler.num_waiting, scheduler.kv.usage * 100,
                hit_rate * 100,
            )  # fmt: skip
            if scheduler.speculation is not None:
                last_spec = _log_spec_stats(scheduler.spec_stats, last_spec)
        last_prompt, last_gen, last_time = prompt, gen, now


def _log_spec_stats(stats: Any, last: tuple[int, int, int]) -> tuple[int, int, int]:
    """vLLM's SpecDecoding line over the interval: tokens a draft step emits on average
    (accepted drafts + 1), and how many drafts were accepted."""
    now = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    drafts, drafted, accepted = (a - b for a, b in zip(now, last, strict=True))
    if drafts:
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
            "Drafted: %d tokens, Avg Draft acceptance rate: %.1f%%",
            1 + accepted / drafts, accepted, drafted, 100 * accepted / max(drafted, 1),
        )  # fmt: skip
    return now
