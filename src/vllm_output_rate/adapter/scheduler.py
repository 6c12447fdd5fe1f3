"""vLLM scheduler subclasses that enforce per-user output rates.

Selected by :mod:`vllm_output_rate.adapter.patches` only when configured.

Every per-step decision is :class:`~vllm_output_rate.policy.step.StepPolicy`'s
(plain Python, no vLLM; its module docstring gives the order in which an
engine loop asks it).  This module translates: vLLM's state in (a request's
status becomes a boolean, requests are the keys, the scheduler itself is the
policy's :class:`~vllm_output_rate.policy.step.EngineView`), the decision's
answers out.  One ``schedule()`` call:

* **Begin.**  ``StepPolicy.begin`` plans the step (which resident requests
  vLLM may look at, borrowing, slots freed for waiting requests);
  ``self.running`` is swapped for the decision's ``visible`` list (vLLM's
  own admission order), so vLLM's loop never visits a throttled request.
  Afterwards ``self.running`` is the full resident list again, so every
  other vLLM code path sees stock state.
* **vLLM's loops ask the decision.**  ``_reserve_prefill_lookahead`` (the
  last hook before KV is allocated) -> ``tokens_for``;
  ``_handle_blocked_waiting_request`` -> ``may_admit`` (a refused request
  is skipped through vLLM's own skip path and keeps its place);
  ``_ec_transfer_pending`` -> ``may_start`` (after the prefix-cache
  lookup); ``max_num_active_reqs`` -> ``active_cap``; a failed KV
  allocation -> ``victim_for`` (through :class:`_EvictingKVCacheManager`,
  only in steps that hide throttled requests).
* **End.**  The admissions vLLM appended are recorded, the running list
  restored, the requests evicted for quota go back to the waiting queue's
  front, and ``StepPolicy.end`` settles the step once (refunds, prompt
  cost, drafts, the recompute budget, the idle wait the engine loop reads
  as ``output_rate_idle_wait_s``).

``update_from_output`` never touches the quota, so async scheduling (step
N+1 scheduled before step N's output arrives) works unchanged -- except with
speculative decoding, where it refunds the drafts the model rejected
(:class:`SpecDecodeHooks`), matched to the step that paid for them.

The hooks are plain overrides grouped by what vLLM calls them for
(:class:`MembershipHooks`, :class:`ChargingHooks`,
:class:`EvictionHooks` with the view's members, :class:`SpecDecodeHooks`,
and :class:`~.prompt_cost.PromptCostHooks`); none replaces another at run
time.  Every hook falls through to stock vLLM on a scheduler built without
our ``__init__`` (vLLM's own tests build one with ``object.__new__``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import remove_all
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.adapter.operate import OperateSchedulerMixin
from vllm_output_rate.adapter.prompt_cost import PromptCostHooks
from vllm_output_rate.factory import configure_step_policy, make_limiter, make_step_policy
from vllm_output_rate.policy.displacement import fits_in_free_kv
from vllm_output_rate.policy.drafts import DraftAccount
from vllm_output_rate.policy.step import EngineFacts, StepDecision, StepPolicy
from vllm_output_rate.settings import (
    ANONYMOUS_USER,
    InvalidUserError,
    OutputRateSettings,
    resolve_user,
)

logger = logging.getLogger(__name__)


class MembershipHooks:
    """Tells the step policy of vLLM's request lifecycle.

    vLLM calls these as requests arrive, are preempted, finish or leave
    ``running`` between chunks of a streaming-input session; the lanes then
    know every request's user and exactly which requests are resident.
    """

    def add_request(self, request: Request) -> None:
        if self._lanes is not None and request.request_id not in self.requests:
            self._policy.on_add(request, _user_of(request), request.resumable)
        super().add_request(request)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any):
        if self._lanes is not None:
            self._policy.on_free(request)
        return super()._free_request(request, *args, **kwargs)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        if self._lanes is None:
            return super()._preempt_request(request, *args, **kwargs)
        self._policy.on_preempt(request, request.resumable)
        super()._preempt_request(request, *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        facts = self._facts
        if facts is not None and facts.sessions:
            # A request of this step that is no longer RUNNING without being
            # freed or preempted is a streaming-input session waiting for
            # its next chunk.
            requests = self.requests
            for req_id in scheduler_output.num_scheduled_tokens:
                request = requests.get(req_id)
                if request is not None and request.status != RequestStatus.RUNNING:
                    self._policy.on_pause(request)
        return outputs


class ChargingHooks:
    """vLLM's per-request hooks inside ``schedule()``, answered by the step's
    decision: the charge at dispatch, and skipping waiting requests that may
    not be admitted (through vLLM's own skip paths, so they never stop
    admission for the requests behind them)."""

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """vLLM's last hook before it allocates KV for a request: the user
        pays here for the token the chunk samples (with prompt cost, for its
        prompt positions; with speculative decoding, for its drafts), or the
        chunk is cut short of the sampling position.

        In a step whose visible requests are all paid for already (every one
        a decoding stream), vLLM's running loop meets only those: the check
        is skipped for them and runs for the requests of its waiting loop,
        which are not ``RUNNING`` yet when vLLM calls this.
        """
        step = self._step
        if step is None or (step.all_visible_paid and request.status is _RUNNING):
            return _stock_lookahead(self, request, num_computed_tokens, num_new_tokens)
        return step.tokens_for(
            request, num_computed_tokens, num_new_tokens, request.status == _RUNNING
        )

    def engine_chunk(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        return _stock_lookahead(self, request, num_computed_tokens, num_new_tokens)

    def chunk_end_before(self, request: Request, num_computed_tokens: int, allowed: int) -> int:
        if request.mm_features and self.scheduler_config.disable_chunked_mm_input:
            return _end_before_split_item(request, num_computed_tokens, allowed)
        return allowed

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        step = self._step
        if not super()._handle_blocked_waiting_request(request):
            if (
                step is not None
                and request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            ):
                step.held_for_other_reasons = True
            return False
        if step is None:
            return True
        lora = request.lora_request
        if lora is not None and not step.adapter_fits(lora.lora_int_id, self.lora_config.max_loras):
            return False
        return step.may_admit(request, request.status == _PREEMPTED)

    def _ec_transfer_pending(self, request: Request, num_computed_tokens: int) -> bool:
        if super()._ec_transfer_pending(request, num_computed_tokens):
            return True
        step = self._step
        # After the prefix-cache lookup: skipped instead of stopping
        # admission for everybody behind it.
        return step is not None and not step.may_start(request, num_computed_tokens)


class EvictionHooks:
    """Slot and KV pressure, and what the step policy reads of the engine.

    Who gives way, and for whom, is the step policy's decision
    (``StepDecision.victim_for``, ``StepPolicy.begin``); vLLM's scheduler is
    its :class:`~vllm_output_rate.policy.step.EngineView`: the members below
    read vLLM's state and carry the policy's evictions out.
    """

    def _kv_victim_for(self, request: Request) -> Request | None:
        """An allocation for ``request`` failed: the throttled request the
        step policy evicted before vLLM tries again (None: vLLM's own
        preemption decides)."""
        return self._step.victim_for(request, request.status == _RUNNING)

    # -- the engine view the step policy reads (policy.step.EngineView) -------

    def active_slots(self) -> int:
        return self._active_cap - self.num_waiting_for_streaming_input

    def configured_active_cap(self) -> int:
        return self._active_cap

    def max_resident(self) -> int:
        return self.max_num_running_reqs

    def free_slots(self) -> int:
        return self.max_num_running_reqs - len(self.running) - self.num_waiting_for_streaming_input

    def has_waiting(self) -> bool:
        return bool(self.waiting)

    def admittable_waiting(self):
        waiting = self.waiting
        return (r for r in waiting if r.status in _ADMITTABLE) if waiting else ()

    def adapters_of(self, requests) -> set[int]:
        return _adapters_of(requests)

    def token_budget(self) -> tuple[int, int, int]:
        config = self.scheduler_config
        # An adaptive threshold is set inside vLLM's step from its request
        # counts: no cap is assumed then (chunks counted larger, admissions fewer).
        adaptive = config.long_prefill_token_threshold_adaptive
        longest = 0 if adaptive else config.long_prefill_token_threshold
        return self.max_num_scheduled_tokens, 1 + self.num_spec_tokens, longest

    def kv_room_for(self, request: Request) -> bool:
        """May a request evicted for quota come back now (see ``fits_in_free_kv``)?"""
        return fits_in_free_kv(
            request.num_tokens,
            self.block_size,
            len(self.running),
            self.kv_cache_manager.block_pool.get_num_free_blocks(),
        )

    def evict(self, victim: Request) -> None:
        self._preempt_request(victim, time.monotonic())
        # vLLM's waiting loop may be mid-iteration and about to pop the head
        # of the queue it peeked; the victim stays out until the step ends.
        self.waiting.remove_request(victim)

    def give_up_slot(self, victim: Request) -> None:
        self._preempt_request(victim, time.monotonic())
        self.running.remove(victim)  # the resident list (no step yet: nothing else holds it)


class SpecDecodeHooks:
    """Speculative decoding: a step may emit its drafts too, so they are paid.

    At dispatch a decoding request pays, besides its sampled token, for as
    many of its scheduled drafts as its user's quota allows now; vLLM then
    schedules only those drafts (it cuts ``spec_token_ids`` to the tokens
    the hook returns).  Drafts of a request that did not end up scheduled are
    refunded at the end of the step; drafts the model rejected are refunded
    when the step's output arrives (:class:`~vllm_output_rate.policy.drafts.DraftAccount`).
    Without speculative decoding none of this runs: the hook is not
    installed and ``update_from_output`` only checks one attribute.
    """

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        account = self._draft_account
        if account is not None:
            index = model_runner_output.req_id_to_index
            sampled = model_runner_output.sampled_token_ids

            def accepted(req_id: str) -> int:
                # The step samples one token and emits the accepted drafts
                # before it; no output for the request: nothing accepted.
                i = index.get(req_id)
                if i is None or not sampled or i >= len(sampled):
                    return 0
                return len(sampled[i]) - 1

            account.settle_output(scheduler_output, self.output_rate_clock(), accepted)
        return outputs


class OutputRateSchedulerMixin(
    PromptCostHooks,
    MembershipHooks,
    ChargingHooks,
    EvictionHooks,
    SpecDecodeHooks,
):
    """Per-user output-rate limiting on top of vLLM's V1 ``Scheduler``.

    This class runs the step (begin, hand vLLM the visible requests, end:
    see the module docstring); its bases are the hooks vLLM calls along the
    way.  Every attribute they share is set here: the parts of the step
    policy in ``__init__`` and :meth:`configure` (at start and on every
    reload), what one step decided in ``self._step`` (a
    :class:`~vllm_output_rate.policy.step.StepDecision`, None between steps).
    """

    #: Clock for the limiter, in integer nanoseconds; tests replace it.
    output_rate_clock: Callable[[], int] = staticmethod(time.monotonic_ns)

    # "Not configured" until __init__ runs: a scheduler built without it
    # (vLLM's own tests make one with object.__new__ and set vLLM's
    # attributes by hand) runs every hook as stock vLLM.  Between steps the
    # hooks that keep our state ask ``_lanes``; inside a step ``_step``.
    _lanes: Any = None
    _facts: EngineFacts | None = None
    _step: StepDecision | None = None
    _draft_account: DraftAccount | None = None
    _policy: StepPolicy | None = None
    #: Builds the limiter from the settings; tests give a data-parallel rank
    #: a leased limiter on a fake store and clock.
    output_rate_limiter_factory: Callable[..., Any] = staticmethod(make_limiter)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = OutputRateSettings.from_additional_config(
            self.vllm_config.additional_config
        )
        if settings is None:
            raise RuntimeError(
                f"{type(self).__name__} needs additional_config['output_rate']; "
                "it is selected automatically when the feature is configured"
            )
        priority_policy = self.policy == SchedulingPolicy.PRIORITY
        self._facts = EngineFacts(
            chunked_prefill=bool(self.scheduler_config.enable_chunked_prefill),
            priority_policy=priority_policy,
            # A data-parallel rank whose requests are all throttled must keep
            # stepping (vLLM runs a dummy batch and syncs the ranks every
            # step): waiting on its input queue would stall every other rank.
            data_parallel=self.vllm_config.parallel_config.data_parallel_size > 1,
        )
        self._step: StepDecision | None = None
        #: The users' own rates (the first level of every composed quota).
        self.output_rate_limiter = self.output_rate_limiter_factory(settings)
        #: Seconds the engine loop may wait on its input queue after a step
        #: that ran nothing because every runnable request was throttled;
        #: None means "poll as stock vLLM does".
        self.output_rate_idle_wait_s: float | None = None
        self._policy = policy = make_step_policy(
            settings,
            self.output_rate_limiter,
            self._facts,
            max_model_len=self.vllm_config.model_config.max_model_len,
            spec_decode=bool(self.num_spec_tokens),
            can_release=self._request_blocks_can_be_freed,
        )
        # The policy's parts, held directly: membership changes and
        # per-request payments go to them without a call through the policy,
        # and metrics and the admin route read them here.
        self.output_rate_gate = policy.gate
        self._lanes = policy.lanes
        self._ledger = policy.ledger
        self._evicted_for_quota = policy.evicted_for_quota
        self.output_rate_eviction_budget = policy.budget
        self.output_rate_residency = policy.residency
        self.output_rate_prompt_cost = policy.prompt_cost
        self._draft_account = policy.drafts
        self.configure(settings)

    def configure(self, settings: OutputRateSettings) -> None:
        """The features ``settings`` ask for, at start and on a reload
        between steps (``factory.configure_step_policy``)."""
        self.output_rate_settings = settings
        policy = self._policy
        configure_step_policy(policy, settings, self.output_rate_limiter)
        self.output_rate_groups = policy.groups
        self._borrowing = policy.gate.borrowing

    # -- the active cap, seen through vLLM's own admission check -----------

    @property
    def max_num_active_reqs(self) -> int:
        step = self._step
        if step is None:
            return self._active_cap
        return step.active_cap()

    @max_num_active_reqs.setter
    def max_num_active_reqs(self, value: int) -> None:
        self._active_cap = value

    def shutdown(self) -> None:
        super().shutdown()
        self._policy.close()

    # -- one step ------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any):
        policy = self._policy
        resident = self.running
        self._step = step = policy.begin(self, self.output_rate_clock())
        visible = step.visible
        # vLLM edits the list it is given; `resident` keeps the start.
        self.running = list(resident) if visible is None else visible
        plan = step.plan
        kv_cache_manager = self.kv_cache_manager
        if plan.throttled and plan.hidden:
            # Hidden throttled requests exist: allocation failures evict them
            # first.  Otherwise no victim exists (a victim is a hidden stream)
            # and vLLM talks to its own KV cache manager.
            self.kv_cache_manager = _EvictingKVCacheManager(kv_cache_manager, self._kv_victim_for)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.kv_cache_manager = kv_cache_manager
            self._step = None
            if step.repeat:
                # vLLM removed what it preempted from `running` (the whole
                # resident list here), so only the admissions need settling.
                policy.record_admissions(step, self.running, len(resident))
            else:
                self._restore_resident(step, resident)
                for victim in step.evicted:
                    self.waiting.prepend_request(victim)
        policy.end(step, output)
        self.output_rate_idle_wait_s = policy.idle_wait_s
        return output

    def _restore_resident(self, step: StepDecision, resident: list[Request]) -> None:
        """Make ``self.running`` the full resident list again, this step's
        admissions appended and its preemptions removed."""
        admitted = self._policy.record_admissions(step, self.running, step.num_offered)
        if step.preempted:
            resident = remove_all(resident, set(step.preempted))
        resident.extend(admitted)
        self.running = resident


class _EvictingKVCacheManager:
    """The scheduler's KV cache manager as seen during a step with throttled requests.

    An allocation that fails evicts the throttled request ``victim_for``
    names and tries again; every other attribute is the real manager's.  A
    stand-in object for the step rather than an attribute set on the real
    manager: touching the real manager's instance dict makes CPython's
    attribute caches miss on every later access vLLM makes to it (measured:
    about 3 000 instructions per scheduled request per step).
    """

    __slots__ = ("_real", "_victim_for")

    def __init__(self, real: Any, victim_for: Callable[[Request], Request | None]) -> None:
        self._real = real
        self._victim_for = victim_for

    def allocate_slots(self, request: Request, *args: Any, **kwargs: Any):
        allocate = self._real.allocate_slots
        blocks = allocate(request, *args, **kwargs)
        while blocks is None and self._victim_for(request) is not None:
            blocks = allocate(request, *args, **kwargs)
        return blocks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


#: vLLM's own hook (AsyncScheduler does not override it), called directly:
#: it runs for every scheduled request of every step.
_stock_lookahead = Scheduler._reserve_prefill_lookahead
_RUNNING = RequestStatus.RUNNING
# Waiting requests vLLM could admit in this step (not held for grammar,
# remote KV or a streaming-input chunk).
_ADMITTABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_PREEMPTED = RequestStatus.PREEMPTED


def _end_before_split_item(request: Request, num_computed_tokens: int, allowed: int) -> int:
    """A chunk cut short for lack of quota, kept whole-item under ``--disable-chunked-mm-input``.

    With that flag vLLM does not end a chunk inside a multimodal item the
    chunk starts (unless the token budget is smaller than the item); the cut
    to the second-to-last prompt position could, when the prompt ends with an
    item.  Then the chunk ends before that item (no chunk at all if it
    starts there).
    """
    end = num_computed_tokens + allowed
    for feature in request.mm_features:
        start = feature.mm_position.offset
        if num_computed_tokens <= start < end < start + feature.mm_position.length:
            return start - num_computed_tokens
    return allowed


def _adapters_of(requests) -> set[int]:
    """The LoRA adapters (``lora_int_id`` > 0) of ``requests``, as vLLM counts them."""
    return {
        r.lora_request.lora_int_id
        for r in requests
        if r.lora_request is not None and r.lora_request.lora_int_id > 0
    }


def _user_of(request: Request) -> str:
    params = request.sampling_params
    try:
        return resolve_user(params.extra_args if params is not None else None)
    except InvalidUserError as exc:
        # The API server and LLM() reject these before they get here; an
        # engine must not die for one malformed request that slipped through.
        logger.warning("request %s: %s; using %s", request.request_id, exc, ANONYMOUS_USER)
        return ANONYMOUS_USER


class OutputRateScheduler(OperateSchedulerMixin, OutputRateSchedulerMixin, Scheduler):
    """Synchronous-scheduling variant."""


class OutputRateAsyncScheduler(OperateSchedulerMixin, OutputRateSchedulerMixin, AsyncScheduler):
    """Async-scheduling variant (step N+1 scheduled before N's output)."""
