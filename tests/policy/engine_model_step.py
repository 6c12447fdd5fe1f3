"""The engine model's counterpart of ``adapter/scheduler.py``: the policy's
:class:`~vllm_output_rate.policy.step.StepPolicy` behind the model engine's
seam (:class:`engine_model.Policy`), as thin as the adapter's hooks.

``ModelStepPolicy`` is the model's policy; it is also the
:class:`~vllm_output_rate.policy.step.EngineView` the step policy reads (the
model engine's running list, slots, waiting queue, KV) and acts through
(``evict``, ``give_up_slot``).  The parts are assembled as the adapter's
``__init__`` and ``configure`` assemble them; every decision is StepPolicy's.

Left out, as the model has none of it: LoRA, multimodal items, drafts,
streaming-input sessions, data parallelism and stores.
"""

from __future__ import annotations

import dataclasses

from engine_model import PREEMPTED, RUNNING, WAITING, Engine, EngineConfig, Req, StepRecord

from vllm_output_rate.factory import (
    make_borrowing,
    make_group_quotas,
    make_limiter,
    make_residency,
    update_residency,
)
from vllm_output_rate.policy.displacement import Displacement, fits_in_free_kv
from vllm_output_rate.policy.eviction import EvictionBudget
from vllm_output_rate.policy.gate import StepGate
from vllm_output_rate.policy.prompt_cost import PromptCost
from vllm_output_rate.policy.step import EngineFacts, StepDecision, StepPolicy
from vllm_output_rate.settings import OutputRateSettings

MAX_MODEL_LEN = 2048  # the eviction budget's burst (one longest request)


def settings_of(section: dict) -> OutputRateSettings:
    return OutputRateSettings.from_additional_config({"output_rate": section})


class _Outcome:
    """What the engine scheduled, as StepPolicy.end reads it."""

    def __init__(self, record: StepRecord) -> None:
        self.num_scheduled_tokens = {r.request_id: n for r, n in record.scheduled.items()}
        self.total_num_scheduled_tokens = record.total_tokens
        self.scheduled_spec_decode_tokens: dict = {}


class _Decision:
    """The step's decision as the model engine asks it (the adapter's hooks)."""

    def __init__(self, step: StepDecision) -> None:
        self.step = step
        self.visible = step.visible

    def active_cap(self) -> int:  # max_num_active_reqs during a step
        return self.step.active_cap()

    def may_admit(self, request: Req) -> bool:  # _handle_blocked_waiting_request
        step = self.step
        if request.status == WAITING and request.num_computed_tokens == 0 and not step.may_consider(
            request
        ):
            return False
        return step.may_admit(request, request.status == PREEMPTED)

    def may_start(self, request: Req, computed: int) -> bool:  # _ec_transfer_pending
        return self.step.may_start(request, computed)

    def tokens_for(self, request: Req, computed: int, new: int) -> int:  # _reserve_prefill_lookahead
        return self.step.tokens_for(request, computed, new, request.status == RUNNING)

    def victim_for(self, request: Req) -> Req | None:  # the evicting KV cache manager
        if not self.step.plan.throttled:
            return None
        return self.step.victim_for(request, request.status == RUNNING)


