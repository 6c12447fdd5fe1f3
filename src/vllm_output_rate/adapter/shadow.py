"""Shadow mode on vLLM's scheduler: stock decisions, the policy counted beside them.

:func:`~vllm_output_rate.adapter.patches` selects these classes whenever
shadow mode can be in force (``mode: shadow`` given, or a limits file that
may switch to it).  In ``enforce`` mode a step is the plugin's own
(``super().schedule()``).  In ``shadow`` mode vLLM's own ``schedule()``
runs, with the plugin's hooks inert (they act only while a step of the
plugin's is open, ``_step``; between steps each falls through to vLLM's
behaviour); afterwards the step's output feeds
:class:`~vllm_output_rate.policy.shadow.ShadowCounter` with the tokens each
user was given.  The membership the policy needs when enforcement resumes
(which requests are resident, prefilling or decoding) is kept up to date in
either mode, so switching is a limits-file reload: no restart, no request
lost.  The limiter's own state is not touched while shadowing: enforcement
resumes with every user's quota whole.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_output_rate.adapter.scheduler import (
    OutputRateAsyncScheduler,
    OutputRateScheduler,
    OutputRateSchedulerMixin,
)
from vllm_output_rate.policy.shadow import ShadowCounter
from vllm_output_rate.policy.step import can_progress_unpaid
from vllm_output_rate.settings import SHADOW, OutputRateSettings


class ShadowSchedulerMixin:
    """Runs stock vLLM's step while ``mode`` is ``shadow`` (see the module doc).

    ``output_rate_shadow`` is the counter, created the first time shadow mode
    is in force and kept afterwards (its totals only grow); ``_shadowing``
    says whether it is fed now.
    """

    #: vLLM's own ``schedule`` for this class (set on the concrete classes).
    _stock_schedule: Any = None
    #: A scheduler built without our ``__init__`` (vLLM's own tests build
    #: one with ``object.__new__``) is not shadowing: it behaves as stock.
    _shadowing: bool = False

    def configure(self, settings: OutputRateSettings) -> None:
        super().configure(settings)  # type: ignore[misc]
        shadowing = settings.mode == SHADOW
        counter = getattr(self, "output_rate_shadow", None)
        if shadowing and counter is None:
            counter = self.output_rate_shadow = ShadowCounter(
                *_shadow_limits(settings), burst_ns=settings.burst_ns
            )
        elif counter is not None:
            counter.configure(*_shadow_limits(settings))
        elif not hasattr(self, "output_rate_shadow"):
            self.output_rate_shadow = None
        was = getattr(self, "_shadowing", False)
        self._shadowing = shadowing
        if was != shadowing:
            self._mode_switched(shadowing)

    def _mode_switched(self, shadowing: bool) -> None:
        gate = self.output_rate_gate
        clock = self.output_rate_clock()
        # The plugin's last step must not count the shadowed time as
        # throttled, nor be taken for the step before the next one.
        gate.ledger.open(clock, False)
        gate.lanes.version += 1
        self.output_rate_idle_wait_s = None

    def schedule(self, *args: Any, **kwargs: Any):
        if self._operate is not None:
            self.output_rate_operate_step()  # may switch the mode (a reload)
        if not self._shadowing:
            return OutputRateSchedulerMixin.schedule(self, *args, **kwargs)
        output = self._stock_schedule(*args, **kwargs)
        self.output_rate_idle_wait_s = None  # stock vLLM's polling
        self._follow_stock_step(output)
        return output

    def _follow_stock_step(self, output) -> None:
        """Keep the lanes in step with what vLLM admitted and advanced, and
        count the tokens each user was given."""
        lanes = self.output_rate_gate.lanes
        lane_of, user_of = lanes.lane_of, lanes.user_of
        evicted = getattr(self, "_evicted_for_quota", None)
        for request in self.running:
            if request not in lane_of and request in user_of:
                lanes.admit(request, can_progress_unpaid(request))
                if evicted:
                    evicted.discard(request)
        sampled: dict[str, int] = {}
        requests = self.requests
        for req_id in output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None:
                continue
            user = lane_of.get(request)
            if user is None:
                continue
            if request in lanes.order[user].progressing:
                lanes.set_progressing(request, can_progress_unpaid(request))
            if not request.is_prefill_chunk:
                sampled[user] = sampled.get(user, 0) + 1
        self.output_rate_shadow.observe(self.output_rate_clock(), sampled)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._shadowing and self.num_spec_tokens:
            self._count_accepted_drafts(model_runner_output)
        return outputs

    def _count_accepted_drafts(self, model_runner_output) -> None:
        """Drafts the model accepted are output tokens too: counted when
        their step's output arrives (the sampled token was counted at dispatch)."""
        sampled = model_runner_output.sampled_token_ids
        user_of = self.output_rate_gate.lanes.user_of
        accepted: dict[str, int] = {}
        for req_id, i in model_runner_output.req_id_to_index.items():
            if i < len(sampled) and len(sampled[i]) > 1:
                request = self.requests.get(req_id)
                user = None if request is None else user_of.get(request)
                if user is not None:
                    accepted[user] = accepted.get(user, 0) + len(sampled[i]) - 1
        if accepted:
            self.output_rate_shadow.observe_extra(self.output_rate_clock(), accepted)


def _shadow_limits(settings: OutputRateSettings) -> tuple:
    """:class:`ShadowCounter` arguments for ``settings``."""
    users = settings.share_table()
    user_rates = (settings.default_rate, dict(settings.user_rates))
    if not settings.group_rates:
        return users, user_rates, None, None, None
    return (
        users, user_rates, settings.group_table(),
        (settings.default_rate, dict(settings.group_rates)), settings.group_of,
    )


class ShadowScheduler(ShadowSchedulerMixin, OutputRateScheduler):
    """Synchronous scheduling, enforce or shadow."""

    _stock_schedule = Scheduler.schedule


class ShadowAsyncScheduler(ShadowSchedulerMixin, OutputRateAsyncScheduler):
    """Asynchronous scheduling, enforce or shadow."""

    _stock_schedule = AsyncScheduler.schedule
