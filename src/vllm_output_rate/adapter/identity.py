"""Trusted identity in the API server: who a request is charged to.

Three modes (``--output-rate-identity``):

``body`` (default)
    ``vllm_xargs.output_rate_user`` as the client wrote it.  Not
    authenticated: a gateway in front must overwrite it.
``header``
    The user is the value of one HTTP header (``--output-rate-user-header``,
    default ``x-gateway-inference-fairness-id``) set by an authenticating
    gateway.  No header: the shared anonymous user (``--output-rate-unknown-users
    default``) or HTTP 401 (``reject``).
``api-key``
    vLLM authenticates per-user keys itself: ``Authorization: Bearer KEY`` is
    looked up in ``--output-rate-api-keys FILE`` (key -> user; keys may be
    stored as ``sha256:<hex>``), comparing digests in constant time.  No key
    or an unknown key: HTTP 401.

In ``header`` and ``api-key`` modes the identity is written into the request
body as ``vllm_xargs.output_rate_user`` before vLLM parses it; a body that
already names a *different* user is refused (403), never trusted.  Under
``--output-rate-unknown-users reject`` a user without its own entry in the
limits gets 403.  Generation routes that cannot carry the identity are
refused (403) in these modes.  Every refusal happens here, before vLLM sees
the request, so nothing reaches the engine.

:class:`OutputRateIdentityMiddleware` is a pure ASGI middleware that
:func:`install_middleware` appends to vLLM's own ``--middleware`` list (from
the ``engine_args.cli`` patch, :data:`.patches.PATCHES`), so every
API-server process (``--api-server-count`` > 1) installs it; it reads its
configuration from ``app.state.args``.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm_output_rate.settings import (
    ANONYMOUS_USER,
    MAX_USER_LEN,
    USER_ARG,
    OutputRateConfigError,
    OutputRateSettings,
    file_signature,
    hash_api_key,
    load_api_keys,
    load_limits_file,
    parse_cli,
)

logger = logging.getLogger(__name__)

MODES = ("body", "header", "api-key")
UNKNOWN_USER_POLICIES = ("default", "reject")
DEFAULT_USER_HEADER = "x-gateway-inference-fairness-id"
MIDDLEWARE_PATH = "vllm_output_rate.adapter.identity.OutputRateIdentityMiddleware"

IDENTITY_FLAG = "--output-rate-identity"
USER_HEADER_FLAG = "--output-rate-user-header"
API_KEYS_FLAG = "--output-rate-api-keys"
UNKNOWN_USERS_FLAG = "--output-rate-unknown-users"

#: Routes whose JSON body carries ``vllm_xargs`` into ``SamplingParams.extra_args``.
IDENTITY_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
)
#: Generation routes that cannot carry the identity: refused in trusted modes.
UNSUPPORTED_ROUTES = frozenset(
    {
        "/v1/chat/completions/batch",
        "/inference/v1/generate",
        "/invocations",
        "/cohere/v2/chat",
        "/generative_scoring",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    }
)
#: Paths that need an identity in trusted modes (vLLM's own --api-key guards these).
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/invocations", "/generative_scoring")
#: The admin route has its own key (see :mod:`.admin`).
ADMIN_PREFIX = "/v1/output_rate/"
#: Seconds between checks of the limits / keys files for changes.
RELOAD_CHECK_S = 1.0


class Refusal(Exception):
    """A request refused before vLLM sees it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError"}


def error_body(status: int, message: str) -> bytes:
    """OpenAI's error object."""
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "Error"),
                "param": None,
                "code": status,
            }
        }
    ).encode()


