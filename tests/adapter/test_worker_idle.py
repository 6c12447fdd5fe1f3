"""The model worker's short busy window (adapter/worker_idle.py).

With the feature on, while steps come far apart the worker's input queue
spins a few ms from the moment it starts waiting, then sleeps in vLLM's poll
until the engine writes; while they come back to back it spins as vLLM does.  These
tests drive vLLM's real shared-memory ``MessageQueue``: the wait decisions on
a fake clock, every message delivered between two threads (also after idle
gaps, with the reader parked and re-checking well within vLLM's 5 s; counted
on the reader's poller, no timing figure), and the patch reaching
``WorkerProc`` only with the feature on.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from vllm_output_rate import register

register()  # idempotent; installs every patch in this process

from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue  # noqa: E402
from vllm.v1.executor.multiproc_executor import WorkerProc  # noqa: E402

from vllm_output_rate.adapter import worker_idle  # noqa: E402
from vllm_output_rate.adapter.install import is_ours  # noqa: E402
from vllm_output_rate.adapter.patches import PATCHES  # noqa: E402
from vllm_output_rate.adapter.worker_idle import (  # noqa: E402
    SPIN_WINDOW_ENV,
    SPIN_WINDOW_S,
    shorten_spin,
    spin_window_s,
)

WINDOW = 0.005


def small_queue_pair() -> tuple[MessageQueue, MessageQueue]:
    """A writer and its one local reader (not yet handshaken), 4 small slots."""
    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    return writer, reader


def handshake(writer: MessageQueue, reader: MessageQueue) -> None:
    t = threading.Thread(target=writer.wait_until_ready)
    t.start()
    reader.wait_until_ready()
    t.join(timeout=30)
    assert not t.is_alive()


# -- wait decisions on a fake clock ------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class SpyPoller:
    """Stands in for the reader's zmq poller: records polls, returns no event."""

    def __init__(self) -> None:
        self.polls: list[int | None] = []

    def poll(self, timeout=None):
        self.polls.append(timeout)
        return []


@pytest.fixture
def fake_clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(shm_broadcast, "time", SimpleNamespace(monotonic=clock.monotonic))
    yields: list[float] = []
    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: yields.append(clock.now))
    return clock, yields


def spied_reader(shorten: bool):
    writer, reader = small_queue_pair()
    cond = reader._spin_condition
    if shorten:
        assert shorten_spin(reader, WINDOW)
    cond.poller = SpyPoller()
    return writer, reader, cond


def decisions(cond, clock: Clock, yields: list[float], steps) -> list[str]:
    """Run ``("read"|"wait", t)`` steps; return "yield"/"poll" per wait."""
    out = []
    for what, t in steps:
        clock.now = 1000.0 + t
        if what == "read":
            cond.record_read()
            continue
        n_yield, n_poll = len(yields), len(cond.poller.polls)
        cond.wait(timeout_ms=5000)
        if len(yields) > n_yield:
            out.append("yield")
        else:
            assert len(cond.poller.polls) == n_poll + 1
            out.append("poll")
    return out


# The engine sends steps back to back, then only every 0.5 s (a throttled
# user), then back to back again.
STEPS = [
    ("read", 0.000),
    ("wait", 0.001),    # busy engine: not armed, vLLM's 1 s window
    ("read", 0.002),
    ("wait", 0.100),    # a 98 ms forward pass later: the window starts now
    ("wait", 0.120),    # 20 ms into the wait: still spinning (not armed)
    ("wait", 1.050),    # 0.95 s in: still within vLLM's 1 s
    ("wait", 1.101),    # 1.001 s in: vLLM's own poll
    ("read", 1.500),    # that wait was long (1.4 s): armed until 2.5
    ("wait", 1.600),
    ("wait", 1.6049),
    ("wait", 1.6051),   # 5.1 ms in: armed, so poll
    ("read", 2.100),    # another long wait (0.5 s): armed until 3.1
    ("wait", 2.101),
    ("read", 2.102),    # short wait (back to back again)
    ("wait", 2.110),
    ("wait", 2.120),    # 10 ms in, still armed: poll
    ("read", 2.121),
    ("wait", 3.200),    # 1.1 s after the last long wait ended: disarmed
    ("wait", 3.220),    # 20 ms in: spinning, as vLLM does
]