class ModelStepPolicy:
    """StepPolicy behind the model engine's seam; the engine's view for it."""

    def __init__(self, section: dict, config: EngineConfig) -> None:
        settings = settings_of(section)
        self.burst_seconds = settings.burst_seconds
        self.config = config
        self.engine: Engine | None = None
        self.limiter = make_limiter(settings)
        gate = StepGate(self.limiter)
        self.evicted: set[Req] = set()
        ratio = settings.recompute_budget
        budget = EvictionBudget(burst_tokens=MAX_MODEL_LEN if ratio > 0 else 0, ratio=ratio)
        residency = gate.lanes.residency = make_residency(settings)
        displacement = Displacement(
            gate.lanes, gate.ledger, budget, self.evicted,
            tokens_held=lambda r: r.num_computed_tokens,
            priority_of=(lambda r: r.priority) if config.priority else None,
            can_release=lambda r: True,
            residency=residency,
            generated_of=lambda r: r.num_output_tokens,
        )
        prompt_cost = gate.prompt_cost = PromptCost(gate.ledger, settings.input_token_weight)
        facts = EngineFacts(chunked_prefill=config.chunked, priority_policy=config.priority,
                            data_parallel=False)
        self.step_policy = StepPolicy(gate, facts, budget, residency, displacement, prompt_cost,
                                      None, self.evicted)
        self.groups = None
        self.last_borrow_admits: dict[str, int] = {}
        self.last_counters: dict[str, float] = {}
        self.last_step: StepDecision | None = None
        self.configure(settings)

    # What the properties read of the policy's state.
    @property
    def ledger(self):
        return self.step_policy.ledger

    @property
    def lanes(self):
        return self.step_policy.lanes

    @property
    def residency(self):
        return self.step_policy.residency

    @property
    def prompt_cost(self):
        return self.step_policy.prompt_cost

    @property
    def borrowing(self):
        return self.step_policy.borrowing

    def configure(self, settings: OutputRateSettings) -> None:
        """The adapter's ``configure``: features from the settings, state kept."""
        sp = self.step_policy
        groups = make_group_quotas(settings, self.groups)
        borrowing, quota = make_borrowing(settings, self.limiter, sp.borrowing, groups)
        self.groups = groups
        sp.gate.borrowing = borrowing
        sp.ledger.limiter = quota
        sp.prompt_cost.set_weight(settings.input_token_weight)
        sp.prompt_cost.group_of = None if groups is None else groups.of
        update_residency(sp.residency, settings)

    def reload(self, section: dict) -> None:
        """``apply_output_rate_limits``: the rates first, then the features;
        the burst is the startup one (a limits file cannot change it)."""
        new = dataclasses.replace(settings_of(section), burst_seconds=self.burst_seconds)
        self.limiter.update_rates(new.default_rate, new.user_rates)
        self.configure(new)

    # -- the model engine's seam -------------------------------------------------

    def on_add(self, request: Req) -> None:
        self.step_policy.on_add(request, request.user)

    def on_preempt(self, request: Req) -> None:
        self.step_policy.on_preempt(request)

    def on_free(self, request: Req) -> None:
        # As the adapter's _free_request hooks: prompt cost forgets it, then
        # the step policy; a user with nothing left loses its credit.
        sp = self.step_policy
        sp.prompt_cost.forget(request)
        sp.on_free(request)
        if request.user not in sp.lanes.order:
            sp.prompt_cost.forget_user(request.user)

    def begin(self, engine: Engine, now_ns: int) -> _Decision:
        self.engine = engine
        step = self.step_policy.begin(self, now_ns)
        self.last_borrow_admits = dict(step.borrow_admits or {})
        # The virtual counters as the step's water-filling starts from them
        # (a returning borrower lifted to the floor), before its grants.
        borrowing = self.step_policy.borrowing
        self.last_counters = {} if borrowing is None else dict(borrowing.counters)
        return _Decision(step)

    def end(self, decision: _Decision, record: StepRecord) -> None:
        step = decision.step
        num_before = len(step.resident) if step.repeat else step.num_offered
        self.step_policy.record_admissions(step, record.running_after, num_before)
        self.step_policy.end(step, _Outcome(record))
        self.last_step = step

    def idle_wait_ns(self) -> int | None:
        return self.step_policy.idle_wait_ns()

    # -- EngineView: what the step policy reads of the engine ---------------------

    @property
    def running(self):
        return self.engine.running

    def active_slots(self) -> int:
        return self.config.active_cap

    def configured_active_cap(self) -> int:
        return self.config.active_cap

    def max_resident(self) -> int:
        return self.config.max_num_seqs

    def free_slots(self) -> int:
        return self.config.max_num_seqs - len(self.engine.running)

    def has_waiting(self) -> bool:
        return bool(self.engine.waiting)

    def admittable_waiting(self):
        return self.engine.queue_order()

    def token_budget(self) -> tuple[int, int, int]:
        return self.config.token_budget, 1, 0

    def kv_room_for(self, request: Req) -> bool:
        engine = self.engine
        return fits_in_free_kv(request.num_tokens, engine.config.block_size, len(engine.running),
                               engine.free_blocks)

    def evict(self, request: Req) -> None:
        self.engine.evict(request)

    def give_up_slot(self, request: Req) -> None:
        self.engine.give_up(request)

    def engine_chunk(self, request: Req, num_computed_tokens: int, num_new_tokens: int) -> int:
        return num_new_tokens

    def chunk_end_before(self, request: Req, num_computed_tokens: int, allowed: int) -> int:
        return allowed
