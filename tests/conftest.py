"""Shared fixtures.  The tiny model is generated once if it is missing.

Suite layout for speed (the whole suite must stay well under 8 minutes on a
2-core machine): the servers of the modules in :data:`PRESTARTED` start in
the background when the session begins (see ``server_harness.ServerPool``),
and the modules in :data:`RUN_LAST` run after everything else, alone on the
machine, since they judge rates across several engines.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from server_harness import TINY_MODEL_DIR, ServerPool  # noqa: E402

# Property tests judge behaviour, never speed: no per-example deadline, also
# while servers start on the other core.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

#: Modules with a ``server_context(tmp_path_factory, model_dir)`` whose
#: server(s) start when the session begins.
PRESTARTED = ("test_e2e_server", "test_operate_server")
#: Modules that run last, when no other server is up.
RUN_LAST = ("test_cluster_server",)
#: Modules with a ``server_context`` whose server(s) start in the background
#: as soon as every PRESTARTED module is done (their servers stopped): the
#: startup then overlaps the model-free tests that remain instead of adding
#: to the end of the suite.
PRESTARTED_LATE = ("test_cluster_server",)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: _module_name(item) in RUN_LAST)  # stable: order kept otherwise


def _module_name(item) -> str:
    module = getattr(item, "module", None)
    return module.__name__ if module is not None else ""


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    from vllm_output_rate.tools.tiny_model import is_tiny_model_dir, write_tiny_model

    if not is_tiny_model_dir(TINY_MODEL_DIR):
        write_tiny_model(TINY_MODEL_DIR)
    return str(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def server_log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def server_pool():
    pool = ServerPool()
    yield pool
    pool.close()


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
