"""Shared fixtures.  The tiny model is generated once if it is missing.

Suite layout for speed (the whole suite must stay well under 8 minutes on a
2-core machine): the servers of the modules in :data:`PRESTARTED` start in
the background when the session begins (see ``server_harness.ServerPool``),
while the model-free folders collected before ``tests/server`` (adapter,
config, policy) run; the modules in :data:`RUN_LAST` run after everything
else, alone on the machine, so several engines do not compete with other
servers for the two cores.

Markers (``pytest -m``): ``server`` (a real ``vllm-output-rate serve``; set
by the modules that start one), ``cluster`` (several engines on one quota)
and ``redis`` (a real redis-server), the last one set here for every test of
a module that uses ``redis_harness``, so the store tests need no marker of
their own.
"""

from __future__ import annotations

import inspect
import os

import pytest
from hypothesis import settings

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from server_harness import TINY_MODEL_DIR, ServerDied, ServerPool  # noqa: E402

# Property tests judge behaviour, never speed: no per-example deadline, also
# while servers start on the other core.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

# Modules are named by their file's basename (``item.path.stem``), whichever
# folder of tests/ holds them.

#: Modules with a ``server_context(tmp_path_factory, model_dir)`` whose
#: server(s) start when the session begins.
PRESTARTED = (
    "test_e2e_server",
    "test_operate_server",
    "test_lora_server",
    "test_prompt_cost_server",
    "test_spec_decode_server",
    "test_server_death",
    "test_prometheus_server",
)
#: Modules that run last, when no other server is up.
RUN_LAST = ("test_cluster_server", "test_data_parallel_server")
#: Modules with a ``server_context`` whose server(s) start in the background
#: as soon as every PRESTARTED module is done (their servers stopped): the
#: startup then overlaps the model-free tests that remain instead of adding
#: to the end of the suite.
PRESTARTED_LATE = ("test_cluster_server", "test_data_parallel_server")


#: Where a real redis-server comes from: a module holding one of these
#: modules' names needs it.
REDIS_SOURCES = ("redis_harness", "vllm_output_rate.tools.redisproc")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if _needs_redis(item) and item.get_closest_marker("redis") is None:
            item.add_marker(pytest.mark.redis)
    items.sort(key=lambda item: _module_name(item) in RUN_LAST)  # stable: order kept otherwise


def _module_name(item) -> str:
    return item.path.stem if getattr(item, "module", None) is not None else ""


def _needs_redis(item) -> bool:
    module = getattr(item, "module", None)
    if module is None:
        return False
    return any(
        (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ in REDIS_SOURCES
        for value in vars(module).values()
    )


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    from vllm_output_rate.tools.tiny_model import is_tiny_model_dir, write_tiny_model

    if not is_tiny_model_dir(TINY_MODEL_DIR):
        write_tiny_model(TINY_MODEL_DIR)
    return str(TINY_MODEL_DIR)


@pytest.fixture(scope="session")
def long_context_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model's config and tokenizer with 8192 positions (no weights):
    for scheduler-only tests with prompts longer than the tiny model's 2048."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("long-context-model")
    for name in os.listdir(tiny_model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_model_dir, name), folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = 8192
    config_path.write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def server_log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("server-logs")


#: The session's pool, for the report hook below (hooks cannot take fixtures).
_POOL: list[ServerPool] = []


@pytest.fixture(scope="session")
def server_pool():
    pool = ServerPool()
    _POOL.append(pool)
    yield pool
    _POOL.remove(pool)
    pool.close()


@pytest.fixture(autouse=True)
def _servers_alive(request, server_pool):
    """Before each test of a module with servers: every server its module
    fixture holds is still running, else the test fails at once with the
    server's log tail (module fixtures are set up before this one, so the
    servers are those the test is about to use)."""
    if request.node.get_closest_marker("server") is not None:
        for server in server_pool.servers(request.module.__name__):
            server.check_alive()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test of a module whose server has died says so, with the log tail."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or not _POOL or item.get_closest_marker("server") is None:
        return
    for server in _POOL[0].servers(item.module.__name__):
        try:
            server.check_alive()
        except ServerDied as died:
            report.sections.append((f"server {server.log_path.stem} died", str(died)))


@pytest.fixture(scope="session", autouse=True)
def _prestart_servers(request, server_pool, tmp_path_factory):
    """Start the servers of every selected module in PRESTARTED, in the background."""
    _prestart(request, server_pool, tmp_path_factory, PRESTARTED)


@pytest.fixture(scope="module", autouse=True)
def _prestart_late_servers(request, server_pool, tmp_path_factory):
    """At the first module after the last PRESTARTED one, start PRESTARTED_LATE's servers."""
    items = request.session.items
    first_here = next(i for i, item in enumerate(items) if item.module is request.module)
    if not any(_module_name(item) in PRESTARTED for item in items[first_here:]):
        _prestart(request, server_pool, tmp_path_factory, PRESTARTED_LATE)


def _prestart(request, server_pool, tmp_path_factory, names) -> None:
    """Begin starting the servers of the selected modules named in ``names``
    (a module already begun is left alone)."""
    # Keyed by the module's own __name__: its fixture asks the pool for that key.
    modules = {
        item.module.__name__: item.module
        for item in request.session.items
        if _module_name(item) in names
    }
    if not modules:
        return
    model_dir = request.getfixturevalue("tiny_model_dir")
    # Create the session's base temp dir here, before any thread asks for it:
    # two threads creating it at once made two of them (and tests saw errors).
    tmp_path_factory.getbasetemp()
    for name, module in modules.items():
        server_pool.prestart(
            name, lambda module=module: module.server_context(tmp_path_factory, model_dir)
        )
