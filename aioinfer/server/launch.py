"""`aioinfer serve`: bind the port at once, build the engine behind it, serve until a signal.

The socket is listening (and /health answers 503) while weights load, so a load balancer sees
the truth from the first second. SIGTERM or SIGINT drains while the socket still listens:
/health and new requests answer 503, in-flight requests get `shutdown_timeout` seconds, the
rest end with finish_reason "abort"; exit code 0. An engine that fails to start or dies fails
its requests at once and exits the process with code 1, without draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import ipaddress
import logging
import os
import signal
import socket
import ssl
import sys
import time

from aiohttp import web

from aioinfer.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    non_default_args,
)
from aioinfer.engine.event_loop import loop_factory, run_on_event_loop
from aioinfer.startup_log import (
    log_engine_started,
    log_non_default_args,
    log_stats_periodically,
    setup_logging,
)

logger = logging.getLogger("aioinfer")

# aiohttp's own shutdown wait, after the drain: only handlers that ignored the abort are left.
RUNNER_SHUTDOWN_TIMEOUT = 2.0
# Seconds an idle keep-alive connection stays open (aiohttp's default is an hour: idle clients
# would hold file descriptors that long). nginx's default.
KEEPALIVE_TIMEOUT = 75.0


def _claim_unix_socket(path: str) -> None:
    """Refuse a socket path that another live server listens on; a stale file is replaced."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # nobody listens: the file is left over, and the new server replaces it
    finally:
        probe.close()
    raise SystemExit(f"Another server listens on {path}; stop it or choose another --uds path")


def server_address(config: ServerConfig) -> str:
    if config.uds:
        return f"unix:{config.uds}"
    host = config.host if ":" not in config.host else f"[{config.host}]"
    scheme = "https" if config.ssl_certfile else "http"
    return f"{scheme}://{host}:{config.port}"


def make_site(runner: web.AppRunner, config: ServerConfig) -> web.BaseSite:
    """Where the server listens: --uds, or host:port; over TLS with --ssl-certfile."""
    context = _tls_context(config) if config.ssl_certfile else None
    if config.uds:
        return web.UnixSite(runner, config.uds, ssl_context=context)
    return web.TCPSite(runner, config.host, config.port, ssl_context=context)


class _EncryptedKey(Exception):
    pass


def _no_passphrase() -> str:
    # Called for an encrypted key, instead of OpenSSL asking on the terminal (a server has none).
    raise _EncryptedKey


def _tls_context(config: ServerConfig) -> ssl.SSLContext:
    assert config.ssl_certfile is not None
    # OpenSSL's "[Errno 2] No such file or directory" does not say which file it missed.
    for flag, path in (
        ("--ssl-certfile", config.ssl_certfile),
        ("--ssl-keyfile", config.ssl_keyfile),
    ):
        if path is not None and not os.path.isfile(path):
            raise SystemExit(f"Cannot load {flag} {path}: no such file")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile, password=_no_passphrase)
    except _EncryptedKey:
        raise SystemExit(
            "The --ssl-keyfile key is encrypted: give a decrypted copy "
            "(openssl pkey -in key.pem -out plain.pem)"
        ) from None
    except (OSError, ssl.SSLError) as exc:
        hint = (
            "" if config.ssl_keyfile else " (no --ssl-keyfile: is the key in the certificate file?)"
        )
        files = f"--ssl-certfile {config.ssl_certfile}"
        if config.ssl_keyfile:
            files += f" / --ssl-keyfile {config.ssl_keyfile}"
        raise SystemExit(f"Cannot load {files}: {exc}{hint}") from None
    return context


