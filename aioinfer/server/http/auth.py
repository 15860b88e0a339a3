"""API keys: `Authorization: Bearer <key>` against any of the configured keys; on the Messages
API's routes also `x-api-key: <key>`, which is how Anthropic's clients send it.

The comparison is constant-time over fixed-length digests, and every key is compared, so neither
the length of a key nor which key matched shows in the timing. Health, metrics and version stay
open so that load balancers and scrapers need no key.

With several keys, each key's requests cache their prompt prefixes under a root of their own
(`cache_salt_of`), unless --share-prefix-cache-across-keys: otherwise one key's client could tell
from `cached_tokens` or the time to its first token which prompts another key's sent.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from aioinfer.server.http.errors import AuthenticationError, Handler, is_messages_path

# The root a request's cached prefixes hang from: its key's own, where keys keep them apart.
PREFIX_CACHE_ROOT = web.RequestKey("prefix_cache_root", str)
OPEN_PATHS = frozenset({"/health", "/ping", "/load", "/metrics", "/version", "/is_sleeping"})
_SCHEME = "bearer"
ANTHROPIC_KEY_HEADER = "x-api-key"


def key_digest(key: str) -> bytes:
    # A header's bytes that are not UTF-8 arrive as surrogates: they hash as those bytes.
    return hashlib.sha256(key.encode("utf-8", errors="surrogateescape")).digest()


def is_authorized(header: str | None, digests: Sequence[bytes]) -> bool:
    """Whether an Authorization header carries one of the keys (given as sha256 digests)."""
    return is_key(_bearer_token(header), digests)


def _bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token if scheme.lower() == _SCHEME else None


def is_key(key: str | None, digests: Sequence[bytes]) -> bool:
    """Whether `key` is one of the keys (given as sha256 digests)."""
    if not key:
        return False
    candidate = key_digest(key.strip())
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(candidate, digest)
    return matched


def cache_salt_of(request: web.Request, salt: str | None) -> str | None:
    """The salt a request's prompts are cached under: where keys keep their prefixes apart,
    its key's root with the client's `salt` (if any) within it; else the client's salt."""
    root = request.get(PREFIX_CACHE_ROOT)
    if root is None:
        return salt
    return root if salt is None else f"{root} salt:{salt}"


def make_auth_middleware(keys: Sequence[str], separate_prefixes: bool = False) -> Middleware | None:
    """A middleware that requires one of `keys`; None when no key is configured.
    `separate_prefixes`: each key's requests cache their prompts under a root of their own."""
    if not keys:
        return None
    digests = tuple(key_digest(key) for key in keys)
    # A digest of the key's digest: the key's own, and not what keys are compared by.
    roots = {d: "key:" + hashlib.sha256(b"prefix-cache:" + d).hexdigest() for d in digests}

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" or request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization")
        authorized = is_authorized(header, digests)
        key = _bearer_token(header)
        anthropic = is_messages_path(request.path)
        if anthropic and not authorized:
            key = request.headers.get(ANTHROPIC_KEY_HEADER)
            authorized = is_key(key, digests)
        if authorized and separate_prefixes and key is not None:
            request[PREFIX_CACHE_ROOT] = roots[key_digest(key.strip())]
        if not authorized:
            how = "'x-api-key: <key>' or " if anthropic else ""
            raise AuthenticationError(
                f"Missing or incorrect API key: send {how}'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return auth_middleware
