"""Let the model worker sleep between steps that are far apart.

vLLM's multiprocess executor sends every step to its model worker through a
shared-memory ring (``MessageQueue``).  The worker's reader side
(``SpinCondition.wait``) keeps spinning on ``sched_yield`` until
``busy_loop_s`` (1 s) has passed since its *last read*, and only then parks in
a zmq poll that the writer's per-write notification wakes.  A user throttled
to a few tokens per second still makes the engine run a step more often than
once a second, so with stock vLLM the worker process never parks and burns a
core while every user is out of quota.

With the feature on, :func:`shorten_spin` changes two things on the worker's
*input* queue only:

* the busy window starts when the worker starts *waiting* for the next step
  (the first ``wait`` after a read), not when it read the previous one: a
  long forward pass no longer uses the window up, so under load the worker
  still catches the next step while spinning, exactly as before;
* the window is :data:`SPIN_WINDOW_S` (a few ms, longer than the engine's
  turnaround between two steps under load) instead of 1 s.

After the window the worker waits in vLLM's own poll, which every write
wakes (``MessageQueue.enqueue`` notifies after each write, and a stale
notification only causes one extra flag check), so no message is delayed
by more than a wake-up.  vLLM's own 5 s re-check still bounds a lost
notification.

Where: ``WorkerProc._init_message_queues`` in the worker process, which has
the ``VllmConfig`` (pickled to the worker with ``additional_config``) and
runs after ``WorkerWrapperBase.init_worker`` has loaded the general plugins
(this module's patch included).  The feature state is read from that config,
so a server without ``--default-user-output-tokens-per-second`` keeps vLLM's
1 s spin untouched.  The executor's own response queue (read by the engine
core while the worker computes) is not changed.

``VLLM_OUTPUT_RATE_WORKER_SPIN_MS`` overrides the window (milliseconds;
``0`` parks right after every message; ``off`` keeps vLLM's own 1 s spin,
for A/B measurements).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_output_rate.settings import OutputRateSettings

logger = logging.getLogger(__name__)

SPIN_WINDOW_S = 0.005
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


def shorten_spin(message_queue: Any, window_s: float) -> bool:
    """Make a local reader of ``message_queue`` spin ``window_s`` per wait.

    The window counts from the first ``wait`` after each read.  Returns
    False (and changes nothing) when ``message_queue`` is not a
    shared-memory reader.  Idempotent: a second call only updates the window.
    """
    cond = getattr(message_queue, "_spin_condition", None)
    if cond is None or not getattr(cond, "is_reader", False):
        return False
    cond.busy_loop_s = window_s
    if getattr(cond, _SHORT_SPIN_MARK, False):
        return True

    vllm_wait = cond.wait
    vllm_record_read = cond.record_read
    read_since_wait = [True]

    def record_read() -> None:
        vllm_record_read()
        read_since_wait[0] = True

    def wait(timeout_ms: int | None = None) -> None:
        if read_since_wait[0]:
            # First wait after a read: the busy window starts now (vLLM's
            # record_read stamps last_read with vLLM's own clock).
            read_since_wait[0] = False
            vllm_record_read()
        vllm_wait(timeout_ms)

    cond.record_read = record_read
    cond.wait = wait
    setattr(cond, _SHORT_SPIN_MARK, True)
    return True


def feature_on(vllm_config: Any) -> bool:
    additional = getattr(vllm_config, "additional_config", None)
    return OutputRateSettings.from_additional_config(additional) is not None


def patch_worker_idle() -> None:
    """Install the wrapper of ``WorkerProc._init_message_queues`` (see module doc)."""
    from vllm.v1.executor.multiproc_executor import WorkerProc

    from vllm_output_rate.adapter.patches import _install

    def make(original):
        def _init_message_queues(self, input_shm_handle, vllm_config, *args, **kwargs):
            result = original(self, input_shm_handle, vllm_config, *args, **kwargs)
            if feature_on(vllm_config):
                window = spin_window_s()
                if window is not None and shorten_spin(getattr(self, "rpc_broadcast_mq", None), window):
                    logger.info(
                        "vllm-output-rate: model worker spins %.1f ms per wait for the "
                        "next step (vLLM default: 1 s after each read), then sleeps "
                        "until the engine writes",
                        window * 1000.0,
                    )
            return result

        return _init_message_queues

    _install(WorkerProc, "_init_message_queues", make)


__all__ = ["SPIN_WINDOW_S", "SPIN_WINDOW_ENV", "feature_on", "patch_worker_idle",
           "shorten_spin", "spin_window_s"]
