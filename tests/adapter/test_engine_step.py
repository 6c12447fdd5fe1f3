"""The engine-core step with the rate-limited scheduler, on every supported series.

vLLM's own ``EngineCoreProc._process_engine_step`` and ``EngineCore.step`` run
(with the plugin's ``engine_core.idle_wait`` patch) on an engine-core object
built without a model: the scheduler is the real ``OutputRateScheduler`` of
``vllm_output_rate_harness.scheduler_sim``, the model executor a stub that samples one token
per request at its sampling position, and the input queue a recording fake
that answers at once (no test here sleeps).

Checked: after a step that ran nothing because every request was throttled,
the engine waits on its input queue with a timeout of at most
``gate.MAX_IDLE_WAIT_NS`` (250 ms); on
series with an engine watchdog (0.33+) that wait runs with the watchdog
disabled, exactly as vLLM's own idle wait, and the watchdog is active again
afterwards; a request that arrives during the wait is handled at once.
"""

from __future__ import annotations

import logging
import queue
from concurrent.futures import Future

import pytest
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.outputs import ModelRunnerOutput

from vllm_output_rate.adapter import compat
from vllm_output_rate.policy.gate import MAX_IDLE_WAIT_NS
from vllm_output_rate_harness.scheduler_sim import MS, TOKEN, Harness

SERIES = compat.installed_series()
LIMITS = {
    "default_user_output_tokens_per_second": 1000,
    "user_output_tokens_per_second": {"slow": 1},
}


class StubExecutor:
    """Stands in for the model: one sampled token per request at its sampling position."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.executed: list[int] = []  # total tokens of each executed step
        self._pending = None

    def execute_model(self, scheduler_output, non_block: bool = False):
        self._pending = scheduler_output
        self.executed.append(scheduler_output.total_num_scheduled_tokens)
        future: Future = Future()
        future.set_result(None)  # "sample separately", as the GPU runner does
        return future

    def sample_tokens(self, grammar_output):
        output, self._pending = self._pending, None
        req_ids = list(output.num_scheduled_tokens)
        requests = self.scheduler.requests
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[
                [] if requests[rid].is_prefill_chunk else [TOKEN] for rid in req_ids
            ],
        )


class RecordingQueue(queue.Queue):
    """The engine's input queue: records each blocking get, answers at once."""

    def __init__(self, watchdog=None) -> None:
        super().__init__()
        self.watchdog = watchdog
        self.gets: list[tuple[float | None, bool | None]] = []

    def get(self, block: bool = True, timeout: float | None = None):
        if block:
            active = None if self.watchdog is None else self.watchdog.active
            self.gets.append((timeout, active))
        return super().get(block=False)  # never sleeps: Empty or the queued item


def make_engine_core(harness: Harness, input_queue: queue.Queue) -> EngineCoreProc:
    """An ``EngineCoreProc`` with the attributes its step path reads, and no model."""
    core = object.__new__(EngineCoreProc)
    core.scheduler = harness.sched
    core.vllm_config = harness.config
    core.model_executor = StubExecutor(harness.sched)
    core.log_stats = False
    core.aborts_queue = queue.Queue()
    core._weight_version = "default"
    core.check_for_draft_tokens = False
    core.async_scheduling = False
    core.step_fn = core.step
    core.output_queue = queue.Queue()
    core.input_queue = input_queue
    core.handled = []
    core._handle_client_request = lambda *request: core.handled.append(request)
    return core


@pytest.fixture()
def watchdog(monkeypatch, tmp_path):
    """vLLM's real threaded watchdog as the process-wide one (thread not started)."""
    if not SERIES.engine_watchdog:
        return None
    from vllm.config import WatchdogConfig
    from vllm.utils import watch_dog

    dog = watch_dog.ThreadedWatchDog(
        "engine_test", WatchdogConfig(dump_dir=str(tmp_path)), logging.getLogger("test")
    )
    monkeypatch.setattr(watch_dog, "_watch_dog", dog)
    return dog


def _throttled_engine(watchdog):
    harness = Harness(LIMITS)
    inputs = RecordingQueue(watchdog)
    core = make_engine_core(harness, inputs)
    harness.add("slow", prompt_len=8, max_tokens=20)
    return harness, core, inputs


def test_series_declares_the_watchdog_it_has():
    import importlib.util

    assert SERIES.engine_watchdog == (importlib.util.find_spec("vllm.utils.watch_dog") is not None)


def test_throttled_step_waits_on_the_input_queue_outside_the_watchdog(watchdog):
    harness, core, inputs = _throttled_engine(watchdog)

    assert core._process_engine_step() is True  # prefill + first token (the burst)
    assert inputs.gets == []
    executed_before = list(core.model_executor.executed)

    harness.clock.advance(10 * MS)
    assert core._process_engine_step() is False  # "slow" is out of quota
    assert core.model_executor.executed == executed_before + [0]

    assert len(inputs.gets) == 1, "an all-throttled step must wait on the input queue"
    timeout, active_during_wait = inputs.gets[0]
    assert timeout is not None and 0 < timeout <= MAX_IDLE_WAIT_NS / 1e9
    if watchdog is not None:
        assert active_during_wait is False, "the idle wait ran inside the watchdog's window"
        assert watchdog.active is True, "the watchdog must be active again after the wait"
    assert core.handled == []


def test_request_arriving_during_the_wait_is_handled_at_once(watchdog):
    harness, core, inputs = _throttled_engine(watchdog)
    core._process_engine_step()
    harness.clock.advance(10 * MS)
    inputs.put(("ADD", "new request"))

    assert core._process_engine_step() is False
    assert core.handled == [("ADD", "new request")]
    if watchdog is not None:
        assert watchdog.active is True


def test_watchdog_is_fed_by_each_step_and_left_active(watchdog):
    if watchdog is None:
        pytest.skip(f"vLLM {SERIES.name} has no engine watchdog")
    harness, core, inputs = _throttled_engine(watchdog)
    watchdog.last_feed_time = 0.0
    core._process_engine_step()
    assert watchdog.last_feed_time > 0.0
    for _ in range(5):
        harness.clock.advance(10 * MS)
        watchdog.last_feed_time = 0.0
        assert core._process_engine_step() is False
        assert watchdog.last_feed_time > 0.0 and watchdog.active is True
    assert [active for _, active in inputs.gets] == [False] * 5


def test_step_that_ran_the_model_does_not_wait(watchdog):
    harness = Harness(LIMITS)
    inputs = RecordingQueue(watchdog)
    core = make_engine_core(harness, inputs)
    harness.add("fast", prompt_len=8, max_tokens=5)
    for _ in range(5):  # prefill + first token, then four decode steps
        assert core._process_engine_step() is True
        harness.clock.advance(10 * MS)
    for _ in range(3):  # vLLM may need an empty step to retire the finished request
        if not harness.sched.has_requests():
            break
        core._process_engine_step()
    assert not harness.sched.has_requests()
    assert inputs.gets == [], "nobody was throttled: no idle wait"
    outputs = []
    while not core.output_queue.empty():
        outputs.append(core.output_queue.get_nowait())
    tokens = [t for _, eco in outputs for o in eco.outputs for t in o.new_token_ids]
    assert tokens == [TOKEN] * 5
