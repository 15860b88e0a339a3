"""API keys: `Authorization: Bearer <key>` against any of the configured keys; on the Messages
API's routes also `x-api-key: <key>`, which is how Anthropic's clients send it.

The comparison is constant-time over fixed-length digests, and every key is compared, so neither
the length of a key nor which key matched shows in the timing. Health, metrics and version stay
open so that load balancers and scrapers need no key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from aioinfer.server.http.errors import AuthenticationError, Handler, is_messages_path

OPEN_PATHS = frozenset({"/health", "/ping", "/load", "/metrics", "/version", "/is_sleeping"})
_SCHEME = "bearer"
ANTHROPIC_KEY_HEADER = "x-api-key"


def key_digest(key: str) -> bytes:
    # A header's bytes that are not UTF-8 arrive as surrogates: they hash as those bytes.
    return hashlib.sha256(key.encode("utf-8", errors="surrogateescape")).digest()


def is_authorized(header: str | None, digests: Sequence[bytes]) -> bool:
    """Whether an Authorization header carries one of the keys (given as sha256 digests)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != _SCHEME:
        return False
    return is_key(token, digests)


def is_key(key: str | None, digests: Sequence[bytes]) -> bool:
    """Whether `key` is one of the keys (given as sha256 digests)."""
    if not key:
        return False
    candidate = key_digest(key.strip())
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(candidate, digest)
    return matched


def make_auth_middleware(keys: Sequence[str]) -> Middleware | None:
    """A middleware that requires one of `keys`; None when no key is configured."""
    if not keys:
        return None
    digests = tuple(key_digest(key) for key in keys)

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" or request.path in OPEN_PATHS:
            return await handler(request)
        authorized = is_authorized(request.headers.get("Authorization"), digests)
        anthropic = is_messages_path(request.path)
        if anthropic and not authorized:
            authorized = is_key(request.headers.get(ANTHROPIC_KEY_HEADER), digests)
        if not authorized:
            how = "'x-api-key: <key>' or " if anthropic else ""
            raise AuthenticationError(
                f"Missing or incorrect API key: send {how}'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return auth_middleware