class _WatchedFile:
    """A file loaded with ``load`` and re-loaded (at most once a second) when it changes.

    A version that fails to load keeps the last good one in force.
    """

    def __init__(self, path: str, load: Callable[[str], Any], clock=None) -> None:
        self.path = path
        self._load = load
        self._clock = clock or (lambda: time.monotonic())
        self._signature = file_signature(path)
        self.value = load(path)  # startup: errors propagate
        self._next_check = self._clock() + RELOAD_CHECK_S
        self._lock = threading.Lock()

    def get(self) -> Any:
        now = self._clock()
        if now >= self._next_check:
            with self._lock:
                if now >= self._next_check:
                    self._next_check = now + RELOAD_CHECK_S
                    signature = file_signature(self.path)
                    if signature != self._signature:
                        self._signature = signature
                        try:
                            self.value = self._load(self.path)
                        except OutputRateConfigError as exc:
                            logger.error("vllm-output-rate: keeping the previous %s: %s", self.path, exc)
        return self.value


@dataclass
class IdentityConfig:
    """Front-end identity settings, validated."""

    mode: str = "body"
    header: str = DEFAULT_USER_HEADER
    unknown_users: str = "default"
    api_keys: _WatchedFile | None = None
    known_users: Callable[[], Any] = field(default_factory=lambda: dict)

    @classmethod
    def from_args(cls, args: Namespace) -> "IdentityConfig":
        mode = getattr(args, "output_rate_identity", None) or "body"
        header = (getattr(args, "output_rate_user_header", None) or DEFAULT_USER_HEADER).lower()
        keys_path = getattr(args, "output_rate_api_keys", None)
        unknown = getattr(args, "output_rate_unknown_users", None) or "default"
        if mode not in MODES:
            raise OutputRateConfigError(f"{IDENTITY_FLAG}: must be one of {list(MODES)}, got {mode!r}")
        if unknown not in UNKNOWN_USER_POLICIES:
            raise OutputRateConfigError(
                f"{UNKNOWN_USERS_FLAG}: must be one of {list(UNKNOWN_USER_POLICIES)}, got {unknown!r}"
            )
        if mode == "api-key" and not keys_path:
            raise OutputRateConfigError(f"{IDENTITY_FLAG} api-key requires {API_KEYS_FLAG} FILE")
        if keys_path and mode != "api-key":
            raise OutputRateConfigError(f"{API_KEYS_FLAG} requires {IDENTITY_FLAG} api-key")
        if unknown == "reject" and mode == "body":
            raise OutputRateConfigError(
                f"{UNKNOWN_USERS_FLAG} reject requires {IDENTITY_FLAG} header or api-key "
                "(an unauthenticated name proves nothing)"
            )
        if mode == "api-key" and getattr(args, "api_key", None):
            raise OutputRateConfigError(
                f"{IDENTITY_FLAG} api-key and vLLM's --api-key both read the Authorization "
                "header; use one of them"
            )
        if mode == "header" and not header.strip():
            raise OutputRateConfigError(f"{USER_HEADER_FLAG}: must not be empty")
        config = cls(mode=mode, header=header, unknown_users=unknown)
        if keys_path:
            config.api_keys = _WatchedFile(keys_path, load_api_keys)
        if unknown == "reject":
            config.known_users = _known_users_from_args(args)
        return config

    # -- identification ----------------------------------------------------------

    def identify(self, headers: dict[str, str]) -> str:
        """The user of a request with these (lower-cased) headers, or Refusal."""
        if self.mode == "api-key":
            user = self._user_of_key(headers.get("authorization"))
        else:
            value = headers.get(self.header)
            if value is None or not value.strip():
                if self.unknown_users == "reject":
                    raise Refusal(401, f"missing header {self.header}: the request has no user")
                return ANONYMOUS_USER
            user = value.strip()
            if len(user) > MAX_USER_LEN:
                raise Refusal(
                    400, f"header {self.header} must be at most {MAX_USER_LEN} characters"
                )
        if self.unknown_users == "reject" and user not in self.known_users():
            raise Refusal(403, f"user {user!r} has no output-rate limit configured on this server")
        return user

    def _user_of_key(self, authorization: str | None) -> str:
        if not authorization:
            raise Refusal(401, "missing API key: send it as 'Authorization: Bearer KEY'")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Refusal(401, "malformed Authorization header: expected 'Bearer KEY'")
        digest = hash_api_key(key)
        found = None
        # Compare against every stored digest, in constant time each, so
        # timing says nothing about which key (or how much of it) matched.
        for stored, user in self.api_keys.get().items():
            if hmac.compare_digest(stored, digest):
                found = user
        if found is None:
            raise Refusal(401, "unknown API key")
        return found


