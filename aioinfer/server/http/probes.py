"""Connections that are not HTTP/1.1 requests, as routers open them to probe a backend: the
sglang router tries gRPC (HTTP/2) on the HTTP port. aiohttp answers them 400 and would log an
ERROR with a traceback each; they are one quiet line instead."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import BadHttpMessage

HTTP2_PREFACE = "PRI/Upgrade"  # in aiohttp's error for a connection that opens with "PRI *"


class ProbeFilter(logging.Filter):
    """Rewrites aiohttp's error record of an HTTP/2 (gRPC) connection as one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BadHttpMessage) and HTTP2_PREFACE in str(error):
            peer = _peer(record)  # read from the message before it is replaced
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = "%s opened an HTTP/2 (gRPC) connection; this server speaks HTTP/1.1 (400)"
            record.args = (peer,)
            record.exc_info = record.exc_text = None
        return True


def _peer(record: logging.LogRecord) -> str:
    """The client named in aiohttp's message ("Error handling request from 1.2.3.4")."""
    message = record.getMessage() if record.args else str(record.msg)
    return message.rpartition(" from ")[2] or "a client"


def quiet_probes() -> None:
    """Install the filter on aiohttp's server logger, once."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ProbeFilter) for f in logger.filters):
        logger.addFilter(ProbeFilter())
