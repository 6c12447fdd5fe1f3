"""The model engine's counterpart of ``adapter/scheduler.py``: today's policy
objects (StepGate, its lanes and ledger, Borrowing, Residency, Displacement,
PromptCost, EvictionBudget) driven through the engine model's seam
(:class:`~engine_model.Policy`), hook for hook as the adapter drives them.

Brief F asked to drive E's ``policy/step.py`` (StepPolicy.begin / end /
idle_wait_ns); until that object decides the step, this seam repeats the
adapter's wiring so the properties judge what the real scheduler runs today.
When StepPolicy decides the whole step, this file shrinks to forwarding.

Left out, each of which the adapter has and the model does not need: the
repeated-step fast path (``StepGate.steady``: a property test shows it is
equivalent to a planned step), LoRA, multimodal inputs, drafts, streaming
sessions, data parallelism and stores.
"""

from __future__ import annotations

from engine_model import PREEMPTED, RUNNING, WAITING, Engine, EngineConfig, Req, StepRecord

from vllm_output_rate.factory import (
    make_borrowing,
    make_group_quotas,
    make_limiter,
    make_residency,
    update_residency,
)
from vllm_output_rate.policy.demand import waiting_demand
from vllm_output_rate.policy.displacement import Displacement, fits_in_free_kv
from vllm_output_rate.policy.eviction import EvictionBudget
from vllm_output_rate.policy.gate import StepGate, StepPlan
from vllm_output_rate.policy.handover import slot_handover
from vllm_output_rate.policy.prompt_cost import PromptCost
from vllm_output_rate.settings import OutputRateSettings

MAX_MODEL_LEN = 2048  # the eviction budget's burst (one longest request)


def settings_of(section: dict) -> OutputRateSettings:
    return OutputRateSettings.from_additional_config({"output_rate": section})


class _Step:
    """What one step decided so far (the adapter's ``_Step``)."""

    def __init__(self, plan: StepPlan, running_at_start: int, borrow_admits) -> None:
        self.plan = plan
        self.prepaid = plan.prepaid
        self.running_at_start = running_at_start
        self.borrow_admits = borrow_admits
        self.refused_visible = 0
        self.preempted: list[Req] = []
        self.slot_donors: set[str] = set()
        self.admitted_to_borrow: set[Req] = set()
        self.refused_for_prompts: set[str] = set()
        self.visible_now: set[Req] | None = None


