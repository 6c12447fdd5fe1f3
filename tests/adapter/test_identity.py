"""Identity modes in the API server (:mod:`vllm_output_rate.adapter.identity`).

The middleware runs in front of a tiny ASGI app that records what reached it,
so these tests see exactly what vLLM would get (or that it got nothing).
The real-server behaviour is in ``test_operate_server.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from argparse import Namespace

import pytest

from vllm_output_rate.adapter.identity import (
    MIDDLEWARE_PATH,
    IdentityConfig,
    OutputRateIdentityMiddleware,
    install_middleware,
)
from vllm_output_rate.settings import ANONYMOUS_USER, OutputRateConfigError, load_api_keys


def make_args(**kw):
    base = dict(
        output_rate_identity="body", output_rate_user_header="x-gateway-inference-fairness-id",
        output_rate_api_keys=None, output_rate_unknown_users="default",
        output_rate_limits_file=None, default_user_output_tokens_per_second=50.0,
        user_output_tokens_per_second='{"alice": 10, "bob": 20}', api_key=None, middleware=[],
    )
    base.update(kw)
    return Namespace(**base)


class _App:
    def __init__(self, args):
        self.state = Namespace(args=args)
        self.seen = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.seen.append((scope["path"], dict(scope["headers"]), body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(args, path="/v1/chat/completions", body=None, headers=(), method="POST"):
    app = _App(args)
    mw = OutputRateIdentityMiddleware(app)
    raw = json.dumps(body if body is not None else {"model": "m", "messages": []}).encode()
    chunks = [raw[:5], raw[5:]]
    sent = []

    async def receive():
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(msg):
        sent.append(msg)

    scope = {
        "type": "http", "method": method, "path": path, "root_path": "", "app": app,
        "headers": [(k.encode(), v.encode()) for k, v in headers]
        + [(b"content-length", str(len(raw)).encode())],
    }
    asyncio.run(mw(scope, receive, send))
    status = sent[0]["status"]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    forwarded = None
    if app.seen:
        path, hdrs, fbody = app.seen[0]
        assert int(hdrs[b"content-length"]) == len(fbody)
        forwarded = json.loads(fbody)
    return status, payload, forwarded


def user_of(forwarded):
    return forwarded["vllm_xargs"]["output_rate_user"]


def error(payload):
    err = json.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "\n" not in err["message"]
    return err


# -- header mode -------------------------------------------------------------------


def test_header_mode_sets_the_user_from_the_header():
    args = make_args(output_rate_identity="header")
    status, _, fwd = call(args, headers=[("X-Gateway-Inference-Fairness-Id", "alice")])
    assert status == 200 and user_of(fwd) == "alice"
    # Same name in the body is fine; other fields are kept.
    status, _, fwd = call(args, body={"model": "m", "vllm_xargs": {"output_rate_user": "alice", "k": 1}},
                          headers=[("x-gateway-inference-fairness-id", "alice")])
    assert status == 200 and fwd["vllm_xargs"] == {"output_rate_user": "alice", "k": 1}


def test_header_mode_refuses_a_different_body_user():
    args = make_args(output_rate_identity="header")
    status, payload, fwd = call(
        args, body={"model": "m", "vllm_xargs": {"output_rate_user": "bob"}},
        headers=[("x-gateway-inference-fairness-id", "alice")],
    )
    assert status == 403 and fwd is None
    assert "does not match" in error(payload)["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                  "/v1/messages"])
def test_every_documented_identity_route_carries_the_header_user(path):
    """README and docs/operations.md name these four routes; each gets the identity."""
    args = make_args(output_rate_identity="header")
    status, _, fwd = call(args, path=path, headers=[("x-gateway-inference-fairness-id", "alice")])
    assert status == 200 and user_of(fwd) == "alice"


def test_the_openai_user_field_is_not_the_identity():
    """OpenAI's ``user`` names nobody here: the request stays the anonymous user's."""
    args = make_args(output_rate_identity="header")
    status, _, fwd = call(args, body={"model": "m", "messages": [], "user": "alice"})
    assert status == 200 and user_of(fwd) == ANONYMOUS_USER and fwd["user"] == "alice"


def test_header_missing_is_anonymous_even_if_the_body_claims_a_name():
    args = make_args(output_rate_identity="header")
    status, _, fwd = call(args)
    assert status == 200 and user_of(fwd) == ANONYMOUS_USER
    status, _, fwd = call(args, body={"model": "m", "vllm_xargs": {"output_rate_user": "alice"}})
    assert status == 403 and fwd is None


def test_header_reject_mode_401_without_header_403_for_unknown_user():
    args = make_args(output_rate_identity="header", output_rate_unknown_users="reject")
    status, payload, fwd = call(args)
    assert status == 401 and fwd is None
    err = error(payload)
    assert "x-gateway-inference-fairness-id" in err["message"] and err["code"] == 401
    status, payload, fwd = call(args, headers=[("x-gateway-inference-fairness-id", "mallory")])
    assert status == 403 and fwd is None and "mallory" in error(payload)["message"]
    status, _, fwd = call(args, headers=[("x-gateway-inference-fairness-id", "bob")])
    assert status == 200 and user_of(fwd) == "bob"


def test_custom_header_name_and_too_long_value():
    args = make_args(output_rate_identity="header", output_rate_user_header="X-User")
    assert user_of(call(args, headers=[("x-user", "carol")])[2]) == "carol"
    status, payload, _ = call(args, headers=[("x-user", "c" * 300)])
    assert status == 400


# -- api-key mode --------------------------------------------------------------------


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    hashed = hashlib.sha256(b"sk-bob-secret").hexdigest()
    path.write_text(f"sk-alice-secret: alice\n'sha256:{hashed}': bob\nsk-eve: eve\n")
    return str(path)


def test_api_key_mode_maps_keys_to_users(keys_file):
    args = make_args(output_rate_identity="api-key", output_rate_api_keys=keys_file)
    status, _, fwd = call(args, headers=[("authorization", "Bearer sk-alice-secret")])
    assert status == 200 and user_of(fwd) == "alice"
    status, _, fwd = call(args, path="/v1/completions", body={"model": "m", "prompt": "x"},
                          headers=[("Authorization", "bearer sk-bob-secret")])
    assert status == 200 and user_of(fwd) == "bob"


@pytest.mark.parametrize("headers, fragment", [
    ([], "missing API key"),
    ([("authorization", "Bearer sk-wrong")], "unknown API key"),
    ([("authorization", "Basic abc")], "Bearer"),
    ([("authorization", "Bearer sha256:" + hashlib.sha256(b"sk-bob-secret").hexdigest())], "unknown API key"),
])
def test_api_key_mode_401(keys_file, headers, fragment):
    args = make_args(output_rate_identity="api-key", output_rate_api_keys=keys_file)
    status, payload, fwd = call(args, headers=headers)
    assert status == 401 and fwd is None
    assert fragment in error(payload)["message"]


def test_api_key_reject_mode_403_for_mapped_user_without_limit(keys_file):
    args = make_args(output_rate_identity="api-key", output_rate_api_keys=keys_file,
                     output_rate_unknown_users="reject")
    status, payload, fwd = call(args, headers=[("authorization", "Bearer sk-eve")])
    assert status == 403 and fwd is None and "eve" in error(payload)["message"]
    assert call(args, headers=[("authorization", "Bearer sk-alice-secret")])[0] == 200


def test_api_key_guards_other_v1_routes_but_not_health(keys_file):
    args = make_args(output_rate_identity="api-key", output_rate_api_keys=keys_file)
    assert call(args, path="/v1/models", method="GET")[0] == 401
    assert call(args, path="/health", method="GET")[0] == 200
    assert call(args, path="/metrics", method="GET")[0] == 200
    # A generation route that cannot carry the identity is refused.
    status, payload, _ = call(args, path="/inference/v1/generate",
                              headers=[("authorization", "Bearer sk-alice-secret")])
    assert status == 403


def test_body_mode_passes_everything_through():
    args = make_args()
    status, _, fwd = call(args, body={"model": "m", "vllm_xargs": {"output_rate_user": "whoever"}})
    assert status == 200 and user_of(fwd) == "whoever"


# -- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize("kw, fragment", [
    (dict(output_rate_identity="api-key"), "--output-rate-api-keys"),
    (dict(output_rate_unknown_users="reject"), "requires --output-rate-identity header or api-key"),
    (dict(output_rate_identity="header", output_rate_api_keys="/x"), "requires --output-rate-identity api-key"),
    (dict(output_rate_identity="api-key", output_rate_api_keys="/nonexistent/keys.json"), "cannot read"),
])
def test_bad_identity_settings_stop_startup(kw, fragment):
    with pytest.raises(OutputRateConfigError) as exc:
        IdentityConfig.from_args(make_args(**kw))
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_api_key_mode_conflicts_with_vllm_api_key(keys_file):
    with pytest.raises(OutputRateConfigError, match="--api-key"):
        IdentityConfig.from_args(make_args(output_rate_identity="api-key",
                                           output_rate_api_keys=keys_file, api_key=["k"]))


def test_install_middleware_once_and_only_for_trusted_modes():
    args = make_args()
    install_middleware(args)
    assert args.middleware == []
    args = make_args(output_rate_identity="header")
    install_middleware(args)
    install_middleware(args)
    assert args.middleware == [MIDDLEWARE_PATH]


@pytest.mark.parametrize("text, fragment", [
    ("[1, 2]", "must hold an object"),
    ("{}", "no keys"),
    ('{"k": ""}', "non-empty string"),
    ('{"sha256:abc": "u"}', "64 hex digits"),
    ("{bad", "cannot parse"),
])
def test_bad_api_keys_file(tmp_path, text, fragment):
    path = tmp_path / "keys.json"
    path.write_text(text)
    with pytest.raises(OutputRateConfigError) as exc:
        load_api_keys(str(path))
    assert fragment in str(exc.value)


def test_api_keys_file_reload_keeps_old_keys_on_error(keys_file, monkeypatch):
    import vllm_output_rate.adapter.identity as identity

    clock = [0.0]
    monkeypatch.setattr(identity.time, "monotonic", lambda: clock[0])
    args = make_args(output_rate_identity="api-key", output_rate_api_keys=keys_file)
    config = IdentityConfig.from_args(args)
    assert config.identify({"authorization": "Bearer sk-eve"}) == "eve"
    with open(keys_file, "w") as fh:
        fh.write("sk-new: newbie\n")
    clock[0] += 2
    assert config.identify({"authorization": "Bearer sk-new"}) == "newbie"
    with open(keys_file, "w") as fh:
        fh.write("{broken")
    clock[0] += 2
    assert config.identify({"authorization": "Bearer sk-new"}) == "newbie"
