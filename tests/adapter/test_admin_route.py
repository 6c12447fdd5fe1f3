"""The admin route ``GET /v1/output_rate/users`` on a bare FastAPI app (vLLM's own kind), through starlette's TestClient.

Closed by default (403 without a configured key), a key from the flag, a file
or the environment (401 for a missing or wrong one), open only on request; the
key never shows in what vLLM logs at startup.  The engine behind the route is a
stub answering the utility call, so no model runs.
"""

from __future__ import annotations

import argparse
import logging
import pickle

import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from vllm_output_rate.adapter.admin import (  # noqa: E402
    ADMIN_KEY_ENV,
    ROUTE,
    UTILITY,
    AdminAccess,
    OutputRateAdminPlugin,
)
from vllm_output_rate.adapter.options import merge_operate_args  # noqa: E402
from vllm_output_rate.adapter.patches import add_output_rate_args  # noqa: E402
from vllm_output_rate.settings import OutputRateConfigError  # noqa: E402

SNAPSHOT = {"default_rate": 20.0, "users": {"alice": {"rate": 20.0}}}
SECRET = "admin-s3cret-value"


class StubEngineCore:
    def __init__(self, answer):
        self.answer = answer
        self.calls = []

    async def call_utility_async(self, name):
        self.calls.append(name)
        return self.answer


class StubEngineClient:
    def __init__(self, answer=SNAPSHOT):
        self.engine_core = StubEngineCore(answer)


def parse(argv):
    parser = argparse.ArgumentParser()
    add_output_rate_args(parser)
    return parser.parse_args(argv)


def client_for(argv, monkeypatch, env=None, answer=SNAPSHOT):
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    args = parse(argv)
    app = FastAPI()
    plugin = OutputRateAdminPlugin()
    plugin.attach_router(app)
    engine = StubEngineClient(answer)
    import asyncio

    asyncio.run(plugin.init_state(engine, app.state, args))
    app.state.args = args
    return TestClient(app), engine


def get(client, key=None, scheme="Bearer"):
    headers = {"Authorization": f"{scheme} {key}"} if key is not None else {}
    return client.get(ROUTE, headers=headers)


def assert_refused(response, status, words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and words in error["message"]


def test_without_a_key_the_route_is_closed_and_the_engine_not_asked(monkeypatch):
    client, engine = client_for(["--default-user-output-tokens-per-second", "20"], monkeypatch)
    response = get(client)
    assert_refused(response, 403, "closed")
    # The refusal names every way to open it.
    for name in ("--output-rate-admin-key", "--output-rate-admin-key-file", ADMIN_KEY_ENV,
                 "--output-rate-admin-open"):
        assert name in response.json()["error"]["message"]
    assert_refused(get(client, key="anything"), 403, "closed")
    assert engine.engine_core.calls == []


def test_open_on_request_only(monkeypatch):
    client, engine = client_for(["--output-rate-admin-open"], monkeypatch)
    response = get(client)
    assert response.status_code == 200 and response.json() == SNAPSHOT
    assert engine.engine_core.calls == [UTILITY]


@pytest.mark.parametrize("source", ["flag", "file", "env"])
def test_the_key_from_each_source_is_required(monkeypatch, tmp_path, source):
    argv, env = [], {}
    if source == "flag":
        argv = ["--output-rate-admin-key", SECRET]
    elif source == "file":
        path = tmp_path / "admin.key"
        path.write_text(SECRET + "\n")  # a trailing newline is not part of the key
        argv = ["--output-rate-admin-key-file", str(path)]
    else:
        env = {ADMIN_KEY_ENV: SECRET}
    client, engine = client_for(argv, monkeypatch, env=env)
    assert_refused(get(client), 401, "admin key")
    assert get(client).headers["www-authenticate"] == "Bearer"
    assert_refused(get(client, key=SECRET + "x"), 401, "admin key")
    assert_refused(get(client, key=SECRET, scheme="Basic"), 401, "admin key")
    assert engine.engine_core.calls == []
    ok = get(client, key=SECRET)
    assert ok.status_code == 200 and ok.json() == SNAPSHOT
    assert get(client, key=SECRET, scheme="bearer").status_code == 200


def test_feature_off_is_404_behind_the_key(monkeypatch):
    client, _ = client_for(["--output-rate-admin-key", SECRET], monkeypatch, answer=None)
    assert_refused(get(client), 401, "admin key")
    assert_refused(get(client, key=SECRET), 404, "off")


def test_the_flag_wins_over_the_environment(monkeypatch):
    client, _ = client_for(["--output-rate-admin-key", SECRET], monkeypatch,
                           env={ADMIN_KEY_ENV: "from-env"})
    assert get(client, key=SECRET).status_code == 200
    assert_refused(get(client, key="from-env"), 401, "admin key")


@pytest.mark.parametrize("argv, words", [
    (["--output-rate-admin-key", SECRET, "--output-rate-admin-key-file", "k"], "give one of them"),
    (["--output-rate-admin-key", SECRET, "--output-rate-admin-open"], "contradict"),
    (["--output-rate-admin-key-file", "/nonexistent/admin.key"], "cannot be read"),
])
def test_contradictions_and_unreadable_files_stop_startup(argv, words, monkeypatch):
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    args = parse(argv + ["--default-user-output-tokens-per-second", "20"])
    with pytest.raises(OutputRateConfigError, match=words):
        merge_operate_args(args, {"default_user_output_tokens_per_second": 20.0})


def test_an_empty_key_file_stops_startup(tmp_path, monkeypatch):
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    path = tmp_path / "empty"
    path.write_text("\n")
    with pytest.raises(OutputRateConfigError, match="--output-rate-admin-key-file .*empty"):
        AdminAccess.from_args(parse(["--output-rate-admin-key-file", str(path)]))


def test_the_key_never_shows_in_vllms_startup_log(monkeypatch, caplog):
    """vLLM logs its non-default args (the dict's repr) before anything else runs."""
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    import vllm_output_rate

    vllm_output_rate.register()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_output_rate.adapter import compat, patches

    try:  # vLLM 0.32
        from vllm.entrypoints.serve.utils.api_utils import log_non_default_args
    except ImportError:  # moved in 0.33
        from vllm.entrypoints.common.startup import log_non_default_args
    monkeypatch.setattr(patches, "_frontend_active", patches._frontend_active)
    parser = compat.installed_series().make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(["--default-user-output-tokens-per-second", "20",
                              "--output-rate-admin-key", SECRET])
    records = []
    # vLLM's own logger, whatever its handlers and level: capture what it is asked to write.
    vllm_logger = log_non_default_args.__globals__["logger"]
    monkeypatch.setattr(vllm_logger, "info", lambda msg, *a, **k: records.append(msg % a))
    log_non_default_args(args)
    logged = "\n".join(records)
    assert "output_rate_admin_key" in logged  # the line was written, and names the flag
    assert SECRET not in logged
    assert SECRET not in repr(args) and SECRET not in str(args)
    # The value itself is intact for the route, also after pickling to another API server.
    key = pickle.loads(pickle.dumps(args.output_rate_admin_key))
    assert AdminAccess.from_args(argparse.Namespace(output_rate_admin_key=key)).key == SECRET


def test_admin_flags_warn_in_one_line_while_the_feature_is_off(monkeypatch, caplog):
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="vllm_output_rate.adapter.options"):
        assert merge_operate_args(parse(["--output-rate-admin-key", SECRET]), None) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "--output-rate-admin-key does nothing" in lines[0]
    assert SECRET not in lines[0]