class GateDecision:
    """The engine loop's questions, answered as the adapter's hooks answer them."""

    def __init__(self, policy: GatePolicy, engine: Engine, step: _Step, visible: list[Req]) -> None:
        self.p = policy
        self.engine = engine
        self.step = step
        self.visible = visible

    # max_num_active_reqs during a step
    def active_cap(self) -> int:
        step, cfg = self.step, self.engine.config
        if step.plan.over_cap:
            return 0
        return min(cfg.active_cap + step.refused_visible, cfg.max_num_seqs - step.plan.hidden)

    # _handle_blocked_waiting_request (PromptCostHooks, then ChargingHooks)
    def may_admit(self, request: Req) -> bool:
        p, step = self.p, self.step
        pc = p.prompt_cost
        if pc.debt and pc.weight and request.status == WAITING and request.num_computed_tokens == 0:
            user = p.lanes.user_of[request]
            if user in pc.debt and request not in pc.charged_upto:
                pc.can_pay(request, user)
                step.refused_for_prompts.add(user)
                return False
        if not self._residency_admits(request):
            return False
        ledger = p.ledger
        user_of = p.lanes.user_of
        if step.slot_donors:
            return user_of[request] not in step.slot_donors and ledger.charge(request, take=False)
        samples_at_once = (
            not p.chunked or request.num_tokens - request.num_computed_tokens <= 1
        )
        if samples_at_once:
            if request in p.evicted and not self._kv_room_for(request):
                return False
            return ledger.charge(request, take=False)
        if request.status == PREEMPTED:
            if not (ledger.charge(request, take=False) or ledger.is_served_now(request)):
                if step.borrow_admits is None or (
                    request in p.evicted and not self._kv_room_for(request)
                ):
                    return False
                return self._admit_to_borrow(request)
            return request not in p.evicted or self._kv_room_for(request)
        if step.borrow_admits is not None:
            return self._admit_to_borrow(request)
        return True

    def _admit_to_borrow(self, request: Req) -> bool:
        p, step = self.p, self.step
        admits = step.borrow_admits
        user = p.lanes.user_of[request]
        if p.ledger.quota_now(user) == 0 and p.borrowing.table.borrows(user):
            left = admits.get(user, 0)
            if left <= 0:
                return False
            admits[user] = left - 1
            step.admitted_to_borrow.add(request)
        return True

    def _residency_admits(self, request: Req) -> bool:
        p, step = self.p, self.step
        user_of = p.lanes.user_of
        user = user_of[request]
        room = p.residency.room(user, p.lanes.resident_count(user))
        if room is None:
            return True
        if room <= 0:
            return self._displace_own_stream(request)
        admitted = 0
        for r in self.engine.running[step.running_at_start:]:
            if user_of.get(r) == user:
                admitted += 1
                if admitted >= room:
                    return self._displace_own_stream(request)
        return True

    def _displace_own_stream(self, request: Req) -> bool:
        p, step = self.p, self.step
        if not p.priority:
            return False
        if step.visible_now is None:
            step.visible_now = set(self.engine.running)
        offered = step.visible_now
        victim = p.displacement.own_stream_victim(request, lambda r: r not in offered)
        if victim is None:
            return False
        p.evict(self.engine, victim)
        step.plan.hidden -= 1
        return True

    def _kv_room_for(self, request: Req) -> bool:
        engine = self.engine
        return fits_in_free_kv(
            request.num_tokens, engine.config.block_size, len(engine.running), engine.free_blocks
        )

    # _ec_transfer_pending (ChargingHooks, then PromptCostHooks): True = go on
    def may_start(self, request: Req, computed: int) -> bool:
        p, step = self.p, self.step
        if request.num_tokens - computed <= 1:
            if not p.ledger.charge(request, take=False) and not (
                request in step.admitted_to_borrow
                and p.borrowing.can_lend(p.lanes.user_of[request], p.ledger.now_ns)
            ):
                return False
        pc = p.prompt_cost
        if not pc.weight:
            return True
        num_prompt = request.num_prompt_tokens
        if computed >= num_prompt or not pc.uncharged(request, computed, num_prompt, num_prompt):
            return True
        user = p.lanes.user_of[request]
        if pc.can_pay(request, user):
            return True
        step.refused_for_prompts.add(user)
        return False

    # _reserve_prefill_lookahead
    def tokens_for(self, request: Req, computed: int, new: int) -> int:
        p = self.p
        pc = p.prompt_cost
        if pc.weight:
            num_prompt = request.num_prompt_tokens
            if computed < num_prompt and pc.uncharged(request, computed, new, num_prompt):
                user = p.lanes.user_of[request]
                if not pc.can_pay(request, user):
                    if request.status == RUNNING:
                        self.step.refused_visible += 1
                    self.step.refused_for_prompts.add(user)
                    return 0
                new = self._charge_output(request, computed, new)
                if new > 0:
                    pc.charge(request, user, computed, new, num_prompt)
                return new
        return self._charge_output(request, computed, new)

    def _charge_output(self, request: Req, computed: int, new: int) -> int:
        p, step = self.p, self.step
        if new <= 0 or request in step.prepaid:
            return new
        sample_at = request.num_tokens
        if computed + new < sample_at:
            return new
        if p.ledger.charge(request):
            return new
        if request in step.admitted_to_borrow and p.gate.lend(request):
            return new
        allowed = max(sample_at - 1 - computed if p.chunked else 0, 0)
        if allowed == 0 and request.status == RUNNING:
            step.refused_visible += 1
        return allowed

    # the evicting KV cache manager
    def victim_for(self, request: Req) -> Req | None:
        p = self.p
        if not self.step.plan.throttled:
            return None
        running = request.status == RUNNING
        least_important = None
        if p.priority and running and self.engine.running:
            least_important = max(r.priority for r in self.engine.running)
        victim = p.displacement.victim_for(request, not running, least_important)
        if victim is not None:
            p.evict(self.engine, victim)
        return victim


