"""Let the model worker sleep between steps that are far apart.

vLLM's multiprocess executor sends every step to its model worker through a
shared-memory ring (``MessageQueue``).  The worker's reader side
(``SpinCondition.wait``) keeps spinning on ``sched_yield`` until
``busy_loop_s`` (1 s) has passed since its *last read*, and only then parks in
a zmq poll that the writer's per-write notification wakes.  A user throttled
to a few tokens per second still makes the engine run a step more often than
once a second, so with stock vLLM the worker process never parks and burns a
core while every user is out of quota.

With the feature on, :func:`shorten_spin` changes this on the worker's
*input* queue only, and only while the engine is trickling:

* the busy window starts when the worker starts *waiting* for the next step
  (the first ``wait`` after a read), not when it read the previous one: a
  long forward pass no longer uses the window up;
* the window is :data:`SPIN_WINDOW_S` (a few ms) instead of vLLM's 1 s, but
  only while the worker has recently (within :data:`ARMED_S`) waited at
  least :data:`LONG_GAP_S` for a step -- as it does between the steps of
  throttled users (the engine's idle wait is up to 250 ms, a 2 tok/s user
  gets a step every 0.5 s).  An engine that sends steps back to back never
  arms it, and its worker spins exactly as in stock vLLM: a worker that
  sleeps whenever the engine's turnaround is a little slow loses its CPU
  share to other processes, and throughput with it.  Nor does a stream that
  starts after a pause keep it armed: :data:`BUSY_RUN` reads in a row
  without a long wait before them (a few tokens of one stream) disarm it
  until the next long wait, so a single client whose requests come a little
  apart does not park mid-stream.

After the window the worker waits in vLLM's own poll, which every write
wakes (``MessageQueue.enqueue`` notifies after each write, and a stale
notification only causes one extra flag check).  While the short window
applies, that poll re-checks the ring at least every :data:`PARKED_RECHECK_S`
instead of vLLM's 5 s: the worker parks far more often than in stock vLLM,
so a write whose notification did not wake it must cost one short re-check,
not a step held for seconds.  Twenty wake-ups a second cost next to nothing.

Where: ``WorkerProc._init_message_queues`` in the worker process, which has
the ``VllmConfig`` (pickled to the worker with ``additional_config``) and
runs after ``WorkerWrapperBase.init_worker`` has loaded the general plugins
(the ``worker.idle_spin`` patch of :data:`.patches.PATCHES` included).  The
feature state is read from that config, so a server without
``--default-user-output-tokens-per-second`` keeps vLLM's 1 s spin untouched.
The executor's own response queue (read by the engine core while the worker
computes) is not changed.

``VLLM_OUTPUT_RATE_WORKER_SPIN_MS`` overrides the window (milliseconds;
``0`` parks right after every message; ``off`` keeps vLLM's own 1 s spin,
for A/B measurements).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_output_rate.adapter.install import wrap
from vllm_output_rate.settings import OutputRateSettings

logger = logging.getLogger(__name__)

SPIN_WINDOW_S = 0.005
LONG_GAP_S = 0.05  # a wait this long means the engine had nothing to run
ARMED_S = 1.0  # how long after such a wait the short window applies ...
BUSY_RUN = 8  # ... unless this many reads in a row came without one
PARKED_RECHECK_S = 0.05  # longest poll while the short window applies
SPIN_WINDOW_ENV = "VLLM_OUTPUT_RATE_WORKER_SPIN_MS"

# Marks a SpinCondition whose wait/record_read were replaced.
_SHORT_SPIN_MARK = "_vllm_output_rate_short_spin"


def spin_window_s() -> float | None:
    """The busy window in seconds (:data:`SPIN_WINDOW_S` unless overridden);
    None when the override is ``off``."""
    text = os.environ.get(SPIN_WINDOW_ENV)
    if text is None or text.strip() == "":
        return SPIN_WINDOW_S
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text) / 1000.0
    except ValueError:
        raise ValueError(f"{SPIN_WINDOW_ENV} must be a number of milliseconds, got {text!r}") from None
    if not value >= 0.0 or value == float("inf"):
        raise ValueError(f"{SPIN_WINDOW_ENV} must be >= 0 and finite, got {text!r}")
    return value


def shorten_spin(message_queue: Any, window_s: float, long_gap_s: float = LONG_GAP_S,
                 armed_s: float = ARMED_S, busy_run: int = BUSY_RUN) -> bool:
    """Make a local reader of ``message_queue`` spin ``window_s`` per wait
    while it is armed (a wait of at least ``long_gap_s`` ended less than
    ``armed_s`` ago, and fewer than ``busy_run`` reads came since without
    such a wait); otherwise it keeps vLLM's own window.

    The window counts from the first ``wait`` after each read.  Returns
    False (and changes nothing) when ``message_queue`` is not a
    shared-memory reader.  Idempotent: a second call only updates the window.
    """
    cond = getattr(message_queue, "_spin_condition", None)
    if cond is None or not getattr(cond, "is_reader", False):
        return False
    settings = getattr(cond, _SHORT_SPIN_MARK, None)
    if settings is not None:
        settings.update(window=window_s, long_gap=long_gap_s, armed=armed_s, busy_run=busy_run)
        return True

    settings = {"window": window_s, "long_gap": long_gap_s, "armed": armed_s, "busy_run": busy_run}
    vllm_window = cond.busy_loop_s
    vllm_wait = cond.wait
    vllm_record_read = cond.record_read
    waiting_since: list[float | None] = [None]  # start of the current wait, if any
    last_long_wait = [float("-inf")]  # when the last wait >= long_gap ended
    short_reads = [0]  # reads in a row since then, each without such a wait

    def record_read() -> None:
        vllm_record_read()  # stamps cond.last_read with vLLM's clock
        since = waiting_since[0]
        if since is not None and cond.last_read - since >= settings["long_gap"]:
            last_long_wait[0] = cond.last_read
            short_reads[0] = 0
        else:  # a short wait, or none (the message was already there)
            short_reads[0] += 1
        waiting_since[0] = None

    from vllm.distributed.device_communicators import shm_broadcast

    parked_recheck_ms = max(1, int(PARKED_RECHECK_S * 1000))

    def wait(timeout_ms: int | None = None) -> None:
        if waiting_since[0] is None:
            # First wait after a read: the busy window starts now (on vLLM's
            # clock; not through record_read, which in vLLM 0.33 may also
            # drain a pending write notification).
            cond.last_read = shm_broadcast.time.monotonic()
            waiting_since[0] = cond.last_read
            armed = (
                cond.last_read - last_long_wait[0] <= settings["armed"]
                and short_reads[0] < settings["busy_run"]
            )
            cond.busy_loop_s = settings["window"] if armed else vllm_window
        if cond.busy_loop_s != vllm_window:
            # Short window: a missed wake-up costs at most one re-check.
            timeout_ms = parked_recheck_ms if timeout_ms is None else min(timeout_ms, parked_recheck_ms)
        vllm_wait(timeout_ms)

    cond.record_read = record_read
    cond.wait = wait
    setattr(cond, _SHORT_SPIN_MARK, settings)
    return True


def feature_on(vllm_config: Any) -> bool:
    additional = getattr(vllm_config, "additional_config", None)
    return OutputRateSettings.from_additional_config(additional) is not None


def install_worker_idle() -> None:
    """Wrap ``WorkerProc._init_message_queues`` (see the module doc), once."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    def make(original):
        def _init_message_queues(self, input_shm_handle, vllm_config, *args, **kwargs):
            result = original(self, input_shm_handle, vllm_config, *args, **kwargs)
            if feature_on(vllm_config):
                window = spin_window_s()
                if window is not None and shorten_spin(getattr(self, "rpc_broadcast_mq", None), window):
                    logger.info(
                        "vllm-output-rate: model worker spins %.1f ms per wait for the "
                        "next step while steps come >= %.0f ms apart (vLLM: 1 s after "
                        "each read), then sleeps until the engine writes",
                        window * 1000.0, LONG_GAP_S * 1000.0,
                    )
            return result

        return _init_message_queues

    wrap(WorkerProc, "_init_message_queues", make)


__all__ = [
    "ARMED_S", "BUSY_RUN", "LONG_GAP_S", "PARKED_RECHECK_S", "SPIN_WINDOW_S", "SPIN_WINDOW_ENV",
    "feature_on", "install_worker_idle", "shorten_spin", "spin_window_s",
]
