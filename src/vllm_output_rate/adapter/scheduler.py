"""vLLM scheduler subclasses that enforce per-user output rates.

Selected by :mod:`vllm_output_rate.adapter.patches` only when the feature is
configured; otherwise vLLM runs its stock classes untouched.

How one ``schedule()`` call works (the decisions live in :mod:`..policy`:
the gate, its lanes and ledger, and :class:`..policy.displacement.Displacement`):

* **Plan.**  Before vLLM's own ``schedule()`` runs, ``self.running`` is
  swapped for the requests the gate offers this step: per user, its prefills
  and as many decoding streams as its quota can pay for now, users in
  least-recently-served order, at most the active cap.  Resident requests
  that are out of quota (throttled) or beyond the cap stay resident -- KV,
  model-runner slot and output history kept -- but out of sight, so vLLM's
  loop never visits them.  Afterwards ``self.running`` is the full resident
  list again, so every other vLLM code path sees stock state.
* **Charge at dispatch.**  :meth:`_charge_at_sampling_position` (vLLM's
  ``_reserve_prefill_lookahead`` hook) is the last
  hook vLLM calls before allocating KV for a request; when the chunk reaches
  the sampling position we take one unit of quota.  A refused request is cut
  back to the second-to-last prompt position (chunked prefill) or skipped --
  unless it was admitted in this step into a slot set aside for its
  borrowing user: then it borrows the token (``Borrowing.lend``), as a
  resident borrowed stream would, and samples at once.
* **Do not block the waiting queue.**  A waiting request whose user is out
  of quota is skipped through vLLM's own skip path
  (:meth:`_handle_blocked_waiting_request`, :meth:`_ec_transfer_pending`)
  instead of stopping admission for everybody behind it.
* **Throttled requests do not count as active.**  ``max_num_active_reqs`` is
  a property that, during a step, admits waiting requests up to the active
  cap counting only requests that can run, and never beyond ``max_num_seqs``
  resident.
* **vLLM's order.**  The visible requests are handed to vLLM in admission
  order (its own order of ``running``), so with limits never hit every
  decision -- token budget, preemption victims -- is stock vLLM's.
* **KV pressure.**  When an allocation fails, hidden throttled requests are
  preempted first (the user whose quota comes back last first; under the
  PRIORITY policy only within the same or a less important priority),
  before vLLM's own victim choice and also on behalf of waiting requests of
  users with no resident request.  A request evicted this way comes back
  only into free KV and never evicts others (:meth:`_kv_room_for`).
  Which request gives way, and for whom, is
  :class:`~vllm_output_rate.policy.displacement.Displacement`'s choice.
* **Refund once.**  After vLLM's ``schedule()`` returns, every charge whose
  request did not end up scheduled at a sampling position is refunded.

``update_from_output`` never touches the limiter, so async scheduling (step
N+1 scheduled before step N's output arrives) works unchanged -- except with
speculative decoding, where it refunds the drafts the model rejected
(:class:`SpecDecodeHooks`); those refunds are matched to the step that paid
for them, so they are exact under async scheduling too.

The scheduler mixin is :class:`OutputRateSchedulerMixin` (the step) over
seven hook classes, one concern each: :class:`MembershipHooks` (the lanes
follow vLLM's request lifecycle), :class:`ChargingHooks` (per-request
charges and waiting-queue skips), :class:`AdapterHooks` (hidden requests'
LoRA adapters stay counted against ``max_loras``), :class:`ResidencyHooks`
(a user's requests are admitted only as far as its quota keeps them moving
at the minimum pace; the rest wait un-admitted), :class:`EvictionHooks`
(slot and KV pressure), :class:`BorrowingHooks` (spare capacity for users
with a ceiling above their rate, handed to vLLM after every guaranteed
request; groups of users paying every token together) and
:class:`~.prompt_cost.PromptCostHooks` (prompt tokens charged at
``input_token_weight``; idle at weight 0).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Container

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import remove_all
from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.adapter.operate import OperateSchedulerMixin
from vllm_output_rate.adapter.prompt_cost import PromptCostHooks
from vllm_output_rate.factory import (
    make_borrowing,
    make_group_quotas,
    make_limiter,
    make_residency,
)
from vllm_output_rate.policy.displacement import Displacement, fits_in_free_kv
from vllm_output_rate.policy.drafts import DraftAccount
from vllm_output_rate.policy.eviction import EvictionBudget
from vllm_output_rate.policy.gate import StepGate, StepPlan
from vllm_output_rate.settings import (
    ANONYMOUS_USER,
    InvalidUserError,
    OutputRateSettings,
    resolve_user,
)

logger = logging.getLogger(__name__)


class MembershipHooks:
    """Keeps the gate's lanes in step with vLLM's request lifecycle.

    vLLM calls these as requests arrive, are preempted, finish or leave
    ``running`` between chunks of a streaming-input session; the lanes then
    know every request's user and exactly which requests are resident.
    """

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:
            self._lanes.track(request, _user_of(request))
            if not self._chunked_prefill and not request.resumable:
                # Its first token comes with its whole prefill: it needs
                # quota to be admitted, so it takes turns with its user's
                # resident streams.
                self._lanes.wait_in_turn(request)
            if request.resumable and not self._tracks_sessions:
                # Streaming-input sessions need bookkeeping after each step;
                # engines that never see one skip the extra call per step.
                self._tracks_sessions = True
                self.update_from_output = self._update_from_output_with_sessions
        super().add_request(request)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any):
        self._lanes.forget(request)
        self._evicted_for_quota.discard(request)
        return super()._free_request(request, *args, **kwargs)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        self._lanes.release(request)
        if not self._chunked_prefill and not request.resumable:
            self._lanes.wait_in_turn(request)  # as on arrival
        if self._step_plan is not None:
            self._preempted_in_step.append(request)
        super()._preempt_request(request, *args, **kwargs)

    def _update_from_output_with_sessions(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        # Requests that left `running` without being freed or preempted (a
        # streaming-input session waiting for its next chunk) stop being
        # resident.  Only this step's requests can have changed.
        lanes = self._lanes
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if (
                request is not None
                and request.status != RequestStatus.RUNNING
                and request in lanes.lane_of
            ):
                lanes.release(request)
        return outputs


class ChargingHooks:
    """vLLM's per-request hooks inside ``schedule()``: the charge at the
    sampling position, and skipping waiting requests whose user cannot pay
    (through vLLM's own skip paths, so they never stop admission for the
    requests behind them)."""

    def _resume_charging(self) -> None:
        """Route vLLM's per-request hook through the charging check again.

        Called from every hook of vLLM's waiting loop that runs before a
        waiting request can reach ``_reserve_prefill_lookahead`` (and at the
        end of the step), so a request admitted from the waiting queue is
        always charged even in steps whose running loop skipped the check.
        """
        self._reserve_prefill_lookahead = self._charging_reserve_prefill_lookahead

    def _charge_at_sampling_position(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """vLLM's ``_reserve_prefill_lookahead`` hook, plus the charge.

        The last hook vLLM calls before allocating KV for a request: when the
        scheduled chunk reaches the sampling position, one unit of the user's
        quota is taken here, or the chunk is cut short of it.
        """
        num_new_tokens = self._stock_reserve_prefill_lookahead(
            request, num_computed_tokens, num_new_tokens
        )
        prepaid = self._prepaid
        if prepaid is None or num_new_tokens <= 0:
            return num_new_tokens
        if request in prepaid:  # a decoding stream the plan already paid for
            return num_new_tokens
        sample_at = request.num_tokens + request.num_output_placeholders
        if num_computed_tokens + num_new_tokens < sample_at:
            return num_new_tokens  # an intermediate prefill chunk is free
        if self._ledger.charge(request):
            return num_new_tokens
        if request in self._admitted_to_borrow and self._borrowing.lend(
            self._ledger, self._lanes.user_of[request], request
        ):
            self._lent_in_step = True
            return num_new_tokens
        # Out of quota: stop short of the sampling position.
        allowed = sample_at - 1 - num_computed_tokens if self._chunked_prefill else 0
        allowed = max(allowed, 0)
        if allowed and request.mm_features and self.scheduler_config.disable_chunked_mm_input:
            allowed = _end_before_split_item(request, num_computed_tokens, allowed)
        if allowed == 0 and request.status == RequestStatus.RUNNING:
            self._refused_visible += 1
        return allowed

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        self._resume_charging()
        if not super()._handle_blocked_waiting_request(request):
            if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
                self._held_for_other_reasons = True
            return False
        if self._step_plan is None:
            return True
        if request.lora_request is not None and not self._adapter_fits(request):
            return False
        if not self._residency_admits(request):
            return False  # waits un-admitted: its user's quota moves no more streams
        ledger = self._ledger
        user_of = self._lanes.user_of
        if self._slot_donors:
            # Slots were freed in this step for requests that can run now:
            # neither the donors' own requests nor anyone out of quota may
            # take them instead.
            return user_of[request] not in self._slot_donors and ledger.can_charge(request)
        samples_at_once = (
            not self._chunked_prefill or request.num_tokens - request.num_computed_tokens <= 1
        )
        if samples_at_once:
            if request in self._evicted_for_quota and not self._kv_room_for(request):
                return False
            return ledger.can_charge(request)
        if request.status == RequestStatus.PREEMPTED:
            # No re-admission thrash: a preempted stream comes back only while
            # its user can pay now or is being served in this step (then it
            # takes its turn in the user's rotation instead of starving).
            if not (ledger.can_charge(request) or ledger.is_served_now(request)):
                return False
            return request not in self._evicted_for_quota or self._kv_room_for(request)
        admits = self._borrow_admits
        if admits is not None:
            user = user_of[request]
            if ledger.quota_now(user) == 0 and self._borrowing.table.borrows(user):
                # It would only run by borrowing: admitted in counter order
                # (see BorrowingHooks._offer_spare_to_borrowers), not in
                # arrival order; skipped, it keeps its place in the queue.
                left = admits.get(user, 0)
                if left <= 0:
                    return False
                admits[user] = left - 1
                self._admitted_to_borrow.add(request)
        return True

    def _ec_transfer_pending(self, request: Request, num_computed_tokens: int) -> bool:
        self._resume_charging()
        if super()._ec_transfer_pending(request, num_computed_tokens):
            return True
        if self._step_plan is None:
            return False
        # After the prefix-cache lookup: if only the sampling position is
        # left and the user cannot pay, skip instead of stopping admission.
        if request.num_tokens - num_computed_tokens <= 1:
            if self._ledger.can_charge(request):
                return False
            return not (
                request in self._admitted_to_borrow
                and self._borrowing.can_lend(self._lanes.user_of[request], self._ledger.now_ns)
            )
        return False


class AdapterHooks:
    """LoRA: a hidden request's adapter still counts against ``max_loras``.

    vLLM admits a waiting request with a new adapter only while fewer than
    ``max_loras`` adapters are in its count, and asserts that count after its
    running loop.  It counts what it can see in ``running`` (0.32: the
    requests scheduled in the step; 0.33: all of them), so a request hidden
    for lack of quota -- or visible but refused its sampling position (0.32)
    -- would not hold its adapter's place, and when it ran again beside a
    newcomer with another adapter the batch would exceed ``max_loras``.

    While some resident request is hidden or refused, a waiting request with
    an adapter is therefore skipped (vLLM's own skip path) unless its adapter
    is among those of every resident request and the step's admissions so
    far, or there is room for one more.  Otherwise vLLM's own count already
    covers every resident request that can run and nothing changes: with
    limits never hit, LoRA admissions are stock vLLM's.
    """

    _adapters_plan: StepPlan | None = None  # the step the cached set belongs to
    _adapters_in_step: set[int]
    _adapters_seen: int = 0  # entries of self.running already in the set

    def _adapter_fits(self, request: Request) -> bool:
        """May ``request`` (which has an adapter) be admitted in this step?"""
        lora_id = request.lora_request.lora_int_id
        plan = self._step_plan
        if lora_id <= 0 or not (plan.hidden or self._refused_visible):
            return True
        if self._adapters_plan is not plan:
            self._adapters_plan = plan
            self._adapters_in_step = _adapters_of(self._lanes.resident())
            self._adapters_seen = 0
        known = self._adapters_in_step
        running = self.running  # the visible requests, then this step's admissions
        if self._adapters_seen < len(running):
            known |= _adapters_of(running[self._adapters_seen:])
            self._adapters_seen = len(running)
        return lora_id in known or len(known) < self.lora_config.max_loras


class ResidencyHooks:
    """Residency follows the rate (:mod:`~vllm_output_rate.policy.residency`).

    A waiting request of a user that already holds as many resident requests
    as its quota keeps moving at the minimum pace is skipped through vLLM's
    own skip path: it keeps its place in the queue and holds no KV, and the
    requests behind it are reached.  Those resident beyond the cap (a lowered
    limit) are released first for other users' waiting requests
    (``Displacement``, given the same :class:`~.policy.residency.Residency`).
    """

    #: len(self.running) when the step began: vLLM appends its admissions.
    _running_at_start: int = 0

    def _residency_admits(self, request: Request) -> bool:
        """May ``request`` become resident in this step (its user's cap)?"""
        lanes = self._lanes
        user_of = lanes.user_of
        user = user_of[request]
        room = self.output_rate_residency.room(user, lanes.resident_count(user))
        if room is None:
            return True
        if room <= 0:
            return False
        # This step's admissions are not in the lanes yet (see _admit_new).
        admitted = 0
        for r in self.running[self._running_at_start:]:
            if user_of.get(r) == user:
                admitted += 1
                if admitted >= room:
                    return False
        return True


class EvictionHooks:
    """Slot and KV pressure: hidden throttled requests give way first.

    Who gives way, and for whom, is :class:`~vllm_output_rate.policy.displacement.Displacement`'s
    decision (``self._displacement``); these hooks feed it vLLM's requests and
    carry its choices out.
    """

    def _free_slots_for_waiting(self, plan: StepPlan, num_resident: int) -> None:
        """Throttled requests must not keep every model-runner slot from
        others (see ``Displacement.free_slots_for``)."""
        occupied = num_resident + self.num_waiting_for_streaming_input
        admittable = (
            request
            for request in list(self.waiting)  # evictions change the queue
            if request.status in _ADMITTABLE
        )
        self._slot_donors = self._displacement.free_slots_for(
            admittable,
            plan,
            free_slots=self.max_num_running_reqs - occupied,
            active_cap=self._active_cap,
            # Held out of the waiting queue until the step ends: re-admitted
            # now, a victim would take back the slot it was freed from.
            evict=self._evict,
        )

    def _allocate_slots_or_evict(self, request: Request, *args: Any, **kwargs: Any):
        blocks = self._stock_allocate_slots(request, *args, **kwargs)
        while blocks is None and self._step_plan is not None:
            victim = self._throttled_victim_for(request)
            if victim is None:
                break
            self._evict(victim)
            blocks = self._stock_allocate_slots(request, *args, **kwargs)
        return blocks

    def _kv_room_for(self, request: Request) -> bool:
        """May a request evicted for quota come back now (see ``fits_in_free_kv``)?"""
        return fits_in_free_kv(
            request.num_tokens,
            self.block_size,
            len(self.running),
            self.kv_cache_manager.block_pool.get_num_free_blocks(),
        )

    def _throttled_victim_for(self, request: Request) -> Request | None:
        """The throttled request that gives way for ``request``, which needs KV."""
        running = request.status == RequestStatus.RUNNING
        least_important = None
        if self._priority_policy and running and self.running:
            # vLLM's own victim would be the least important visible request.
            least_important = max(r.priority for r in self.running)
        return self._displacement.victim_for(request, not running, least_important)

    def _evict(self, victim: Request) -> None:
        # Every eviction is paid for, also those for a running request that
        # needs KV (vLLM would preempt someone then anyway): the budget then
        # runs into debt, and waiting requests wait until it is paid back.
        self.output_rate_eviction_budget.spend(victim.num_computed_tokens)
        self._evicted_for_quota.add(victim)
        self._preempt_request(victim, time.monotonic())
        # vLLM's waiting loop may be mid-iteration and about to pop the head
        # of the queue it peeked; keep the victim out until the step ends.
        self.waiting.remove_request(victim)
        self._evicted_in_step.append(victim)


class BorrowingHooks:
    """Spare capacity for users whose ceiling is above their rate (see
    :mod:`vllm_output_rate.policy.borrow`), and groups of users paying every
    token together (:mod:`vllm_output_rate.policy.groups`): set up from the
    settings, and offered after the plan, when the step has room left."""

    #: The groups' membership and quotas; None without groups.
    output_rate_groups = None

    def apply_output_rate_shares(self, settings: OutputRateSettings) -> None:
        """Ceilings, weights and groups from ``settings`` (at start and on reload).

        While nobody has a ceiling above its rate and no group is configured
        the gate keeps the rate limiter itself and no borrowing runs: hard
        caps take today's path.
        """
        self.output_rate_groups = make_group_quotas(settings, self.output_rate_groups)
        borrowing, limiter = make_borrowing(
            settings, self.output_rate_limiter, self._borrowing, self.output_rate_groups
        )
        self._borrowing = borrowing
        groups = self.output_rate_groups
        self.output_rate_prompt_cost.group_of = None if groups is None else groups.of
        gate = self.output_rate_gate
        gate.borrowing = borrowing
        gate.limiter = gate.ledger.limiter = limiter
        if self._draft_account is not None:
            self._draft_account.limiter = limiter  # drafts count on a ceiling too

    def _offer_spare_to_borrowers(self, plan: StepPlan, slots: int) -> None:
        """Room the plan left, less what waiting requests the active cap
        would admit need, goes to borrowers."""
        room = slots - len(plan.visible) - plan.reserved
        queued: dict[str, list[int]] | None = None
        if room > 0 and (self._ledger.short or self.waiting):
            queued = {}
            guaranteed, admissions = self._waiting_demand(room, queued)
            room -= guaranteed + admissions
        # Also with no room or nobody short: then it only keeps the counters.
        self.output_rate_gate.borrow(plan, room, queued or ())
        if queued is not None:
            # Which borrowers' waiting requests take the free slots is the
            # borrowing's choice (least weighted service first), not the
            # queue's order: the waiting-queue hook skips a borrower's request
            # beyond its user's share through vLLM's own skip path.
            admits: dict[str, int] = {}
            if admissions:
                committed = self._committed_output(queued)
                for user in self._borrowing.admissions(queued, committed, admissions):
                    admits[user] = admits.get(user, 0) + 1
            self._borrow_admits = admits

    def _committed_output(self, users: Container[str]) -> dict[str, int]:
        """What the resident requests of ``users``, and of the other members
        of their groups (a group's admissions weigh all of its members), may
        still output."""
        user_of = self._lanes.user_of
        group_of = self._borrowing.table.group_of
        groups = {group_of(u) for u in users} - {None}
        committed: dict[str, int] = {}
        for request in self.running:  # every resident request (before the step's swap)
            user = user_of.get(request)
            if user is None:
                continue
            if user in users or (groups and group_of(user) in groups):
                committed[user] = committed.get(user, 0) + _output_left(request)
        return committed

    def _waiting_demand(self, limit: int, queued: dict[str, list[int]]) -> tuple[int, int]:
        """Admittable waiting requests that get room before borrowed streams,
        up to ``limit``: those whose user can pay now (the first count), and,
        while model-runner slots are free, those of users who may borrow
        (the second: admitted, they join the borrowing as resident streams).
        ``queued`` receives, per borrowing user, what each of its waiting
        requests that would only run by borrowing may output.

        A borrowing user's waiting requests are counted only for the room
        its own hidden resident streams cannot fill: admitted instead of
        them, they would not add to its service, only spread it over more
        requests, which then all progress in lockstep and finish together
        (a lone borrower's closed-loop clients then leave the engine empty
        while they send the next requests; stock vLLM keeps the surplus
        queued, and its slots busy)."""
        lanes = self._lanes
        user_of, in_turn = lanes.user_of, lanes.in_turn
        quota_now = self._ledger.quota_now
        borrows = self._borrowing.table.borrows
        free_slots = (
            self.max_num_running_reqs - len(self.running) - self.num_waiting_for_streaming_input
        )
        # No user can be given more admissions than there are slots: longer
        # lists would only cost a scan of their requests' lengths.
        wanted = max(0, min(free_slots, limit))
        borrowing: dict[str, bool] = {}
        admittable: dict[str, int] = {}  # borrowing user -> its requests worth admitting
        quota: dict[str, int] = {}
        guaranteed = 0
        for request in self.waiting:
            if request.status not in _ADMITTABLE or request in in_turn:
                continue  # held elsewhere, or its quota is reserved already
            user = user_of.get(request)
            if user is None:
                continue
            left = quota.get(user)
            if left is None:
                left = quota_now(user)
            if left > 0:
                quota[user] = left - 1
                guaranteed += 1
                if guaranteed >= limit:
                    break
                continue
            quota[user] = 0
            may = borrowing.get(user)
            if may is None:
                may = borrowing[user] = borrows(user)
            if may:
                costs = queued.setdefault(user, [])
                most = admittable.get(user)
                if most is None:
                    most = admittable[user] = min(wanted, limit - self._hidden_streams(user))
                if len(costs) < most:
                    costs.append(_output_left(request))
        slots = min(free_slots, limit) - guaranteed
        return guaranteed, max(0, min(slots, sum(map(len, queued.values()))))

    def _hidden_streams(self, user: str) -> int:
        """Resident decoding streams of ``user`` the plan did not pay for."""
        lane = self._lanes.order.get(user)
        if lane is None:
            return 0
        lane_of, prepaid = self._lanes.lane_of, self._ledger.prepaid
        return sum(1 for key in lane.decoding if key in lane_of and key not in prepaid)


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

    _draft_account: DraftAccount | None = None

    def _init_drafts(self) -> None:
        if not self.num_spec_tokens:
            return
        self._draft_account = DraftAccount(self.output_rate_limiter, self._ledger.charged_tokens)
        self._charging_reserve_prefill_lookahead = self._charge_with_drafts
        self._reserve_prefill_lookahead = self._charge_with_drafts

    def _charge_with_drafts(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """The charging hook when drafts are scheduled: the sampled token as
        usual, then the drafts the user can pay for now."""
        charge = self._charge_with_prompt_cost if self._prompt_cost_on else self._charge_at_sampling_position
        num_new_tokens = charge(request, num_computed_tokens, num_new_tokens)
        if num_new_tokens <= 0 or self._prepaid is None:
            return num_new_tokens
        drafts = (
            num_computed_tokens
            + num_new_tokens
            - request.num_tokens
            - request.num_output_placeholders
        )
        if drafts <= 0 or request.status != RequestStatus.RUNNING:
            # A waiting request reaching here with drafts is vLLM padding a
            # new decode to the uniform draft count: -1 sentinels, which the
            # model never accepts, so they cost nothing.
            return num_new_tokens
        # Drafts past max_tokens can never be emitted: vLLM stops the request
        # there.  (Tokens still in flight under async scheduling are not
        # subtracted: they may be rejected, so this never under-charges.)
        wanted = max(0, min(drafts, request.max_tokens - request.num_output_tokens - 1))
        paid = self._draft_account.pay(
            request.request_id, self._lanes.user_of[request], self._ledger.now_ns, wanted
        )
        if paid == wanted:
            return num_new_tokens  # any drafts left over lie past max_tokens
        # vLLM keeps the first drafts: cut every draft past those paid for.
        return num_new_tokens - (drafts - paid)

    def _settle_drafts(self, output) -> None:
        """The single refund point for drafts paid in this step."""
        scheduled = output.num_scheduled_tokens
        spec = output.scheduled_spec_decode_tokens

        def drafts_dispatched(req_id: str) -> int:
            return len(spec.get(req_id, ())) if req_id in scheduled else 0

        self._draft_account.settle_step(output, self._ledger.now_ns, drafts_dispatched)

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
    AdapterHooks,
    ResidencyHooks,
    EvictionHooks,
    BorrowingHooks,
    SpecDecodeHooks,
):
    """Per-user output-rate limiting on top of vLLM's V1 ``Scheduler``.

    This class runs the step (plan, hand vLLM the visible requests, settle);
    its bases are the hooks vLLM calls along the way, one concern each.
    Every attribute they share is set here, in ``__init__``.
    """

    #: Clock for the limiter, in integer nanoseconds; tests replace it.
    output_rate_clock: Callable[[], int] = staticmethod(time.monotonic_ns)
    _step_plan: StepPlan | None = None
    _prepaid: set | None = None  # during a step: decoding requests already paid for
    #: During a step with borrowing: user -> waiting requests it may still
    #: have admitted by borrowing (None: admission order is vLLM's).
    _borrow_admits: dict[str, int] | None = None
    #: During a step: waiting requests admitted into a spare slot by
    #: borrowing (see _borrow_admits), which may borrow their sampled token.
    _admitted_to_borrow: set
    _lent_in_step: bool  # some admitted request borrowed its sampled token
    _active_cap: int = 0
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
        self.output_rate_settings = settings
        self.output_rate_limiter = self.output_rate_limiter_factory(settings)
        self.output_rate_gate = gate = StepGate(self.output_rate_limiter)
        # The gate's parts, held directly: membership changes and per-request
        # payments go to them without a call through the gate.
        self._lanes = gate.lanes
        self._ledger = gate.ledger
        #: Seconds the engine loop may wait on its input queue after a step
        #: that ran nothing because every runnable request was throttled;
        #: None means "poll as stock vLLM does".
        self.output_rate_idle_wait_s: float | None = None
        self._chunked_prefill = bool(self.scheduler_config.enable_chunked_prefill)
        self._priority_policy = self.policy == SchedulingPolicy.PRIORITY
        self._refused_visible = 0
        self._preempted_in_step: list[Request] = []
        self._evicted_in_step: list[Request] = []
        self._slot_donors: set[str] = set()  # users who gave up a slot this step
        self._admitted_to_borrow = set()
        self._lent_in_step = False
        # Requests we preempted because their user was out of quota, until
        # they are resident again (see _kv_room_for).
        self._evicted_for_quota: set[Request] = set()
        # What evictions on behalf of waiting requests may make the engine
        # recompute; the budget holds one longest request (none at ratio 0).
        ratio = settings.recompute_budget
        # Resident requests per user: as many as its quota keeps moving at
        # the minimum pace (the planner and Displacement read it too).
        self.output_rate_residency = self._lanes.residency = make_residency(settings)
        self.output_rate_eviction_budget = EvictionBudget(
            burst_tokens=self.vllm_config.model_config.max_model_len if ratio > 0 else 0,
            ratio=ratio,
        )
        self._displacement = Displacement(
            self._lanes,
            self._ledger,
            self.output_rate_eviction_budget,
            self._evicted_for_quota,
            tokens_held=_tokens_held,
            priority_of=_priority_of if self._priority_policy else None,
            can_release=self._request_blocks_can_be_freed,
            residency=self.output_rate_residency,
            generated_of=_generated,
        )
        self._held_for_other_reasons = False
        self._stock_allocate_slots = self.kv_cache_manager.allocate_slots
        # Bound once: this hook runs for every scheduled request of every step.
        self._stock_reserve_prefill_lookahead = super()._reserve_prefill_lookahead
        self._charging_reserve_prefill_lookahead = self._charge_at_sampling_position
        # vLLM calls self._reserve_prefill_lookahead for every request it
        # schedules.  It is an instance attribute that always exists and only
        # changes value (keeping the instance's attribute layout stable, which
        # CPython's attribute caches in vLLM's loop rely on).
        self._reserve_prefill_lookahead = self._charging_reserve_prefill_lookahead
        self._tracks_sessions = False
        # Prompt cost (input_token_weight): at weight 0 the hook stays as set above.
        self._init_prompt_cost(settings.input_token_weight)
        self._init_drafts()
        self._borrowing = None
        self.apply_output_rate_shares(settings)
        # A data-parallel rank whose requests are all throttled must keep
        # stepping (vLLM runs a dummy batch and syncs the ranks every step):
        # waiting on its input queue would stall every other rank with it.
        self._data_parallel = self.vllm_config.parallel_config.data_parallel_size > 1

    # -- the active cap, seen through vLLM's own admission check -----------

    @property
    def max_num_active_reqs(self) -> int:
        plan = self._step_plan
        if plan is None:
            return self._active_cap
        self._resume_charging()  # vLLM's waiting loop reads this first
        if plan.over_cap:
            return 0  # runnable requests were left out for lack of room
        return min(
            self._active_cap + self._refused_visible,
            self.max_num_running_reqs - plan.hidden,
        )

    @max_num_active_reqs.setter
    def max_num_active_reqs(self, value: int) -> None:
        self._active_cap = value


    def shutdown(self) -> None:
        super().shutdown()
        self.output_rate_limiter.close()  # a shared-store limiter stops its lease thread
        if self._borrowing is not None and self._borrowing.ceiling is not None:
            self._borrowing.ceiling.close()
        if self.output_rate_groups is not None:
            self.output_rate_groups.close()

    # -- one step ------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any):
        gate = self.output_rate_gate
        lanes = self._lanes
        slots = self._active_cap - self.num_waiting_for_streaming_input
        now_ns = self.output_rate_clock()
        if self._prompt_debts:
            self.output_rate_prompt_cost.repay(now_ns)
        if gate.steady(now_ns, slots):
            return self._schedule_repeat(args, kwargs)
        plan = gate.plan(now_ns, slots)
        self._borrow_admits = None  # set by the borrowing's waiting demand
        if gate.borrowing is not None and not plan.over_cap:
            self._offer_spare_to_borrowers(plan, slots)
        resident = self.running
        num_visible = len(plan.visible) + len(plan.borrowed)
        # The gate decides which requests vLLM sees; vLLM's own order among
        # them (admission order) decides who gets the token budget first and
        # who is preempted first, exactly as in stock vLLM.
        if plan.borrowed:
            # Borrowers last: vLLM's token budget reaches them last, and its
            # preemption (from the end of `running`) first.
            lanes.in_admission_order(plan.visible)
            self.running = plan.visible + plan.borrowed
        elif plan.hidden:
            lanes.in_admission_order(plan.visible)
            self.running = plan.visible  # vLLM appends admissions to it
        else:
            self.running = list(resident)
        all_visible_prepaid = not plan.prefills
        self._begin_step(plan, plan.prepaid, all_visible_prepaid)
        if plan.throttled and self.waiting:
            self._free_slots_for_waiting(plan, len(resident))
        kv_cache_manager = self.kv_cache_manager
        if plan.throttled:
            # Hidden throttled requests exist: allocation failures evict them
            # first.  Otherwise vLLM talks to its own KV cache manager.
            self.kv_cache_manager = _EvictingKVCacheManager(
                kv_cache_manager, self._allocate_slots_or_evict
            )
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.kv_cache_manager = kv_cache_manager
            self._resume_charging()
            self._step_plan = None
            self._prepaid = None
            self._borrow_admits = None
            if self._admitted_to_borrow:
                self._admitted_to_borrow.clear()
            admitted = self._settle_membership(resident, num_visible)
            for victim in self._evicted_in_step:
                self.waiting.prepend_request(victim)

        num_scheduled = output.num_scheduled_tokens
        for request in plan.prefills:
            if request.request_id in num_scheduled:
                lanes.set_progressing(request, _can_progress_unpaid(request))
        # Every prepaid stream sampled iff, with nothing preempted, every
        # visible request was scheduled (all of them decoding streams, each
        # at its sampling position): a count, not a look at each request.
        undisturbed = (
            all_visible_prepaid
            and not plan.reserved
            and not self._preempted_in_step
            and len(num_scheduled) - len(admitted) == num_visible
        )
        sampled = _SampledView(num_scheduled)
        self._ledger.settle(sampled, all_prepaid_sampled=undisturbed)
        if plan.borrowed or self._lent_in_step:
            self._lent_in_step = False
            gate.borrowing.settle(lanes, self._ledger, sampled)
        if self._prompt_cost_on:
            self._settle_prompt_cost(output)
        if self._draft_account is not None:
            self._settle_drafts(output)
        self.output_rate_eviction_budget.earn(len(num_scheduled))
        self._set_idle_wait(output)
        return output

    def _schedule_repeat(self, args: tuple, kwargs: dict):
        """A step that repeats the last one (see ``StepGate.steady``).

        Every resident request is decoding and already paid for, so vLLM
        gets the whole resident list in its current order: no visible list
        to build or merge back, and its running loop calls its own hook
        directly.  Admissions from the waiting queue are charged as usual.
        """
        resident = self.running
        num_resident = len(resident)
        self.running = list(resident)  # vLLM edits this copy; `resident` keeps the start
        self._begin_step(_REPEAT_PLAN, _NOTHING_PREPAID, all_visible_prepaid=True)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self._resume_charging()
            self._step_plan = None
            self._prepaid = None
            # vLLM removed what it preempted from `running` (the whole
            # resident list here), so only the admissions need settling.
            admitted = self._admit_new(self.running, num_resident)
        num_scheduled = output.num_scheduled_tokens
        # The quick settlement counts every decoding stream in the lanes as
        # sampled; an admission cut short of its sampling position (its user
        # could not pay) is one of them now, so such a step settles key by
        # key (issue 31: tokens counted that were neither taken nor given).
        all_sampled = (
            not self._preempted_in_step
            and len(num_scheduled) - len(admitted) == num_resident
            and not any(request.is_prefill_chunk for request in admitted)
        )
        self._ledger.settle_repeat(resident, _SampledView(num_scheduled), all_sampled)
        if self._prompt_cost_on:
            self._settle_prompt_cost(output)
        if self._draft_account is not None:
            self._settle_drafts(output)
        self.output_rate_eviction_budget.earn(len(num_scheduled))
        self._set_idle_wait(output)
        return output

    def _begin_step(self, plan: StepPlan, prepaid: Container, all_visible_prepaid: bool) -> None:
        """Reset the per-step state both kinds of step share."""
        self._refused_visible = 0
        self._preempted_in_step = []
        self._evicted_in_step = []
        self._slot_donors = set()
        self._held_for_other_reasons = False
        self._prepaid = prepaid
        self._step_plan = plan
        self._running_at_start = len(self.running)
        if all_visible_prepaid and self._draft_account is None:
            # vLLM's running loop will only meet decoding streams already
            # paid for, so it may call its own hook directly, without this
            # class's per-request check.  Charging resumes before the waiting
            # loop reaches its first request (see _resume_charging).
            self._reserve_prefill_lookahead = self._stock_reserve_prefill_lookahead

    def _admit_new(self, running_after: list[Request], num_before: int) -> list[Request]:
        """Classify and return the requests vLLM admitted in this step.

        vLLM only appends admitted requests to ``running`` and removes
        preempted ones, so without preemption the admissions are its tail.
        """
        lanes = self._lanes
        if self._preempted_in_step:
            admitted = [r for r in running_after if r not in lanes.lane_of]
        else:
            admitted = running_after[num_before:]
        evicted = self._evicted_for_quota
        for request in admitted:
            lanes.admit(request, _can_progress_unpaid(request))
            if evicted:
                evicted.discard(request)
        return admitted

    def _set_idle_wait(self, output) -> None:
        if (
            output.total_num_scheduled_tokens == 0
            and not self._held_for_other_reasons
            and not self._data_parallel
        ):
            wait_ns = self.output_rate_gate.idle_wait_ns()
            self.output_rate_idle_wait_s = None if wait_ns is None else wait_ns / 1e9
        else:
            self.output_rate_idle_wait_s = None

    def _settle_membership(self, resident: list[Request], num_visible: int) -> list[Request]:
        """Make ``self.running`` the full resident list again, admissions included.

        Runs after vLLM's schedule() advanced every request, so an admitted
        request is classified (prefilling or decoding) once, here.
        """
        admitted = self._admit_new(self.running, num_visible)
        if self._preempted_in_step:
            resident = remove_all(resident, set(self._preempted_in_step))
        resident.extend(admitted)
        self.running = resident
        return admitted


class _EvictingKVCacheManager:
    """The scheduler's KV cache manager as seen during a step with throttled requests.

    ``allocate_slots`` is replaced; every other attribute is the real
    manager's.  A stand-in object rather than an attribute set on the real
    manager: touching the real manager's instance dict makes CPython's
    attribute caches miss on every later access vLLM makes to it (measured:
    about 3 000 instructions per scheduled request per step).
    """

    __slots__ = ("_real", "allocate_slots")

    def __init__(self, real: Any, allocate_slots: Callable) -> None:
        self._real = real
        self.allocate_slots = allocate_slots

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


_NOTHING_PREPAID: frozenset = frozenset()
# Waiting requests vLLM could admit in this step (not held for grammar,
# remote KV or a streaming-input chunk).
_ADMITTABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
# What max_num_active_reqs and the waiting-queue hooks see during a repeated
# step: every resident request offered, none hidden, nobody throttled.
_REPEAT_PLAN = StepPlan(
    visible=[], hidden=0, over_cap=False, prepaid=_NOTHING_PREPAID, prefills=[], throttled=False
)


class _SampledView:
    """``key in view``: the request was scheduled at a sampling position."""

    __slots__ = ("_scheduled",)

    def __init__(self, num_scheduled_tokens: dict[str, int]) -> None:
        self._scheduled = num_scheduled_tokens

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._scheduled and not request.is_prefill_chunk


def _can_progress_unpaid(request: Request) -> bool:
    """At least two positions left: the next chunk need not sample."""
    remaining = (
        request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
    )
    return remaining >= 2


def _output_left(request: Request) -> int:
    """Tokens the request may still output (at most: it may stop sooner)."""
    return max(request.max_tokens - request.num_output_tokens, 1)


def _generated(request: Request) -> int:
    """Output tokens a request has generated (released least-first)."""
    return request.num_output_tokens


def _tokens_held(request: Request) -> int:
    """What recomputing an evicted request costs (as if no prefix were cached)."""
    return request.num_computed_tokens


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


def _priority_of(request: Request) -> int:
    return request.priority


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