class GatePolicy:
    """Today's policy objects behind the model engine's seam."""

    def __init__(self, section: dict, config: EngineConfig) -> None:
        settings = settings_of(section)
        self.chunked = config.chunked
        self.priority = config.priority
        self.limiter = make_limiter(settings)
        self.gate = StepGate(self.limiter)
        self.lanes = self.gate.lanes
        self.ledger = self.gate.ledger
        self.evicted: set[Req] = set()
        ratio = settings.recompute_budget
        self.budget = EvictionBudget(burst_tokens=MAX_MODEL_LEN if ratio > 0 else 0, ratio=ratio)
        self.residency = self.lanes.residency = make_residency(settings)
        self.displacement = Displacement(
            self.lanes, self.ledger, self.budget, self.evicted,
            tokens_held=lambda r: r.num_computed_tokens,
            priority_of=(lambda r: r.priority) if config.priority else None,
            can_release=lambda r: True,
            residency=self.residency,
            generated_of=lambda r: r.num_output_tokens,
        )
        self.prompt_cost = self.gate.prompt_cost = PromptCost(self.ledger, settings.input_token_weight)
        self.groups = None
        self.borrowing = None
        self._step: _Step | None = None
        self._wait: int | None = None
        self.configure(settings)

    def configure(self, settings: OutputRateSettings) -> None:
        self.settings = settings
        groups = make_group_quotas(settings, self.groups)
        borrowing, quota = make_borrowing(settings, self.limiter, self.borrowing, groups)
        self.groups = groups
        self.borrowing = self.gate.borrowing = borrowing
        self.ledger.limiter = quota
        self.prompt_cost.set_weight(settings.input_token_weight)
        self.prompt_cost.group_of = None if groups is None else groups.of
        update_residency(self.residency, settings)

    def reload(self, section: dict) -> None:
        """``apply_output_rate_limits``: the rates first, then the features."""
        new = settings_of(section)
        self.limiter.update_rates(new.default_rate, new.user_rates)
        self.configure(new)

    # -- membership ------------------------------------------------------------

    def on_add(self, request: Req) -> None:
        self.lanes.track(request, request.user)
        if not self.chunked:
            self.lanes.wait_in_turn(request)

    def on_preempt(self, request: Req) -> None:
        self.lanes.release(request)
        if not self.chunked:
            self.lanes.wait_in_turn(request)
        if self._step is not None:
            self._step.preempted.append(request)

    def on_free(self, request: Req) -> None:
        self.prompt_cost.forget(request)
        user = self.lanes.user_of.get(request)
        self.lanes.forget(request)
        self.evicted.discard(request)
        if user is not None and user not in self.lanes.order:
            self.prompt_cost.forget_user(user)

    def evict(self, engine: Engine, victim: Req) -> None:
        self.budget.spend(victim.num_computed_tokens)
        self.evicted.add(victim)
        engine.evict(victim)

    # -- one step ------------------------------------------------------------

    def begin(self, engine: Engine, now_ns: int) -> GateDecision:
        gate, lanes = self.gate, self.lanes
        cfg = engine.config
        slots = cfg.active_cap
        pc = self.prompt_cost
        if pc.debt:
            pc.repay(now_ns)
        plan = gate.plan(now_ns, slots)
        borrow_admits = None
        if gate.borrowing is not None and not plan.over_cap:
            borrow_admits = self._offer_spare(engine, plan, slots)
        if plan.borrowed:
            lanes.in_admission_order(plan.visible)
            visible = plan.visible + plan.borrowed
        elif plan.hidden:
            lanes.in_admission_order(plan.visible)
            visible = list(plan.visible)
        else:
            visible = list(engine.resident)
        #: What the judge reads of the step: admissions set aside for borrowers.
        self.last_borrow_admits = dict(borrow_admits or {})
        self._step = step = _Step(plan, len(visible), borrow_admits)
        decision = GateDecision(self, engine, step, visible)
        if plan.throttled and engine.waiting:
            engine.running = visible  # what free_slots_for's evictions edit
            step.slot_donors = self.displacement.free_slots_for(
                [r for r in engine.waiting],
                plan,
                free_slots=cfg.max_num_seqs - len(engine.resident),
                active_cap=slots,
                evict=lambda victim: self.evict(engine, victim),
            )
            engine.running = engine.resident
        return decision

    def _offer_spare(self, engine: Engine, plan: StepPlan, slots: int):
        room = slots - len(plan.visible) - plan.reserved
        queued = None
        receiver = None
        if room > 0 and (self.ledger.short or engine.waiting):
            queued = {}
            guaranteed, admissions = waiting_demand(
                list(engine.waiting), self.lanes, self.ledger, self.borrowing.table.borrows,
                self.residency, limit=room,
                free_slots=engine.config.max_num_seqs - len(engine.resident),
                output_left=_output_left, queued=queued,
            )
            room -= guaranteed + admissions
            if queued and not admissions and room > 0:
                receiver = self._hand_over(engine, plan, room, queued)
                if receiver is not None:
                    room -= 1
        else:
            admissions = 0
        self.gate.borrow(plan, room, queued or ())
        if queued is None:
            return None
        admits: dict[str, int] = {}
        if admissions:
            committed = self._committed_output(engine, queued)
            for user in self.borrowing.admissions(queued, committed, admissions):
                admits[user] = admits.get(user, 0) + 1
        if receiver is not None:
            admits[receiver] = admits.get(receiver, 0) + 1
        return admits

    def _hand_over(self, engine: Engine, plan: StepPlan, room: int, users) -> str | None:
        if (
            self.priority or not self.chunked or self.prompt_cost.weight
            or engine.config.max_num_seqs - len(engine.resident) > 0
        ):
            return None
        pair = slot_handover(self.borrowing, self.lanes, users, room, ledger=self.ledger)
        if pair is None:
            return None
        donor, receiver = pair
        victim = self.displacement.handover_victim(donor)
        if victim is None:
            return None
        self.evict(engine, victim)
        plan.hidden -= 1
        return receiver

    def _committed_output(self, engine: Engine, users) -> dict[str, int]:
        user_of = self.lanes.user_of
        group_of = self.borrowing.table.group_of
        groups = {group_of(u) for u in users} - {None}
        committed: dict[str, int] = {}
        for request in engine.resident:
            user = user_of.get(request)
            if user is None:
                continue
            if user in users or (groups and group_of(user) in groups):
                committed[user] = committed.get(user, 0) + _output_left(request)
        return committed

    def end(self, decision: GateDecision, record: StepRecord) -> None:
        step = decision.step
        self._step = None
        self.last_step = step  # what the judge reads of the step
        lanes = self.lanes
        for request in record.admitted:
            lanes.admit(request, _can_progress_unpaid(request))
            self.evicted.discard(request)
        scheduled = record.scheduled
        for request in step.plan.prefills:
            if request in scheduled:
                lanes.set_progressing(request, _can_progress_unpaid(request))
        plan = step.plan
        num_visible = len(plan.visible) + len(plan.borrowed)
        undisturbed = (
            not plan.prefills and not plan.reserved and not step.preempted
            and len(scheduled) - len(record.admitted) == num_visible
        )
        sampled = _Sampled(scheduled)
        self.gate.settle(sampled, all_prepaid_sampled=undisturbed)
        pc = self.prompt_cost
        if pc.weight:
            if pc.step_charges:
                pc.settle(lambda r: scheduled.get(r, 0), self.ledger.now_ns)
            order = lanes.order
            for user in step.refused_for_prompts:
                if user in order:
                    order.move_to_end(user)
        self.budget.earn(len(scheduled))
        self._wait = self.gate.idle_wait_ns() if not scheduled else None

    def idle_wait_ns(self) -> int | None:
        return self._wait


class _Sampled:
    __slots__ = ("_scheduled",)

    def __init__(self, scheduled) -> None:
        self._scheduled = scheduled

    def __contains__(self, request: Req) -> bool:
        return request in self._scheduled and not request.is_prefill_chunk


def _can_progress_unpaid(request: Req) -> bool:
    return request.num_tokens - request.num_computed_tokens >= 2


def _output_left(request: Req) -> int:
    return max(request.max_tokens - request.num_output_tokens, 1)
