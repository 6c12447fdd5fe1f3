"""``GET /v1/output_rate/users``: per-user limiter state, as a vLLM endpoint plugin.

vLLM loads endpoint plugins only when they are named in ``VLLM_PLUGINS``
(which then also filters general plugins), so serve with::

    VLLM_PLUGINS=output_rate,output_rate_admin vllm serve ...

The route asks the engine core through a utility method
(``EngineCore.output_rate_users``, added in the engine process by the
registered patch ``engine_core.admin_utility``, :data:`.patches.PATCHES`),
which returns the scheduler's
:meth:`~.operate.OperateSchedulerMixin.output_rate_users`.

The route is closed by default: it answers only ``Authorization: Bearer KEY``
with the admin key (401 for a missing or wrong key), and 403 to everyone when no
key is configured, unless the operator opened it on purpose
(``--output-rate-admin-open``).  The key comes from ``--output-rate-admin-key``,
``--output-rate-admin-key-file`` or the environment variable
``VLLM_OUTPUT_RATE_ADMIN_KEY``; on the command line it is wrapped in
:class:`AdminKey`, whose ``repr`` is redacted, because vLLM logs every
non-default argument at startup.
"""

import hmac
import os
from dataclasses import dataclass
from typing import Any, Mapping

# No ``from __future__ import annotations`` here: FastAPI reads the route's
# parameter annotation (``Request``) at runtime.

from vllm_output_rate.adapter.identity import error_body
from vllm_output_rate.adapter.install import add_method
from vllm_output_rate.settings import OutputRateConfigError

ROUTE = "/v1/output_rate/users"
UTILITY = "output_rate_users"

ADMIN_KEY_FLAG = "--output-rate-admin-key"
ADMIN_KEY_FILE_FLAG = "--output-rate-admin-key-file"
ADMIN_OPEN_FLAG = "--output-rate-admin-open"
ADMIN_KEY_ENV = "VLLM_OUTPUT_RATE_ADMIN_KEY"
REDACTED = "<redacted>"


class AdminKey(str):
    """The admin key as parsed from the command line.

    A ``str`` (compared as such), but its ``repr`` and ``str`` never show the
    value: vLLM logs ``non-default args: {...}`` (the dict's repr) at startup,
    and an ``argparse.Namespace`` prints its values the same way.
    """

    def __repr__(self) -> str:
        return repr(REDACTED)

    def __str__(self) -> str:
        return REDACTED

    def secret(self) -> str:
        return str.__str__(self)

    def __reduce__(self):
        # Pickled to other API-server processes as itself, value intact.
        return (AdminKey, (self.secret(),))


def admin_key_arg(text: str) -> AdminKey:
    """argparse ``type`` of ``--output-rate-admin-key``."""
    if not text.strip():
        import argparse

        raise argparse.ArgumentTypeError("must not be empty")
    return AdminKey(text.strip())


@dataclass(frozen=True)
class AdminAccess:
    """Who may read the route: the holder of ``key``, everyone (``open``), or no one."""

    key: str | None = None
    open: bool = False
    source: str | None = None  # the flag or variable the key came from, for the log

    @classmethod
    def from_args(cls, args: Any, environ: Mapping[str, str] | None = None) -> "AdminAccess":
        """Resolve the key from the flags, then the environment; errors name the flag."""
        environ = os.environ if environ is None else environ
        flag_key = getattr(args, "output_rate_admin_key", None)
        key_file = getattr(args, "output_rate_admin_key_file", None)
        is_open = bool(getattr(args, "output_rate_admin_open", False))
        if flag_key and key_file:
            raise OutputRateConfigError(
                f"{ADMIN_KEY_FLAG} and {ADMIN_KEY_FILE_FLAG}: give one of them"
            )
        key, source = None, None
        if flag_key:
            key, source = str.__str__(flag_key), ADMIN_KEY_FLAG
        elif key_file:
            key, source = _read_key_file(key_file), ADMIN_KEY_FILE_FLAG
        elif environ.get(ADMIN_KEY_ENV, "").strip():
            key, source = environ[ADMIN_KEY_ENV].strip(), ADMIN_KEY_ENV
        if key and is_open:
            raise OutputRateConfigError(
                f"{ADMIN_OPEN_FLAG} and an admin key ({source}) contradict each other; "
                "give one of them"
            )
        return cls(key=key, open=is_open, source=source)

    def refusal(self, authorization: str | None) -> tuple[int, str] | None:
        """(status, message) when a request with this Authorization header is refused."""
        if self.key is None:
            if self.open:
                return None
            return 403, (
                f"the admin route is closed: start the server with {ADMIN_KEY_FLAG}, "
                f"{ADMIN_KEY_FILE_FLAG} or ${ADMIN_KEY_ENV} (or {ADMIN_OPEN_FLAG})"
            )
        scheme, _, sent = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            sent.strip().encode(), self.key.encode()
        ):
            return 401, "this route needs the admin key: 'Authorization: Bearer KEY'"
        return None


def _read_key_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            key = handle.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise OutputRateConfigError(f"{ADMIN_KEY_FILE_FLAG} {path}: cannot be read ({exc.__class__.__name__})") from None
    if not key:
        raise OutputRateConfigError(f"{ADMIN_KEY_FILE_FLAG} {path}: the file is empty")
    return key


def install_admin_utility() -> None:
    """Give ``EngineCore`` the utility method the route calls (once)."""
    from vllm.v1.engine.core import EngineCore

    add_method(EngineCore, UTILITY, _output_rate_users)


def _output_rate_users(self) -> dict | None:
    # Runs in the engine process as a method of EngineCore: vLLM's utility
    # calls look the method up on the engine core by name.
    report = getattr(self.scheduler, "output_rate_users", None)
    return None if report is None else report()


def _error(status: int, message: str):
    from starlette.responses import Response

    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return Response(error_body(status, message), status_code=status,
                    media_type="application/json", headers=headers)


def _access(state: Any) -> AdminAccess:
    # Resolved once per API-server process (init_state), or here when a test
    # builds the app without it.
    access = getattr(state, "output_rate_admin_access", None)
    if access is None:
        access = AdminAccess.from_args(getattr(state, "args", None))
        state.output_rate_admin_access = access
    return access


class OutputRateAdminPlugin:
    """vLLM endpoint plugin (entry point group ``vllm.endpoint_plugins``)."""

    name = "output_rate_admin"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        async def output_rate_users(request: Request):
            state = request.app.state
            refused = _access(state).refusal(request.headers.get("authorization"))
            if refused is not None:
                return _error(*refused)
            engine_client = getattr(state, "output_rate_engine_client", None)
            if engine_client is None:
                return _error(503, "no engine behind this server")
            data = await engine_client.engine_core.call_utility_async(UTILITY)
            if data is None:
                return _error(404, "per-user output rate limiting is off on this server")
            return JSONResponse(data)

        app.add_api_route(ROUTE, output_rate_users, methods=["GET"])

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.output_rate_engine_client = engine_client
        state.output_rate_admin_access = AdminAccess.from_args(args)