def test_short_window_only_after_long_waits(fake_clock):
    clock, yields = fake_clock
    writer, reader, cond = spied_reader(shorten=True)
    assert decisions(cond, clock, yields, STEPS) == [
        "yield",
        "yield", "yield", "yield", "poll",
        "yield", "yield", "poll",
        "yield",
        "yield", "poll",
        "yield", "yield",
    ]
    # While the short window applies, vLLM's poll re-checks the ring every
    # 50 ms instead of its own 5 s: a missed wake-up cannot hold a step for
    # seconds.  Not armed (the wait at 1.101), the timeout is vLLM's own.
    assert cond.poller.polls == [5000, 50, 50]


def test_stock_reader_spins_for_a_second_after_each_read(fake_clock):
    """The behaviour the patch keeps for a busy engine (feature off here)."""
    clock, yields = fake_clock
    writer, reader, cond = spied_reader(shorten=False)
    assert cond.busy_loop_s == 1
    assert decisions(cond, clock, yields, STEPS) == [
        "yield",
        "yield", "yield", "poll", "poll",   # 1 s after the read at 0.002
        "yield", "yield", "yield",
        "yield",
        "yield", "yield",
        "poll", "poll",                     # > 1 s after the read at 2.121
    ]


def test_a_stream_after_a_pause_disarms_within_a_few_reads(fake_clock):
    """One client's stream: a long wait (the pause before the request), then
    reads back to back.  The short window holds for the first reads only;
    from BUSY_RUN short reads on, a slow turnaround (10 ms here) spins as in
    stock vLLM instead of parking mid-stream.  The next long wait re-arms."""
    clock, yields = fake_clock
    writer, reader, cond = spied_reader(shorten=True)
    steps = [("wait", 0.0), ("read", 0.2)]  # the pause: a 200 ms wait
    t = 0.2
    for _ in range(worker_idle.BUSY_RUN + 2):
        steps += [("wait", t + 0.0001), ("wait", t + 0.0101), ("read", t + 0.0102)]
        t += 0.0102
    steps += [("wait", t + 0.001), ("wait", t + 0.3), ("read", t + 0.3)]  # a long wait again
    steps += [("wait", t + 0.3001), ("wait", t + 0.3101)]
    got = decisions(cond, clock, yields, steps)
    assert got[0] == "yield"  # vLLM's window before the first long wait
    per_read = [got[1 + 2 * i: 3 + 2 * i] for i in range(worker_idle.BUSY_RUN + 2)]
    # The reads after the long one: read k waits with k short reads behind it.
    assert per_read[: worker_idle.BUSY_RUN] == [["yield", "poll"]] * worker_idle.BUSY_RUN
    assert per_read[worker_idle.BUSY_RUN:] == [["yield", "yield"]] * 2
    assert got[-4:] == ["yield", "yield", "yield", "poll"]  # re-armed by the long wait


def test_shorten_spin_is_idempotent_and_only_for_shm_readers():
    writer, reader = small_queue_pair()
    assert not shorten_spin(writer, WINDOW)      # the writer does not wait
    assert not shorten_spin(None, WINDOW)
    assert shorten_spin(reader, WINDOW)
    wait = reader._spin_condition.wait
    assert shorten_spin(reader, 0.002)
    assert reader._spin_condition.wait is wait   # not wrapped twice
    assert reader._spin_condition._vllm_output_rate_short_spin["window"] == 0.002


# -- real queue between two threads ------------------------------------------------


class CountingPoller:
    """The reader's real zmq poller, counting the polls and the timeout of each."""

    def __init__(self, poller) -> None:
        self._poller = poller
        self.timeouts: list[int | None] = []

    def poll(self, timeout=None):
        self.timeouts.append(timeout)
        return self._poller.poll(timeout=timeout)

    def __getattr__(self, name):
        return getattr(self._poller, name)