def run_server(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    server_config: ServerConfig,
    started_at: float | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (returns 0) or an engine failure (returns 1); 2 when
    AIOINFER_LOGGING_LEVEL names no level or AIOINFER_EVENT_LOOP no loop to be had."""
    try:
        setup_logging()
        new_loop = loop_factory()
    except ValueError as exc:  # worded as the command line's own errors
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    args = non_default_args(model_config, cache_config, scheduler_config, server_config)
    if "api_key" in args:
        args["api_key"] = f"<{len(server_config.api_key)} key(s)>"
    log_non_default_args(args)
    warn_if_exposed(server_config)
    warn_if_unbounded(scheduler_config)
    code = run_on_event_loop(
        _serve(model_config, cache_config, scheduler_config, server_config, started_at), new_loop
    )
    _exit_now_if_gpu_thread_alive(code)
    return code


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (a name other than localhost is
    not known to be)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(config: ServerConfig) -> None:
    """WARNING lines for a start that leaves the server open: every route without a key on
    an address other than loopback (vLLM's default too); runtime LoRA loading without a root
    for its paths (it then refuses every path)."""
    if not config.api_key and not config.uds and not is_loopback(config.host):
        logger.warning(
            "Serving on %s without an API key: anyone who can reach this address can use "
            "every route; set --api-key (or AIOINFER_API_KEY), or --host 127.0.0.1",
            server_address(config),
        )
    from aioinfer.server.openai.lora import runtime_lora_updating

    if runtime_lora_updating() and config.lora_root is None:
        logger.warning(
            "Runtime LoRA loading is switched on, but without --lora-root it refuses every "
            "lora_path: set --lora-root to the folder the adapters may be loaded from"
        )
    if config.lora_root is not None and not os.path.isdir(config.lora_root):
        logger.warning("--lora-root %s is not a folder: no adapter loads from it", config.lora_root)


def warn_if_unbounded(config: SchedulerConfig) -> None:
    """A WARNING line for a start whose waiting queue has no bound (the default, as vLLM's):
    every request is queued, whatever its prompts and however many wait."""
    if config.max_queued_requests is None and config.max_queued_tokens is None:
        logger.warning(
            "The waiting queue has no bound: every request is queued, however many wait; set "
            "--max-queued-requests and/or --max-queued-tokens to answer 503 beyond them"
        )


def _exit_now_if_gpu_thread_alive(code: int) -> None:
    """A GPU thread still at work (a model load a signal cut short, a stuck step) would be
    torn down inside torch when the interpreter finalizes, which aborts the process (exit code
    134): leave at once instead, with the server already closed."""
    import threading

    from aioinfer.gpu.thread import THREAD_NAME

    if any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate()):
        # DEBUG: after a refused start (a port in use) there is nothing to alarm anyone about.
        logger.debug("Exiting without waiting for the GPU thread's work to end")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


async def _serve(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    server_config: ServerConfig,
    started_at: float | None,
) -> int:
    from aioinfer.core.lora import LoRARequest
    from aioinfer.engine.async_engine import AsyncEngine
    from aioinfer.server.app import create_app, drain
    from aioinfer.server.http.state import STATE

    started_at = started_at if started_at is not None else time.perf_counter()
    stop = asyncio.Event()
    exit_code = 0
    background: list[asyncio.Task[None]] = []

    async def build_engine() -> AsyncEngine:
        engine = await AsyncEngine.create(
            model_config,
            cache_config,
            scheduler_config,
            step_timeout=server_config.watchdog_timeout or None,
        )
        for index, (name, path) in enumerate(server_config.lora_adapters.items(), start=1):
            await engine.add_lora(LoRARequest(name, index, path))
            logger.info("Loaded LoRA adapter %r from %s", name, path)
        log_engine_started(engine)
        # What start-up built (modules, the model, the tokenizer) lives as long as the process:
        # keep it out of every later garbage collection. Scanning it took about 0.2 s a full
        # collection, with the GIL held, so a pause of every stream and step (vLLM freezes its
        # heap after start-up too).
        gc.collect()
        gc.freeze()
        logger.info("Starting aioinfer server on %s", server_address(server_config))
        logger.info("Ready in %.2f s", time.perf_counter() - started_at)
        if server_config.log_stats_interval > 0:
            interval = server_config.log_stats_interval
            background.append(asyncio.create_task(log_stats_periodically(engine, interval)))
        return engine

    def on_fatal(error: BaseException) -> None:
        nonlocal exit_code
        if app[STATE].startup_error is None:  # a failed start was logged where it happened
            logger.error("engine failed, shutting down: %r", error)
        exit_code = 1
        stop.set()

    if server_config.uds:
        _claim_unix_socket(server_config.uds)
    app = create_app(build_engine, server_config, on_fatal=on_fatal)
    runner = web.AppRunner(
        app,
        handle_signals=False,
        shutdown_timeout=RUNNER_SHUTDOWN_TIMEOUT,
        keepalive_timeout=KEEPALIVE_TIMEOUT,
    )
    await runner.setup()
    site = make_site(runner, server_config)
    try:
        await site.start()
    except OSError as exc:  # the address is taken, or not this machine's
        logger.error("Cannot listen on %s: %s", server_address(server_config), exc.strerror or exc)
        await runner.cleanup()
        return 1
    if not server_config.uds and server_config.port == 0:  # the log names the port bound
        server_config = dataclasses.replace(server_config, port=runner.addresses[0][1])
    loop = asyncio.get_running_loop()
    draining: asyncio.Future[int] | None = None
    forced = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set() and draining is not None and not draining.done():
            logger.warning("Second signal: aborting the requests still running")
            forced.set()
            draining.cancel()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    logger.info(
        "Listening on %s; /health answers 503 until the engine is ready",
        server_address(server_config),
    )
    try:
        await stop.wait()
        notice = server_config.shutdown_notice
        if exit_code == 0 and notice > 0:
            app[STATE].leaving = True
            logger.info("Shutting down in %g s (--shutdown-notice): /health answers 503, "
                        "requests are still served", notice)  # fmt: skip
            stop.clear()  # a second signal ends the notice at once
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), notice)
        if exit_code == 0:
            logger.info("Shutting down: draining in-flight requests (up to %g s; a second "
                        "signal aborts them)", server_config.shutdown_timeout)  # fmt: skip
            draining = asyncio.ensure_future(drain(app, server_config.shutdown_timeout))
            try:
                aborted = await draining
            except asyncio.CancelledError:
                if not forced.is_set():
                    raise
                aborted = await drain(app, 0.0)
            if aborted:
                logger.info("Aborted %d requests still running", aborted)
    finally:
        for task in background:
            task.cancel()
        for task in background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await runner.cleanup()
        if server_config.uds:
            with contextlib.suppress(OSError):
                os.unlink(server_config.uds)
    return exit_code