def _known_users_from_args(args: Namespace) -> Callable[[], Any]:
    """Users with their own limit entry, following the limits file when there is one."""
    path = getattr(args, "output_rate_limits_file", None)
    if path:
        watched = _WatchedFile(path, load_limits_file)
        return lambda: watched.get().user_rates
    default = getattr(args, "default_user_output_tokens_per_second", None)
    section = parse_cli(
        None if default is None else str(default),
        getattr(args, "user_output_tokens_per_second", None),
        getattr(args, "output_rate_groups", None),
    )
    users = dict(OutputRateSettings.from_additional_config({"output_rate": section}).user_rates) if section else {}
    return lambda: users


def rewrite_body(body: bytes, user: str) -> bytes:
    """The JSON body with ``vllm_xargs.output_rate_user`` set to ``user``."""
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        return body  # not JSON: vLLM answers 400 itself
    if not isinstance(data, dict):
        return body
    xargs = data.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    elif not isinstance(xargs, dict):
        return body  # vLLM's validation refuses it
    claimed = xargs.get(USER_ARG)
    if claimed is not None and claimed != user:
        raise Refusal(
            403,
            f"vllm_xargs.{USER_ARG} ({str(claimed)[:64]!r}) does not match the "
            "authenticated user; leave it out",
        )
    xargs[USER_ARG] = user
    data["vllm_xargs"] = xargs
    return json.dumps(data).encode()


class OutputRateIdentityMiddleware:
    """Pure ASGI middleware applying :class:`IdentityConfig` to every request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._config: IdentityConfig | None = None

    def _config_for(self, scope: dict) -> IdentityConfig:
        if self._config is None:
            args = getattr(getattr(scope.get("app"), "state", None), "args", None)
            self._config = IdentityConfig.from_args(args) if args is not None else IdentityConfig()
        return self._config

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        config = self._config_for(scope)
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if (
            config.mode == "body"
            or not path.startswith(GUARDED_PREFIXES)
            or path.startswith(ADMIN_PREFIX)
        ):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            user = config.identify(headers)
            if scope.get("method") == "POST" and path in UNSUPPORTED_ROUTES:
                raise Refusal(
                    403, f"{path} cannot carry the output-rate identity; use /v1/chat/completions, "
                    "/v1/completions or /v1/responses"
                )
            if scope.get("method") != "POST" or path not in IDENTITY_ROUTES:
                await self.app(scope, receive, send)
                return
            body = await _read_body(receive)
            body = rewrite_body(body, user)
        except Refusal as refusal:
            await _respond(send, refusal.status, refusal.message)
            return
        scope = dict(scope)
        scope["headers"] = [
            (k, v) for k, v in scope["headers"] if k.lower() != b"content-length"
        ] + [(b"content-length", str(len(body)).encode())]
        await self.app(scope, _replay(body, receive), send)


async def _read_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Refusal(400, "client disconnected")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls: disconnect notifications

    return replay


async def _respond(send: Callable, status: int, message: str) -> None:
    body = error_body(status, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_middleware(args: Namespace) -> None:
    """Validate the identity flags and add the middleware to vLLM's list (once)."""
    config = IdentityConfig.from_args(args)  # errors stop startup here
    if config.mode == "body":
        return
    middleware = getattr(args, "middleware", None)
    if middleware is None:
        return  # not an API-server invocation (no --middleware option)
    if MIDDLEWARE_PATH not in middleware:
        middleware.append(MIDDLEWARE_PATH)