def test_every_message_arrives_in_bursts_and_after_idle_gaps():
    writer, reader = small_queue_pair()
    assert shorten_spin(reader, WINDOW)
    handshake(writer, reader)
    poller = CountingPoller(reader._spin_condition.poller)
    reader._spin_condition.poller = poller

    burst, spaced, gap_s = 300, 6, 0.25
    total = burst + spaced
    received: list[int] = []
    polls_before: dict[int, int] = {}  # message -> polls the reader made before reading it
    failure: list[BaseException] = []

    def read_all():
        try:
            for _ in range(total):
                msg = reader.dequeue(timeout=20)
                polls_before[msg] = len(poller.timeouts)
                received.append(msg)
        except BaseException as exc:  # reported by the main thread
            failure.append(exc)

    t = threading.Thread(target=read_all)
    t.start()
    # Burst: 300 messages through 4 slots, so the writer keeps waiting for
    # the reader and the reader keeps finding the next one while spinning.
    for i in range(burst):
        writer.enqueue(i, timeout=20)
    for i in range(burst, total):
        time.sleep(gap_s)  # far longer than the window: the reader parks
        writer.enqueue(i, timeout=20)
    t.join(timeout=60)
    assert not t.is_alive() and not failure, failure

    assert received == list(range(total))
    # The wait before the first spaced message armed the short window, so
    # from there on the reader parked in vLLM's poll between messages, where
    # stock vLLM (1 s after each read) would have spun through each gap.
    parked = [polls_before[i + 1] - polls_before[i] for i in range(burst, total - 1)]
    assert all(n >= 1 for n in parked), parked
    # Every park re-checked the ring within PARKED_RECHECK_S, never after
    # vLLM's 5 s: a message whose notification is missed cannot wait long.
    recheck_ms = int(worker_idle.PARKED_RECHECK_S * 1000)
    spaced_polls = poller.timeouts[polls_before[burst]:]
    assert spaced_polls and all(
        timeout is not None and timeout <= recheck_ms for timeout in spaced_polls
    ), spaced_polls


# -- reaching the worker process -----------------------------------------------------


def test_patch_is_registered():
    assert PATCHES["worker.idle_spin"].install is worker_idle.install_worker_idle
    assert is_ours(WorkerProc._init_message_queues)


@pytest.fixture(scope="module")
def configs(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    def make(additional):
        config = EngineArgs(
            model=tiny_model_dir, max_model_len=256, additional_config=additional
        ).create_engine_config()
        # The executor pickles the config into the worker process.
        return pickle.loads(pickle.dumps(config))

    return {
        "on": make({"output_rate": {"default_user_output_tokens_per_second": 5}}),
        "off": make({}),
    }


@pytest.mark.parametrize(
    "feature, override, shortened",
    [("on", None, True), ("off", None, False), ("on", "off", False)],
    ids=["feature-on", "feature-off", "feature-on-override-off"],
)
def test_worker_input_queue_follows_the_feature(configs, monkeypatch, feature, override, shortened):
    if override is None:
        monkeypatch.delenv(SPIN_WINDOW_ENV, raising=False)
    else:
        monkeypatch.setenv(SPIN_WINDOW_ENV, override)
    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    proc = WorkerProc.__new__(WorkerProc)
    proc.worker = SimpleNamespace(rank=0)
    WorkerProc._init_message_queues(proc, writer.export_handle(), configs[feature])
    cond = proc.rpc_broadcast_mq._spin_condition
    if shortened:
        assert cond._vllm_output_rate_short_spin["window"] == SPIN_WINDOW_S
        assert "wait" in vars(cond)
    else:
        assert not hasattr(cond, "_vllm_output_rate_short_spin")
        assert "wait" not in vars(cond)
    assert cond.busy_loop_s == 1  # vLLM's window until a long wait arms the short one
    # The response queue (read by the engine core) is never touched.
    assert proc.worker_response_mq._spin_condition.is_reader is False
    proc.rpc_broadcast_mq.shutdown()


def test_general_plugin_loading_installs_the_patch_in_a_fresh_process():
    """What a spawned worker does in ``WorkerWrapperBase.init_worker``."""
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.v1.executor.multiproc_executor import WorkerProc\n"
        "print(getattr(WorkerProc._init_message_queues, '_vllm_output_rate_patch', False))\n"
    )
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_window_override(monkeypatch):
    monkeypatch.delenv(SPIN_WINDOW_ENV, raising=False)
    assert spin_window_s() == SPIN_WINDOW_S
    monkeypatch.setenv(SPIN_WINDOW_ENV, "2")
    assert spin_window_s() == 0.002
    monkeypatch.setenv(SPIN_WINDOW_ENV, "0")
    assert spin_window_s() == 0.0
    monkeypatch.setenv(SPIN_WINDOW_ENV, "off")
    assert spin_window_s() is None
    for bad in ("abc", "-1", "nan", "inf"):
        monkeypatch.setenv(SPIN_WINDOW_ENV, bad)
        with pytest.raises(ValueError, match=SPIN_WINDOW_ENV):
            spin_window_s()
