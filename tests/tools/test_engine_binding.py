"""Each engine started beside others on one machine gets its own CPU binding.

vLLM's CPU backend binds every engine's model worker to the same CPUs unless
``VLLM_CPU_OMP_THREADS_BIND`` says otherwise; these tests check the mapping
(engine index -> CPU list) and the environment the harness hands each engine,
without starting vLLM.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from vllm_output_rate.tools import runkit
from vllm_output_rate.tools.serverproc import CPU_BINDING_VAR, engine_cpu_binding, engine_env

TWO_CPUS = [0, 1]


def cpus_of(binding: str) -> set[int]:
    """The CPU ids a binding names (the syntax vLLM parses: ``0-2,5``)."""
    ids: set[int] = set()
    for part in binding.split(","):
        first, _, last = part.partition("-")
        ids.update(range(int(first), int(last or first) + 1))
    return ids


@pytest.mark.parametrize("engines, expected", [
    (2, ["0", "1"]),
    (3, ["0", "1", "0"]),
    (4, ["0", "1", "0", "1"]),
])
def test_more_engines_than_cpus_go_round_robin(engines, expected):
    assert [engine_cpu_binding(i, engines, TWO_CPUS) for i in range(engines)] == expected


@pytest.mark.parametrize("engines, cpus, expected", [
    (2, range(8), ["0-3", "4-7"]),
    (3, range(8), ["0-2", "3-5", "6-7"]),
    (2, [0, 2, 4, 6, 7], ["0,2,4", "6-7"]),
    (1, range(4), ["0-3"]),
])
def test_more_cpus_than_engines_gives_disjoint_slices(engines, cpus, expected):
    bindings = [engine_cpu_binding(i, engines, list(cpus)) for i in range(engines)]
    assert bindings == expected
    slices = [cpus_of(b) for b in bindings]
    assert set().union(*slices) == set(cpus)  # every CPU used
    assert sum(map(len, slices)) == len(set(cpus))  # none twice


def test_cpus_default_to_those_this_process_may_use():
    import os

    allowed = sorted(os.sched_getaffinity(0))
    assert cpus_of(engine_cpu_binding(0, 1)) == set(allowed)


@pytest.mark.parametrize("index, engines", [(2, 2), (-1, 2), (0, 0)])
def test_an_index_outside_the_engines_is_refused(index, engines):
    with pytest.raises(ValueError):
        engine_cpu_binding(index, engines, TWO_CPUS)


def test_each_engine_env_names_its_own_cpus_and_keeps_the_callers_env():
    envs = [engine_env(i, 2, {"VLLM_PLUGINS": "x"}, environ={}, cpus=TWO_CPUS) for i in range(2)]
    assert [e[CPU_BINDING_VAR] for e in envs] == ["0", "1"]
    assert all(e["VLLM_PLUGINS"] == "x" for e in envs)


def test_an_operators_binding_wins():
    from_environ = engine_env(1, 2, environ={CPU_BINDING_VAR: "nobind"}, cpus=TWO_CPUS)
    assert CPU_BINDING_VAR not in from_environ  # the server inherits the operator's value
    from_env = engine_env(1, 2, {CPU_BINDING_VAR: "0-1"}, environ={}, cpus=TWO_CPUS)
    assert from_env[CPU_BINDING_VAR] == "0-1"


def test_a_lone_engine_keeps_vllms_binding():
    assert engine_env(0, 1, {"A": "1"}, environ={}, cpus=TWO_CPUS) == {"A": "1"}


# -- runkit.running_engines: what each engine of an N-engine start gets ---------------


@pytest.fixture
def started_envs(monkeypatch):
    """Each start's ``env``, with the server start replaced by a stand-in."""
    seen: dict[str, dict] = {}

    @contextlib.contextmanager
    def fake_running_server(args, log_dir, name, model=None, command=None, env=None):
        seen[name] = dict(env or {})
        yield object()

    monkeypatch.setattr(runkit, "running_server", fake_running_server)
    monkeypatch.delenv(CPU_BINDING_VAR, raising=False)
    return seen


def test_engines_side_by_side_each_get_their_own_binding(started_envs, tmp_path):
    specs = [(f"engine{i}", []) for i in range(3)]
    with runkit.running_engines(specs, tmp_path, env={"VLLM_PLUGINS": "x"}, side_by_side=True) as started:
        bindings = [server.cpu_binding for server in started]
    assert bindings == [started_envs[name][CPU_BINDING_VAR] for name, _ in specs]
    assert all(started_envs[name]["VLLM_PLUGINS"] == "x" for name, _ in specs)
    if len(runkit.os.sched_getaffinity(0)) >= 2:
        assert len(set(bindings[:2])) == 2  # the first two engines never share a CPU


def test_engines_one_after_another_keep_vllms_binding_unless_asked(started_envs, tmp_path):
    specs = [("stock", []), ("plugin", [])]
    with runkit.running_engines(specs, tmp_path) as started:
        assert [server.cpu_binding for server in started] == [None, None]
    assert all(CPU_BINDING_VAR not in env for env in started_envs.values())
    with runkit.running_engines(specs, tmp_path, own_cpus=True) as started:
        assert all(server.cpu_binding for server in started)


def test_an_operators_binding_reaches_every_engine_unchanged(started_envs, tmp_path, monkeypatch):
    monkeypatch.setenv(CPU_BINDING_VAR, "0-1")
    with runkit.running_engines([("a", []), ("b", [])], tmp_path, side_by_side=True) as started:
        assert [server.cpu_binding for server in started] == ["0-1", "0-1"]
    assert all(CPU_BINDING_VAR not in env for env in started_envs.values())


def test_one_engine_alone_keeps_vllms_binding(started_envs, tmp_path):
    with runkit.running_engines([("only", [])], tmp_path, side_by_side=True) as (server,):
        assert server.cpu_binding is None


# -- what demo-cluster records ----------------------------------------------------------


def test_worker_cpus_of_a_process_without_model_workers_is_empty():
    # A process of its own: the suite's own process may have servers (and
    # their model workers) below it while this runs.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert runkit.worker_cpus(child.pid) == []
    finally:
        child.kill()
        child.wait()


def test_demo_cluster_block_says_where_each_model_worker_ran():
    from vllm_output_rate.tools.demo_cluster import worker_placement

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    placed = worker_placement({urls[0]: [[0]], urls[1]: [[1]]}, urls)
    assert placed == "Model workers: engine 1: CPU 0; engine 2: CPU 1."
    assert worker_placement(None, urls) == ""  # a run recorded before bindings
