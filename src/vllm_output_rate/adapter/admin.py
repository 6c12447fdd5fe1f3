"""``GET /v1/output_rate/users``: per-user limiter state, as a vLLM endpoint plugin.

vLLM loads endpoint plugins only when they are named in ``VLLM_PLUGINS``
(which then also filters general plugins), so serve with::

    VLLM_PLUGINS=output_rate,output_rate_admin vllm serve ...

The route asks the engine core through a utility method
(``EngineCore.output_rate_users``, added in the engine process by the
registered patch ``engine_core.admin_utility``, :data:`.patches.PATCHES`),
which returns the scheduler's
:meth:`~.operate.OperateSchedulerMixin.output_rate_users`.  With
``--output-rate-admin-key KEY`` the route needs ``Authorization: Bearer KEY``
(401 otherwise).
"""

import hmac
from typing import Any

# No ``from __future__ import annotations`` here: FastAPI reads the route's
# parameter annotation (``Request``) at runtime.

from vllm_output_rate.adapter.identity import error_body
from vllm_output_rate.adapter.install import add_method

ROUTE = "/v1/output_rate/users"
UTILITY = "output_rate_users"


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


class OutputRateAdminPlugin:
    """vLLM endpoint plugin (entry point group ``vllm.endpoint_plugins``)."""

    name = "output_rate_admin"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        async def output_rate_users(request: Request):
            state = request.app.state
            key = getattr(state.args, "output_rate_admin_key", None)
            if key:
                scheme, _, sent = (request.headers.get("authorization") or "").partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(
                    sent.strip().encode(), key.encode()
                ):
                    return _error(401, "this route needs the admin key: 'Authorization: Bearer KEY'")
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
