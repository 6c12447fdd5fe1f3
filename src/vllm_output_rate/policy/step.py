"""One step's decisions, asked by an engine loop: :class:`StepPolicy`.

The order in which an engine loop (vLLM's ``Scheduler.schedule`` through the
adapter, or a model engine in the tests) must call it.  Between steps, as
requests come and go: ``policy.on_add(request, user, resumable)`` on arrival,
``policy.on_preempt(request, resumable)`` when the engine preempts one,
``policy.on_free(request)`` when one finishes or is aborted.  Once per step::

    decision = policy.begin(view, now_ns)         # 1. before anything is scheduled
    running list = decision.visible               #    (None: every resident request)
    for request in the running list:              # 2. the engine's running loop
        n = decision.tokens_for(request, computed, new, running=True)
        allocation fails -> decision.victim_for(request, running=True)
            (a victim: it was evicted, retry; None: the engine's own preemption)
    for request in the waiting queue:             # 3. the waiting loop (none after a preemption)
        stop once len(running list) >= decision.active_cap()
        a new request (nothing computed): if not decision.may_consider(request): skip it
        (then the engine's own checks; a request they hold is not asked below)
        with a LoRA adapter: if not decision.adapter_fits(adapter, max_adapters): skip it
        if not decision.may_admit(request, preempted):  skip it (it keeps its place)
        after the prefix-cache lookup:
        if not decision.may_start(request, computed):   skip it
        n = decision.tokens_for(request, computed, new, running=False)
        allocation fails -> decision.victim_for(request, running=False), as above
    policy.end(decision, outcome)                 # 4. the one settle
    policy.idle_wait_ns()                         # 5. if the step scheduled nothing

``decision.repeat`` is True for a step that repeats the last one (every
resident stream offered and paid in bulk, see ``StepGate.steady``): the engine
then offers every resident request in its own order and ``tokens_for`` need
not be asked in its running loop (``decision.all_visible_paid``).

Requests are the engine's own objects, used as keys; what the policy reads
of one is :class:`StepRequest` (vLLM's ``Request`` has every member; a plain
test object must too).  What the policy reads of the engine is
:class:`EngineView` (the adapter's scheduler is one; nothing is copied).
The decision has no effect outside the policy's own parts except through
``view.evict`` (a request the policy chose to give way: the engine preempts
it and keeps it out of the waiting queue until the step ends).

Plain Python: no vLLM import.
"""

from __future__ import annotations

from typing import Any, Container, Hashable, Iterable, Protocol, Sequence, cast

from vllm_output_rate.policy.borrow import Borrowing
from vllm_output_rate.policy.demand import PrefillBudget, unpaid_decoding, waiting_demand
from vllm_output_rate.policy.displacement import Displacement
from vllm_output_rate.policy.drafts import DraftAccount
from vllm_output_rate.policy.eviction import EvictionBudget
from vllm_output_rate.policy.gate import StepGate
from vllm_output_rate.policy.groups import GroupQuotas
from vllm_output_rate.policy.handover import slot_handover
from vllm_output_rate.policy.plan import StepPlan
from vllm_output_rate.policy.prompt_cost import PromptCost
from vllm_output_rate.policy.residency import Residency

Key = Hashable

__all__ = [
    "EngineFacts",
    "EngineView",
    "REPEAT_PLAN",
    "StepDecision",
    "StepOutcome",
    "StepPolicy",
    "StepRequest",
]


class StepRequest(Protocol):
    """What the policy reads of a request (hashable: it is the key)."""

    @property
    def request_id(self) -> str:
        """The engine's id of the request."""

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""

    @property
    def num_computed_tokens(self) -> int:
        """Positions whose KV is computed."""

    @property
    def num_output_placeholders(self) -> int:
        """Tokens scheduled but not yet returned (async scheduling)."""

    @property
    def num_output_tokens(self) -> int:
        """Output tokens generated so far."""

    @property
    def max_tokens(self) -> int:
        """Most output tokens it may generate."""

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens."""

    @property
    def is_prefill_chunk(self) -> bool:
        """Its last scheduled chunk ended before the sampling position."""

    @property
    def priority(self) -> int:
        """Smaller is more important (priority scheduling only)."""

    def __hash__(self) -> int: ...


class EngineView(Protocol):
    """What the policy reads of the engine during a step, and its one effector.

    ``running`` is the engine's running list as the step sees it: the
    requests offered at the start, then this step's admissions appended.
    """

    running: Sequence[Any]

    def active_slots(self) -> int:
        """Requests the step may keep active: the configured active cap less
        the slots held for streaming input."""

    def configured_active_cap(self) -> int:
        """The engine's active cap as configured (``max_num_active_seqs``)."""

    def max_resident(self) -> int:
        """Most requests that may be resident (``max_num_seqs``)."""

    def free_slots(self) -> int:
        """Resident slots free now (``max_num_seqs`` less those held)."""

    def has_waiting(self) -> bool:
        """Is any request waiting to be admitted?"""

    def admittable_waiting(self) -> Iterable[Any]:
        """The waiting requests the engine could admit in this step (not held
        for a grammar, remote KV or a streaming-input chunk), in queue order."""

    def kv_room_for(self, request: Any) -> bool:
        """Would ``request`` (evicted for quota earlier) fit into free KV now?"""

    def evict(self, request: Any) -> None:
        """Preempt ``request`` (not in the running list the engine's loop
        sees) and hold it out of the waiting queue until the step ends."""

    def give_up_slot(self, request: Any) -> None:
        """Before the step: preempt ``request`` and drop it from the running
        list (it waits at the front of the queue)."""

    def engine_chunk(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        """The engine's own cut of a chunk before it is charged (vLLM: its
        prefill lookahead); ``num_new_tokens`` if it has none."""

    def chunk_end_before(self, request: Any, num_computed_tokens: int, allowed: int) -> int:
        """Where a chunk cut short for quota may end, at most ``allowed``
        tokens (vLLM: not inside a multimodal item under
        ``--disable-chunked-mm-input``)."""

    def adapters_of(self, requests: Iterable[Any]) -> set[int]:
        """The LoRA adapters ``requests`` use, as the engine counts them."""

    def token_budget(self) -> tuple[int, int, int]:
        """(tokens, per_stream, longest): the tokens one step may schedule
        (vLLM: ``max_num_scheduled_tokens``), the most a decoding stream
        takes of them (1 plus its drafts), and the engine's cap on one
        prefill chunk (vLLM: ``long_prefill_token_threshold``; 0: none)."""


class StepOutcome(Protocol):
    """What the engine reports when a step ends (vLLM's ``SchedulerOutput``
    has every member)."""

    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]


class EngineFacts:
    """What the policy needs to know of the engine it decides for."""

    __slots__ = ("chunked_prefill", "priority_policy", "data_parallel", "sessions")

    def __init__(self, chunked_prefill: bool, priority_policy: bool, data_parallel: bool) -> None:
        self.chunked_prefill = chunked_prefill
        self.priority_policy = priority_policy
        self.data_parallel = data_parallel
        #: A streaming-input session was seen: residency is then checked
        #: after every step's output.
        self.sessions = False


#: What a repeated step's decision holds as its plan: every resident request
#: offered, none hidden, nobody throttled.
NOTHING_PREPAID: frozenset[Key] = frozenset()
REPEAT_PLAN = StepPlan(
    visible=[],
    hidden=0,
    over_cap=False,
    prepaid=cast("set[Key]", NOTHING_PREPAID),  # never written: a step that repeats pays in bulk
    prefills=[],
    throttled=False,
)


class StepDecision:
    """What one step has decided so far; answers the engine's in-step questions.

    Made by :meth:`StepPolicy.begin`, settled by :meth:`StepPolicy.end`.
    """

    __slots__ = (
        "policy", "view", "plan", "visible", "num_offered", "resident", "admitted",
        "configured_cap", "max_resident", "prepaid", "all_visible_paid", "running_at_start",
        "refused_visible", "preempted", "evicted", "slot_donors", "held_for_other_reasons",
        "borrow_admits", "admitted_to_borrow", "adapters", "adapters_seen",
        "refused_for_prompts", "visible_now", "prompt_lender", "guaranteed_waiting",
    )

    def __init__(
        self,
        policy: StepPolicy,
        view: EngineView,
        plan: StepPlan,
        prepaid: Container[Key],
        all_visible_paid: bool,
        running_at_start: int,
        borrow_admits: dict[str, int] | None = None,
        configured_cap: int = 0,
        max_resident: int = 0,
    ) -> None:
        self.policy = policy
        self.view = view
        self.plan = plan
        #: The running list the engine's loop sees in this step, in its
        #: order (None: every resident request, as the engine holds them).
        self.visible: list[Any] | None = None
        #: Requests the plan offered (guaranteed and borrowed), counted when
        #: the step began (the engine appends its admissions to ``visible``).
        self.num_offered = len(plan.visible) + len(plan.borrowed)
        #: The resident requests when the step began (the engine's list).
        self.resident: Sequence[Any] = ()
        #: The requests the engine admitted in this step (:meth:`StepPolicy.record_admissions`).
        self.admitted: Sequence[Any] = ()
        #: The engine's configured active cap and its most resident requests.
        self.configured_cap = configured_cap
        self.max_resident = max_resident
        #: Decoding requests the plan already paid for.
        self.prepaid = prepaid
        #: Every visible request is paid for: the engine's running loop may
        #: skip asking :meth:`tokens_for` (its waiting loop never does).
        self.all_visible_paid = all_visible_paid
        #: len(view.running) when the engine's step began: it appends its admissions.
        self.running_at_start = running_at_start
        #: Visible requests refused their sampling position (they free an
        #: active slot for a waiting request).
        self.refused_visible = 0
        self.preempted: list[Any] = []
        #: Requests evicted for quota, kept out of the waiting queue until
        #: the step ends (re-admitted at once they would take back the slot).
        self.evicted: list[Any] = []
        self.slot_donors: set[str] = set()  # users who gave up a slot this step
        #: A waiting request was held for a reason other than quota (a
        #: grammar): the engine must not idle-wait after this step.
        self.held_for_other_reasons = False
        #: With borrowing: user -> waiting requests it may still have
        #: admitted by borrowing (None: admission order is the engine's).
        self.borrow_admits = borrow_admits
        #: Waiting requests admitted into a spare slot by borrowing, which
        #: may borrow their sampled token.
        self.admitted_to_borrow: set[Any] = set()
        #: LoRA adapters of the resident requests and this step's admissions,
        #: built on first need (the adapter's); entries of running counted.
        self.adapters: set[int] | None = None
        self.adapters_seen = 0
        #: Users refused for their prompt cost: behind every other user next,
        #: in refusal order (a set would order them by string hashes, and the
        #: decisions of later steps changed with PYTHONHASHSEED).
        self.refused_for_prompts: dict[str, None] = {}
        #: The requests offered in this step, as a set, built on the first
        #: displacement within a user (priority scheduling).
        self.visible_now: set[Any] | None = None
        #: With prompt cost and borrowing, in a step that left room for
        #: borrowers (nothing runnable hidden for lack of room): what pays
        #: the prompt chunks of borrowers out of quota (None: nothing does).
        self.prompt_lender: _BorrowedPrompts | None = None
        #: Waiting requests whose users pay now, counted for a free slot by
        #: the offer to borrowers, that the engine's waiting loop has not
        #: asked about yet: while any is left, no request is admitted by
        #: borrowing (borrowed service yields the step's token budget).
        self.guaranteed_waiting: set[Any] = set()

    @property
    def repeat(self) -> bool:
        """The step repeats the last one (see ``StepGate.steady``)."""
        return self.plan is REPEAT_PLAN

    # -- the engine's waiting loop ------------------------------------------

    def may_admit(self, request: StepRequest, preempted: bool) -> bool:
        """Asked in the engine's waiting loop, for a request the engine itself
        would admit now: may it become resident in this step?  False: the
        engine skips it and it keeps its place in the queue.

        Residency (its user's cap; under priority its own less important
        stream may give way), the slots freed for others in this step, the
        user's quota for a request that samples at once, a preempted
        stream's return, and a borrower's turn for a slot set aside for
        borrowing."""
        policy = self.policy
        if self.guaranteed_waiting:
            self.guaranteed_waiting.discard(request)
        if not self._residency_admits(request):
            return False  # waits un-admitted: its user's quota moves no more streams
        ledger = policy.ledger
        if self.slot_donors:
            # Slots were freed in this step for requests that can run now:
            # neither the donors' own requests nor anyone out of quota may
            # take them instead.
            return (
                policy.lanes.user_of[request] not in self.slot_donors
                and ledger.charge(request, take=False)
            )
        evicted = policy.evicted_for_quota
        samples_at_once = (
            not policy.facts.chunked_prefill
            or request.num_tokens - request.num_computed_tokens <= 1
        )
        if samples_at_once:
            if request in evicted and not self.view.kv_room_for(request):
                return False
            return ledger.charge(request, take=False)
        if preempted:
            # No re-admission thrash: a preempted stream comes back only while
            # its user can pay now or is being served in this step (then it
            # takes its turn in the user's rotation instead of starving).
            # A borrower's preempted stream may also come back into a slot
            # given to its user by borrowing (before its user's new requests:
            # the engine puts it at the front of the queue); otherwise a
            # borrower that gave a slot to another (policy/handover.py) would
            # keep the stream out until its own rate paid for it.
            if not (ledger.charge(request, take=False) or ledger.is_served_now(request)):
                if self.borrow_admits is None or (
                    request in evicted and not self.view.kv_room_for(request)
                ):
                    return False
                return self._admit_to_borrow(request)
            return request not in evicted or self.view.kv_room_for(request)
        if self.borrow_admits is not None and not self._admit_to_borrow(request):
            return False
        return not self._prompt_refused_again(request)

    def _prompt_refused_again(self, request: StepRequest) -> bool:
        """Would :meth:`may_start` refuse this new request whatever the
        prefix cache holds, and record nothing new?  So when its user was
        refused for a prompt in this step already and nothing may pay its
        prompt instead: no debt-free lender (it was not admitted to borrow),
        no group line to keep its place in, nothing of it paid.  Refused
        here, before the engine's prefix-cache lookup, the user's queued
        prompts cost no lookup each in every step (as :meth:`may_consider`
        does for a user in debt); same decision, same refusals recorded."""
        policy = self.policy
        prompt_cost = policy.prompt_cost
        if not prompt_cost.weight or not self.refused_for_prompts:
            return False
        user = policy.lanes.user_of[request]
        if user not in self.refused_for_prompts or user not in policy.ledger.refused:
            return False
        group_of = prompt_cost.group_of
        if group_of is not None and group_of(user) is not None:
            return False  # asking keeps (or takes) its place in the group's line
        return not (
            request.num_computed_tokens
            or request in prompt_cost.charged_upto
            or request in self.admitted_to_borrow
            or policy.ledger.is_charged(request)
        )

    def adapter_fits(self, adapter: int, max_adapters: int) -> bool:
        """Asked in the engine's waiting loop, before :meth:`may_admit`, for a
        request with a LoRA adapter (``adapter`` > 0): may it be admitted in
        this step?

        The engine admits a request with a new adapter only while fewer than
        ``max_adapters`` are in its count, and counts what it sees in its
        running list (vLLM 0.32: the requests scheduled in the step; 0.33:
        all of them), so a request hidden for lack of quota -- or offered but
        refused its sampling position -- would not hold its adapter's place,
        and when it ran again beside a newcomer with another adapter the
        batch would exceed the limit.  While some resident request is hidden
        or refused, such a request is therefore admitted only if its adapter
        is among those of every resident request and the step's admissions
        so far, or there is room for one more.  Otherwise the engine's own
        count covers every resident request that can run: with limits never
        hit, admissions are the engine's."""
        if adapter <= 0 or not (self.plan.hidden or self.refused_visible):
            return True
        view = self.view
        known = self.adapters
        if known is None:
            known = self.adapters = view.adapters_of(self.policy.lanes.resident())
        running = view.running  # the offered requests, then this step's admissions
        if self.adapters_seen < len(running):
            known |= view.adapters_of(running[self.adapters_seen:])
            self.adapters_seen = len(running)
        return adapter in known or len(known) < max_adapters

    def _admit_to_borrow(self, request: StepRequest) -> bool:
        """A waiting request that would only run by borrowing is admitted in
        counter order (:meth:`Borrowing.admissions`), not in arrival order:
        while its user has admissions left in this step.  Any other request
        passes."""
        admits = self.borrow_admits
        assert admits is not None
        policy = self.policy
        user = policy.lanes.user_of[request]
        borrowing = policy.gate.borrowing
        assert borrowing is not None  # admissions by borrowing are counted only with it
        if policy.ledger.quota_now(user) == 0 and borrowing.table.borrows(user):
            left = admits.get(user, 0)
            if left <= 0:
                return False
            if (
                self.guaranteed_waiting
                and policy.prompt_cost.weight
                and uncomputed(request) > 1
            ):
                # A request of a user in quota waits later in the queue: a
                # borrowed prompt admitted first would spend the step's token
                # budget before the engine's loop reaches it (queue order is
                # arrival order, and borrowers' backlogs sit in front).  One
                # that samples at once costs a token: it passes.
                return False
            admits[user] = left - 1
            self.admitted_to_borrow.add(request)
        return True

    def _residency_admits(self, request: StepRequest) -> bool:
        """May ``request`` become resident in this step (its user's cap)?"""
        lanes = self.policy.lanes
        user_of = lanes.user_of
        user = user_of[request]
        cap = self.policy.residency.cap(user)
        if cap is None:
            return True  # (most waiting requests of a borrower without a ceiling)
        room = cap - lanes.resident_count(user)
        if room <= 0:
            return self._displace_own_stream(request)
        # This step's admissions are not in the lanes yet.
        admitted = 0
        running = self.view.running
        for index in range(self.running_at_start, len(running)):
            if user_of.get(running[index]) == user:
                admitted += 1
                if admitted >= room:
                    return self._displace_own_stream(request)
        return True

    def evict(self, victim: Any) -> None:
        """Preempt ``victim`` for quota now, paid from the recompute budget,
        and hold it out of the waiting queue until the step ends (the engine's
        waiting loop may be about to pop the request it peeked)."""
        self.policy._evict_for_quota(self.view, victim, self.evicted)

    def _displace_own_stream(self, request: StepRequest) -> bool:
        """Priority scheduling: ``request``, kept out by its user's cap, may
        take the place of a less important hidden stream of its own user
        (``Displacement.own_stream_victim``).  True: it was made room for."""
        if not self.policy.facts.priority_policy or self.plan is REPEAT_PLAN:
            return False  # a repeated step hides nothing: no stream to give way
        offered = self.visible_now
        if offered is None:
            offered = self.visible_now = set(self.view.running)
        victim = self.policy.displacement.own_stream_victim(request, lambda r: r not in offered)
        if victim is None:
            return False
        self.evict(victim)
        self.plan.hidden -= 1  # its slot is the request's now
        return True

    def may_start(self, request: StepRequest, num_computed_tokens: int) -> bool:
        """Asked in the engine's waiting loop after its prefix-cache lookup
        (``num_computed_tokens`` includes the cached prefix): False if only
        the sampling position is left and the user can pay neither from its
        quota nor by borrowing (the engine skips it instead of stopping
        admission for everybody behind it)."""
        policy = self.policy
        if request.num_tokens - num_computed_tokens <= 1 and not policy.ledger.charge(
            request, take=False
        ):
            borrowing = policy.gate.borrowing
            if not (
                request in self.admitted_to_borrow
                and borrowing is not None
                and borrowing.can_lend(policy.lanes.user_of[request], policy.ledger.now_ns)
            ):
                return False
        prompt_cost = policy.prompt_cost
        if not prompt_cost.weight:
            return True
        # With prompt cost: a request that would compute prompt positions
        # nobody paid for yet waits while its user cannot pay, and its user
        # goes behind every other user next.
        num_prompt = request.num_prompt_tokens
        if num_computed_tokens >= num_prompt or not prompt_cost.uncharged(
            request, num_computed_tokens, num_prompt, num_prompt
        ):
            return True
        user = policy.lanes.user_of[request]
        # Its next chunk is not known yet: borrowing must be able to pay the
        # rest of its prompt (the chunk is at most that) and its sampled token.
        lender = self._prompt_lender_for(
            request, user, False, num_computed_tokens, num_prompt - num_computed_tokens, num_prompt
        )
        if prompt_cost.can_pay(request, user, lender):
            return True
        self.refused_for_prompts[user] = None
        return False

    def _prompt_lender_for(
        self, request: StepRequest, user: str, running: bool, start: int, count: int, num_prompt: int
    ) -> _BorrowedPrompts | None:
        """What may pay the chunk ``[start, start + count)`` of ``request`` by
        borrowing, or None (then its user's quota must).

        Only where its output tokens could borrow: a borrower whose quota
        cannot pay the chunk's whole cost and whose cap can pay it and a
        sampled token now (no ceiling: always), in a step that hid nothing
        for lack of room: a resident prefill, or a waiting request admitted
        into a slot set aside for borrowers (``_admit_to_borrow``) or on its
        user's quota.  Paid from the quota instead, the part the quota cannot
        pay would become debt, which holds every prompt of the user,
        borrowed or not, until its rate has paid it off."""
        lender = self.prompt_lender
        if lender is None:
            return None
        policy = self.policy
        now = policy.ledger.now_ns
        room = lender.room(user, now)
        if room is not None and room <= 0:
            return None
        quota = policy.ledger.quota_now(user)
        if not (running or quota or request in self.admitted_to_borrow):
            return None  # not admitted by borrowing: no spare slot was its
        cost = policy.prompt_cost.cost_of(request, user, start, count, num_prompt)
        if quota >= max(cost, 1):
            return None  # its quota pays it whole
        return lender if room is None or cost + 1 <= room else None

    def may_consider(self, request: StepRequest) -> bool:
        """Asked first in the engine's waiting loop, before its own checks
        and its prefix-cache lookup, for a new request (nothing computed,
        never preempted): False if its user is in prompt debt.  Whatever the
        prefix cache holds, the request computes at least its last prompt
        position, never charged, which a user in debt cannot pay; asked
        after the lookup instead (:meth:`may_start`), a flood's queued
        prompts would cost a lookup each in every step until the debt is
        paid (same decision, same refusal recorded).  A preempted request's
        recompute below the charged mark is free: it is not asked."""
        prompt_cost = self.policy.prompt_cost
        if not (prompt_cost.debt and prompt_cost.weight):
            return True
        user = self.policy.lanes.user_of[request]
        if user in prompt_cost.debt and request not in prompt_cost.charged_upto:
            prompt_cost.can_pay(request, user)  # records the refusal
            self.refused_for_prompts[user] = None
            return False
        return True

    # -- every scheduled request --------------------------------------------

    def tokens_for(
        self, request: StepRequest, num_computed_tokens: int, num_new_tokens: int, running: bool
    ) -> int:
        """Asked for every request the engine is about to schedule (running
        loop, then waiting loop), before it allocates KV: how many of
        ``num_new_tokens`` it may compute.  The user pays here for the token
        the chunk samples (with prompt cost for its prompt positions; with
        speculative decoding for its drafts), or the chunk is cut short of
        the sampling position."""
        policy = self.policy
        if policy.prompt_cost.weight:
            num_new_tokens = self._charge_with_prompt_cost(
                request, num_computed_tokens, num_new_tokens, running
            )
        else:
            num_new_tokens = self._charge_at_sampling_position(
                request, num_computed_tokens, num_new_tokens, running
            )
        if policy.drafts is None or num_new_tokens <= 0:
            return num_new_tokens
        return self._charge_drafts(request, num_computed_tokens, num_new_tokens, running)

    def _charge_at_sampling_position(
        self, request: StepRequest, num_computed_tokens: int, num_new_tokens: int, running: bool
    ) -> int:
        """When the scheduled chunk reaches the sampling position, one unit
        of the user's quota is taken here, or the chunk is cut short of it:
        to the second-to-last prompt position with chunked prefill (an
        intermediate chunk is free), else to nothing.  A request admitted in
        this step into a slot set aside for borrowing borrows the token."""
        num_new_tokens = self.view.engine_chunk(request, num_computed_tokens, num_new_tokens)
        if num_new_tokens <= 0:
            return num_new_tokens
        if request in self.prepaid:  # a decoding stream the plan already paid for
            return num_new_tokens
        sample_at = request.num_tokens + request.num_output_placeholders
        if num_computed_tokens + num_new_tokens < sample_at:
            return num_new_tokens  # an intermediate prefill chunk is free
        policy = self.policy
        if policy.ledger.charge(request):
            return num_new_tokens
        if request in self.admitted_to_borrow and policy.gate.lend(request):
            return num_new_tokens
        # Out of quota: stop short of the sampling position.
        allowed = sample_at - 1 - num_computed_tokens if policy.facts.chunked_prefill else 0
        if allowed > 0:
            allowed = self.view.chunk_end_before(request, num_computed_tokens, allowed)
        else:
            allowed = 0
        if allowed == 0 and running:
            self.refused_visible += 1
        return allowed

    def _charge_with_prompt_cost(
        self, request: StepRequest, num_computed_tokens: int, num_new_tokens: int, running: bool
    ) -> int:
        """With prompt cost: the chunk's uncharged prompt positions are paid
        for (possibly into debt) or the chunk waits; then the sampling
        position as without."""
        prompt_cost = self.policy.prompt_cost
        num_prompt = request.num_prompt_tokens
        if num_computed_tokens < num_prompt and prompt_cost.uncharged(
            request, num_computed_tokens, num_new_tokens, num_prompt
        ):
            user = self.policy.lanes.user_of[request]
            lender = self._prompt_lender_for(
                request, user, running, num_computed_tokens, num_new_tokens, num_prompt
            )
            if not prompt_cost.can_pay(request, user, lender):
                if running:
                    self.refused_visible += 1
                self.refused_for_prompts[user] = None
                return 0
            num_new_tokens = self._charge_at_sampling_position(
                request, num_computed_tokens, num_new_tokens, running
            )
            if num_new_tokens > 0:
                prompt_cost.charge(
                    request, user, num_computed_tokens, num_new_tokens, num_prompt, lender
                )
            return num_new_tokens
        return self._charge_at_sampling_position(
            request, num_computed_tokens, num_new_tokens, running
        )

    def _charge_drafts(
        self, request: StepRequest, num_computed_tokens: int, num_new_tokens: int, running: bool
    ) -> int:
        """Speculative decoding, after the sampled token is paid for: the
        drafts the user can pay for now; the chunk is cut to those."""
        drafts = (
            num_computed_tokens
            + num_new_tokens
            - request.num_tokens
            - request.num_output_placeholders
        )
        if drafts <= 0 or not running:
            # A waiting request reaching here with drafts is the engine
            # padding a new decode to the uniform draft count: -1 sentinels,
            # which the model never accepts, so they cost nothing.
            return num_new_tokens
        # Drafts past max_tokens can never be emitted: the engine stops the
        # request there.  (Tokens still in flight under async scheduling are
        # not subtracted: they may be rejected, so this never under-charges.)
        wanted = max(0, min(drafts, request.max_tokens - request.num_output_tokens - 1))
        policy = self.policy
        assert policy.drafts is not None
        paid = policy.drafts.pay(
            request.request_id, policy.lanes.user_of[request], policy.ledger.now_ns, wanted
        )
        if paid == wanted:
            return num_new_tokens  # any drafts left over lie past max_tokens
        # The engine keeps the first drafts: cut every draft past those paid for.
        return num_new_tokens - (drafts - paid)

    def victim_for(self, request: StepRequest, running: bool) -> Any | None:
        """Asked when the engine could not allocate KV for ``request``
        (``running``: from its running loop): the throttled request that
        gives way, already evicted (through ``view.evict``), or None (the
        engine's own preemption decides).  Under priority scheduling a
        running request takes KV only from requests no more important than
        the engine's own victim would be
        (``Displacement.victim_for``)."""
        policy = self.policy
        least_important = None
        if running and policy.facts.priority_policy:
            offered = self.view.running
            if offered:
                # The engine's own victim would be the least important offered request.
                least_important = max(r.priority for r in offered)
        victim = policy.displacement.victim_for(request, not running, least_important)
        if victim is not None:
            self.evict(victim)
        return victim

    def active_cap(self) -> int:
        """Asked by the engine's waiting loop before each admission: how long
        its running list may grow.  Throttled requests do not count as
        active; never more than the most resident requests."""
        plan = self.plan
        if plan.over_cap:
            return 0  # runnable requests were left out for lack of room
        return min(self.configured_cap + self.refused_visible, self.max_resident - plan.hidden)


class StepPolicy:
    """Every per-step rule of one engine, over its parts.

    Built once per engine from the settings' parts; :meth:`configure` (a
    reload) swaps the features the settings ask for, keeping state.
    """

    def __init__(
        self,
        gate: StepGate,
        facts: EngineFacts,
        budget: EvictionBudget,
        residency: Residency,
        displacement: Displacement,
        prompt_cost: PromptCost,
        drafts: DraftAccount | None,
        evicted_for_quota: set[Any],
    ) -> None:
        self.gate = gate
        self.lanes = gate.lanes
        self.ledger = gate.ledger
        #: The users' own rates (the first level of every composed quota the
        #: ledger is given later): what :meth:`close` stops.
        self.rates = gate.ledger.limiter
        self.facts = facts
        self.budget = budget
        self.residency = residency
        self.displacement = displacement
        self.prompt_cost = prompt_cost
        self.drafts = drafts
        #: Requests preempted because their user was out of quota, until
        #: they are resident again (they come back into free KV only).
        self.evicted_for_quota = evicted_for_quota
        #: After :meth:`end` of a step that ran nothing: seconds the engine
        #: may wait for input (None: poll as usual).
        self.idle_wait_s: float | None = None
        #: The decision of the step in progress (from :meth:`begin`).
        self.current: StepDecision | None = None
        #: The groups' quotas (None: no group configured); set with
        #: borrowing and the composed quota by ``factory.configure_step_policy``.
        self.groups: GroupQuotas | None = None
        #: The last step refused a borrower's prompt, or found one its cap
        #: could not pay yet: the next one is planned.
        self._borrowers_refused_for_prompts = False
        #: The cap a borrowed prompt is paid on (its user's, or its group's:
        #: ``_cap_scope``) -> room the borrowing demand counted on it so far
        #: for prompts and the hidden streams borrowing ahead of them
        #: (``_prompt_blocked``), in one step; and the room that demand shares.
        self._lent_in_demand: dict[tuple[str, str], int] = {}
        self._demand_room = 0
        #: Users one of whose waiting prompts the borrowing demand counted
        #: while their group's line was not empty, in one step
        #: (``_turn_taken``), and the view that demand was asked of.
        self._turn_counted: set[str] = set()
        self._demand_view: EngineView | None = None
        #: user -> :meth:`_prompts_of` it, in one count of the borrowing demand.
        self._demand_prompts: dict[str, tuple[bool, frozenset[str], bool]] = {}
        self._guaranteed_waiting: set[Any] = set()  # of the last offer to borrowers

    @property
    def borrowing(self) -> Borrowing | None:
        return self.gate.borrowing

    def close(self) -> None:
        """The engine shuts down: quotas kept in a shared store stop their
        lease threads (the users' rates, the ceilings', the groups')."""
        self.rates.close()
        borrowing = self.gate.borrowing
        if borrowing is not None and borrowing.ceiling is not None:
            borrowing.ceiling.close()
        if self.groups is not None:
            self.groups.close()

    # -- membership, between steps ------------------------------------------

    def on_add(self, request: Any, user: str, resumable: bool = False) -> None:
        """A request arrived for ``user`` (``resumable``: a streaming-input session)."""
        lanes = self.lanes
        lanes.track(request, user)
        if not self.facts.chunked_prefill and not resumable:
            # Its first token comes with its whole prefill: it needs quota
            # to be admitted, so it takes turns with its user's resident
            # streams (under priority scheduling ahead of less important ones).
            lanes.wait_in_turn(request, priority_of if self.facts.priority_policy else None)
        if resumable:
            # Streaming-input sessions need bookkeeping after each step;
            # engines that never see one skip it.
            self.facts.sessions = True

    def on_preempt(self, request: Any, resumable: bool = False) -> None:
        """The engine preempted a resident request (its own choice or ours)."""
        self.lanes.release(request)
        if not self.facts.chunked_prefill and not resumable:
            self.lanes.wait_in_turn(request)  # as on arrival
        decision = self.current
        if decision is not None:
            decision.preempted.append(request)

    def on_pause(self, request: Any) -> None:
        """A request left the running list without being freed or preempted
        (a streaming-input session waiting for its next chunk): no longer
        resident."""
        self.lanes.release(request)

    def on_free(self, request: Any) -> None:
        """A request finished or was aborted: forget it."""
        self.lanes.forget(request)
        self.evicted_for_quota.discard(request)

    def begin(self, view: EngineView, now_ns: int) -> StepDecision:
        """Asked first in every step, before anything is scheduled: which
        requests the engine may look at (``decision.visible``), and the
        decision that answers its in-step questions.

        The gate plans the step (or repeats the last one); spare room goes
        to borrowers (:meth:`_offer_spare_to_borrowers`, which may hand a
        slot from one borrower to another); throttled requests give up
        slots to waiting requests that can run (:meth:`_free_slots_for_waiting`).
        The requests chosen to give way are preempted through ``view``."""
        self.current = None
        gate = self.gate
        slots = view.active_slots()
        prompt_cost = self.prompt_cost
        if prompt_cost.debt:
            prompt_cost.repay(now_ns)
        resident = view.running
        # A step that repeats the last one offers borrowers nothing: after a
        # step that refused a borrower's prompt, plan, so that the prompt
        # may be borrowed (a repeat would refuse it again, step after step).
        lend_prompts = self._borrowers_refused_for_prompts
        self._borrowers_refused_for_prompts = False
        if not lend_prompts and gate.steady(now_ns, slots):
            decision = StepDecision(
                self, view, REPEAT_PLAN, NOTHING_PREPAID,
                all_visible_paid=self.drafts is None,
                running_at_start=len(resident),
                configured_cap=view.configured_active_cap(),
                max_resident=view.max_resident(),
            )
            decision.resident = resident
            self.current = decision
            return decision
        plan = gate.plan(now_ns, slots, self._prefill_refused, view.kv_room_for)
        if gate.cap_wanted:
            gate.cap_wanted.clear()
        # Slots are freed for waiting requests before the offer to borrowers,
        # so the offer keeps room only for requests a slot is there for.
        free_slots = view.free_slots()
        evicted: list[Any] = []
        slot_donors: set[str] = set()
        if plan.throttled and view.has_waiting():
            slot_donors = self._free_slots_for_waiting(view, plan, free_slots, evicted)
            if self.facts.priority_policy and free_slots <= 0 and not evicted:
                self._own_stream_for_first_waiting(view, plan, evicted)
        borrow_admits = None
        lender = None
        self._guaranteed_waiting = set()
        if gate.borrowing is not None and not plan.over_cap:
            borrow_admits = self._offer_spare_to_borrowers(
                view, plan, slots, free_slots + len(evicted)
            )
        if gate.borrowing is not None and prompt_cost.weight:
            # Also when slots ran out: the plan showed a borrower's resident
            # prefill because borrowing can pay its chunk (``prefill_refused``);
            # refused it, the slot it took stayed empty.
            lender = _BorrowedPrompts(gate.borrowing)
        # The gate decides which requests the engine sees; the engine's own
        # order among them (admission order) decides who gets the token
        # budget first and who is preempted first, exactly as in stock vLLM.
        visible: list[Any] | None
        if plan.borrowed:
            # Borrowers last: the token budget reaches them last, and
            # preemption (from the end of the running list) first.
            self.lanes.in_admission_order(plan.visible)
            visible = plan.visible + plan.borrowed
        elif plan.hidden or evicted:
            # (A victim evicted for a waiting request may still be in the
            # engine's resident list until the step ends: never offered.)
            self.lanes.in_admission_order(plan.visible)
            visible = plan.visible  # the engine appends admissions to it
        else:
            visible = None
        decision = StepDecision(
            self, view, plan, plan.prepaid,
            all_visible_paid=not plan.prefills and self.drafts is None,
            running_at_start=len(resident) if visible is None else len(visible),
            borrow_admits=borrow_admits,
            configured_cap=view.configured_active_cap(),
            max_resident=view.max_resident(),
        )
        decision.visible = visible
        decision.resident = resident
        decision.prompt_lender = lender
        decision.guaranteed_waiting = self._guaranteed_waiting
        decision.slot_donors = slot_donors
        decision.evicted = evicted
        decision.preempted.extend(evicted)  # preempted before the decision existed
        self.current = decision
        return decision

    # -- the step's offer to borrowers --------------------------------------

    def _offer_spare_to_borrowers(
        self, view: EngineView, plan: StepPlan, slots: int, free_slots: int
    ) -> dict[str, int] | None:
        """Room the plan left, less what waiting requests the active cap
        would admit need, goes to borrowers; ``free_slots``: model-runner
        slots free for admissions (those freed for waiting requests
        counted).  Returns, per borrowing user,
        how many of its waiting requests may be admitted by borrowing (None:
        admission order is the engine's)."""
        borrowing = self.gate.borrowing
        assert borrowing is not None
        lanes, ledger = self.lanes, self.ledger
        room = slots - len(plan.visible) - plan.reserved
        queued: dict[str, list[int]] | None = None
        receiver = None
        admissions = 0
        if room > 0 and (ledger.short or view.has_waiting()):
            queued = {}
            self._lent_in_demand = {}
            self._demand_room = room
            self._turn_counted.clear()
            self._demand_prompts.clear()
            self._demand_view = view
            prefill = self._prefill_budget(view, plan, room)
            guaranteed, admissions = waiting_demand(
                view.admittable_waiting(),
                lanes,
                ledger,
                borrowing.table.borrows,
                self.residency,
                limit=room,
                free_slots=free_slots,
                output_left=output_left,
                queued=queued,
                prompt_blocked=self._prompt_blocked if self.prompt_cost.weight else None,
                kv_room=view.kv_room_for,
                guaranteed_keys=self._guaranteed_waiting,
                prefill=prefill,
                committed=self._spent_by_visible_prefills(view, plan, prefill),
            )
            self._demand_view = None
            room -= guaranteed + admissions
            if queued and not admissions and room > 0 and free_slots <= 0:
                receiver = self._hand_over_slot(view, plan, room, queued)
                if receiver is not None:
                    room -= 1  # its request borrows its token at once (Borrowing.lend)
        # Also with no room or nobody short: then it only keeps the counters.
        self.gate.borrow(plan, room, queued or ())
        if queued is None:
            return None
        # Which borrowers' waiting requests take the free slots is the
        # borrowing's choice (least weighted service first), not the
        # queue's order: may_admit skips a borrower's request beyond its
        # user's share.
        admits: dict[str, int] = {}
        if admissions:
            committed = self._committed_output(view, queued)
            usable = {u: borrowing.streams_it_could_add(lanes, ledger, u) for u in queued}
            for user in borrowing.admissions(queued, committed, admissions, usable):
                admits[user] = admits.get(user, 0) + 1
        if receiver is not None:
            admits[receiver] = admits.get(receiver, 0) + 1
        return admits

    def _spent_by_visible_prefills(
        self, view: EngineView, plan: StepPlan, budget: PrefillBudget
    ) -> dict[str, int]:
        """user -> what its visible prefills take of its quota in this step,
        before the engine's waiting loop asks: their chunks' prompt cost,
        and a token for each that reaches its sampling position unpaid.
        Counted as the user's quota for its waiting requests instead, it kept
        a slot from borrowers for a request the step could not admit."""
        if not plan.prefills:
            return {}
        tokens = view.token_budget()[0]
        ledger, user_of = self.ledger, self.lanes.user_of
        prompt_cost = self.prompt_cost
        committed: dict[str, int] = {}
        for request in cast("list[Any]", plan.prefills):
            user = user_of.get(request)
            if user is None:
                continue
            left = uncomputed(request)
            chunk = min(budget.chunk(request), tokens)  # with the step's whole budget
            cost = 0
            if prompt_cost.weight:
                computed = request.num_computed_tokens
                cost = prompt_cost.cost_of(request, user, computed, chunk, request.num_prompt_tokens)
            if chunk >= left and not ledger.is_charged(request):
                cost += 1
            if cost:
                committed[user] = committed.get(user, 0) + cost
        return committed

    def _prefill_budget(self, view: EngineView, plan: StepPlan, room: int) -> PrefillBudget:
        """What the step's token budget leaves for admissions: the engine's
        running loop first gives the visible requests theirs (a decoding
        stream 1 token and its drafts, a prefill its next chunk), and the
        streams borrowed in the ``room`` left after the plan."""
        tokens, per_stream, longest = view.token_budget()
        budget = PrefillBudget(tokens, self.facts.chunked_prefill, longest, uncomputed)
        prefills = plan.prefills
        decoding = len(plan.visible) - len(prefills)
        # The borrowed streams are chosen after the demand, from the room it
        # leaves, yet run before the engine's waiting loop: counted as if all
        # of the room went to them (as many as are hidden at most), which
        # errs low (a token per admission counted; more where hidden streams
        # cannot borrow).  An admission not counted leaves its slot to a
        # borrowed stream, which runs, or to the engine's own admissions (the
        # active cap is not lowered for it); one counted that cannot begin
        # leaves its slot empty, and a borrower's stream hidden beside it.
        borrowed = min(room, plan.hidden)
        budget.tokens -= (decoding + borrowed) * per_stream + sum(map(budget.chunk, prefills))
        return budget

    def _prefill_refused(self, user: str, request: Any, decoding: int) -> bool:
        """Will prompt cost refuse the next chunk of the resident prefill
        ``request`` in this step (asked by the plan, its user's ``decoding``
        streams paid first)?  Only if the chunk's first position is not paid
        for; then yes while its user is in prompt debt, or, outside groups,
        when those streams leave its quota empty and borrowing cannot pay
        instead (its cap empty; a borrower without a ceiling always can).  A
        group member is always shown unless it owes: asking keeps its place
        in its group's line (``PromptCost.can_pay``), hidden it would lose
        its turn.  Asks nothing."""
        prompt_cost = self.prompt_cost
        computed = request.num_computed_tokens
        if computed >= request.num_prompt_tokens or prompt_cost.charged_upto.get(request, 0) > computed:
            return False
        if prompt_cost.debt.get(user):
            return True
        group_of = prompt_cost.group_of
        if group_of is not None and group_of(user) is not None:
            return False
        ledger = self.ledger
        if ledger.limiter.available(user, ledger.now_ns) > decoding:
            return False
        borrowing = self.gate.borrowing
        if borrowing is None:
            return True
        room = _BorrowedPrompts(borrowing).room(user, ledger.now_ns)
        return room is not None and room <= 0

    def _prompt_blocked(self, request: Any, has_quota: bool) -> bool:
        """Would prompt cost refuse ``request``, waiting, in this step, its
        user's quota left for it or not (what earlier requests of the user
        in the queue take counted)?  Only if some prompt position is not
        paid for (whatever the prefix cache holds, the last one is
        computed); then yes while its user's prompts are held (a debt, its
        group's), and with no quota left unless its token was paid in this
        step or borrowing can pay its prompt and its sampled token (its cap,
        less what its earlier requests would borrow; no ceiling: always):
        :meth:`.PromptCost.can_pay`, asked by ``may_consider`` /
        ``may_start``.  A borrower kept out for want of cap room whose quota
        is empty is refused in the ledger (nothing else of it is charged).
        While its group's line is not empty a member goes one chunk per
        turn (:meth:`_turn_taken`)."""
        prompt_cost = self.prompt_cost
        num_prompt = request.num_prompt_tokens
        charged_upto = prompt_cost.charged_upto.get(request, 0)
        if charged_upto >= num_prompt:
            return False  # recompute below the charged mark is free
        user = self.lanes.user_of[request]
        prompts = self._demand_prompts.get(user)
        if prompts is None:
            prompts = self._demand_prompts[user] = self._prompts_of(user)
        held, line, uncapped = prompts
        if held:
            return True
        if line and self._turn_taken(request, user, line):
            return True  # its group's turn went to its prompt counted before
        if has_quota or uncapped or self.ledger.is_charged(request):
            return False
        # Admitted by borrowing, its prompt is borrowed too while the cap can
        # pay it (and its sampled token), after the user's earlier requests.
        borrowing = self.gate.borrowing
        assert borrowing is not None  # asked only for the borrowing demand
        room = _BorrowedPrompts(borrowing).room(user, self.ledger.now_ns)
        if room is None:
            return False
        lent = self._lent_in_demand
        scope = _cap_scope(borrowing, user)
        before = lent.get(scope)
        if before is None:
            # The hidden streams paid on the same cap borrow in vLLM's running
            # loop, before its waiting loop asks for this prompt: the prompt
            # gets what they leave.  Counted as it was not, the room kept for
            # it stayed empty while one of those streams sat out.
            before = min(self._streams_on_cap(scope), max(self._demand_room - 1, 0))
        need = before + 1 + prompt_cost.cost_of(
            request, user, charged_upto, num_prompt - charged_upto, num_prompt
        )
        if need > room:
            # Its cap refills step by step: the next step is planned, so
            # that its prompt is borrowed once the cap can pay it.  With its
            # quota empty (not only spent on its earlier requests in this
            # count) it is refused, so blocked: a step that runs nothing
            # waits for its quota or its cap (not asked in the waiting loop,
            # it would not be).
            self._borrowers_refused_for_prompts = True
            if not self.ledger.quota_now(user):
                self.ledger.refuse(user)
                self.gate.cap_wanted[user] = need
            return True
        lent[scope] = need
        return False

    def _streams_on_cap(self, scope: tuple[str, str]) -> int:
        """Resident streams the step's plan did not pay for (those that
        would borrow) of the users whose borrowed tokens ``scope``'s cap pays."""
        lanes, prepaid = self.lanes, self.ledger.prepaid
        kind, name = scope
        if kind == "user":
            return unpaid_decoding(lanes, prepaid, name)
        group_of = self.gate.borrowing.table.group_of  # type: ignore[union-attr]
        return sum(
            unpaid_decoding(lanes, prepaid, user) for user in lanes.order if group_of(user) == name
        )

    def _prompts_of(self, user: str) -> tuple[bool, frozenset[str], bool]:
        """What the borrowing demand reads of ``user``'s prompts, the same
        for each of its waiting requests while the demand is counted (nothing
        it reads changes before the engine's loops ask): whether they are
        held (``PromptCost.holds_prompt``), its group's line
        (``PromptCost.line_of``), and whether borrowing pays them free of any
        cap (a borrower without a ceiling).  Kept per user for one count
        (``_demand_prompts``): a borrower's backlog is counted request by
        request in every step, and each asked all three afresh."""
        prompt_cost = self.prompt_cost
        borrowing = self.gate.borrowing
        table = None if borrowing is None else borrowing.table
        uncapped = table is not None and table.borrows(user) and not table.ceiled(user)
        return prompt_cost.holds_prompt(user), prompt_cost.line_of(user), uncapped

    def _turn_taken(self, request: Any, user: str, line: frozenset[str]) -> bool:
        """Has the borrowing demand counted a prompt of ``user`` in this step
        already, while its group's line (``line``) is not empty, and does
        another member of the line, or one that asks before
        ``request`` (:meth:`_member_asks_first`), come before ``user``'s next
        chunk?  A member goes one chunk per turn
        (``PromptCost._held_by_group``), so the room kept for ``request``
        would stay empty.  Counts ``request`` as its user's turn otherwise."""
        if user in self._turn_counted and (
            line - {user} or self._member_asks_first(request, user)
        ):
            return True
        self._turn_counted.add(user)
        return False

    def _member_asks_first(self, request: Any, user: str) -> bool:
        """Does another member of ``user``'s group ask for a prompt chunk
        before ``request`` in this step: a resident request with prompt
        positions left (the engine serves its running list first), or a
        waiting request ahead of it in the queue?"""
        view = self._demand_view
        group_of = self.prompt_cost.group_of
        if view is None or group_of is None:
            return False
        group = group_of(user)
        user_of = self.lanes.user_of
        charged_upto = self.prompt_cost.charged_upto

        def other_member_prompt(other: Any) -> bool:
            owner = user_of.get(other)
            return (
                owner is not None and owner != user and group_of(owner) == group
                and other.num_computed_tokens < other.num_prompt_tokens
                and charged_upto.get(other, 0) < other.num_prompt_tokens
            )

        if any(map(other_member_prompt, view.running)):
            return True
        for other in view.admittable_waiting():
            if other is request:
                return False
            if other_member_prompt(other):
                return True
        return False

    def _hand_over_slot(
        self, view: EngineView, plan: StepPlan, room: int, users: dict[str, list[int]]
    ) -> str | None:
        """No resident slot free and borrowers waiting: the borrower furthest
        ahead of its weighted share gives one of its hidden streams to the
        one behind it (:mod:`~vllm_output_rate.policy.handover`,
        ``Displacement.handover_victim``).  Returns the user the freed slot
        is for, or None.  The victim leaves the running list before the
        engine's step (it is hidden, so not offered), paid from the
        recompute budget like every eviction, and comes back into free KV only.

        Not with priority scheduling, nor where a borrower's new request
        cannot be admitted by borrowing (without chunked prefill it waits
        its turn on its rate; with prompt cost its prompt needs its rate)."""
        facts = self.facts
        if (
            facts.priority_policy
            or not facts.chunked_prefill
            or self.prompt_cost.weight
        ):
            return None
        borrowing = self.gate.borrowing
        assert borrowing is not None
        pair = slot_handover(borrowing, self.lanes, users, room, ledger=self.ledger)
        if pair is None:
            return None
        donor, receiver = pair
        victim = self.displacement.handover_victim(donor)
        if victim is None:
            return None
        self._pay_eviction(victim)
        view.give_up_slot(victim)
        plan.hidden -= 1
        return receiver

    def _committed_output(self, view: EngineView, users: Container[str]) -> dict[str, int]:
        """What the resident requests of ``users``, and of the other members
        of their groups (a group's admissions weigh all of its members), may
        still output."""
        borrowing = self.gate.borrowing
        assert borrowing is not None
        user_of = self.lanes.user_of
        group_of = borrowing.table.group_of
        groups = {group_of(u) for u in cast(Iterable[str], users)} - {None}
        committed: dict[str, int] = {}
        for request in view.running:  # every resident request (before the step's swap)
            user = user_of.get(request)
            if user is None:
                continue
            if user in users or (groups and group_of(user) in groups):
                committed[user] = committed.get(user, 0) + output_left(request)
        return committed

    # -- slots and KV: who gives way ----------------------------------------

    def _own_stream_for_first_waiting(
        self, view: EngineView, plan: StepPlan, evicted: list[Any]
    ) -> None:
        """Priority scheduling with every model-runner slot held: the
        engine's waiting loop stops at the running list's cap before it asks
        any waiting request, so ``may_admit``'s own-stream rule is never
        reached.  The first waiting request in the engine's order (the one
        it would admit into a freed slot), kept out by its user's residency
        cap, takes the place of a less important hidden stream of its own
        user now (``Displacement.own_stream_victim``); the victim is appended
        to ``evicted``."""
        first = next(iter(view.admittable_waiting()), None)
        if first is None:
            return
        lanes = self.lanes
        user = lanes.user_of.get(first)
        if user is None:
            return
        room = self.residency.room(user, lanes.resident_count(user))
        if room is None or room > 0:
            return  # its cap does not keep it out: a slot of another's (free_slots_for)
        offered = set(plan.visible)
        victim = self.displacement.own_stream_victim(first, lambda r: r not in offered)
        if victim is None:
            return
        self._evict_for_quota(view, victim, evicted)
        plan.hidden -= 1  # its slot is the waiting request's now

    def _free_slots_for_waiting(
        self, view: EngineView, plan: StepPlan, free_slots: int, evicted: list[Any]
    ) -> set[str]:
        """Throttled requests must not keep every resident slot from others
        (see ``Displacement.free_slots_for``); the victims are appended to
        ``evicted``.  Returns the users who gave up a slot."""
        if free_slots > 0:
            return set()  # nobody lacks a slot; reading the queue would cost a look per request
        return self.displacement.free_slots_for(
            list(view.admittable_waiting()),  # evictions change the queue
            plan,
            free_slots=free_slots,
            active_cap=view.configured_active_cap(),
            # Held out of the waiting queue until the step ends (re-admitted
            # now, a victim would take back its slot).
            evict=lambda victim: self._evict_for_quota(view, victim, evicted),
        )

    def _evict_for_quota(self, view: EngineView, victim: Any, evicted: list[Any]) -> None:
        """Pay ``victim``'s eviction, have the engine preempt it and keep it
        out of the waiting queue, and note it in ``evicted`` (re-queued at
        the step's end)."""
        self._pay_eviction(victim)
        view.evict(victim)
        evicted.append(victim)

    def _pay_eviction(self, victim: Any) -> None:
        """Every eviction for quota is paid from the recompute budget, also
        those for a running request that needs KV (the engine would preempt
        someone then anyway: the budget runs into debt, and waiting requests
        wait until it is paid back); the victim comes back into free KV only."""
        self.budget.spend(victim.num_computed_tokens)
        self.evicted_for_quota.add(victim)

    def decision(
        self,
        view: EngineView,
        plan: StepPlan,
        prepaid: Container[Key],
        all_visible_paid: bool,
        running_at_start: int,
        borrow_admits: dict[str, int] | None = None,
        configured_cap: int = 0,
        max_resident: int = 0,
    ) -> StepDecision:
        """The decision of a step whose plan is made (``REPEAT_PLAN``: a
        repeated step)."""
        return StepDecision(
            self, view, plan, prepaid, all_visible_paid, running_at_start, borrow_admits,
            configured_cap, max_resident,
        )

    def record_admissions(
        self, decision: StepDecision, running_after: Sequence[Any], num_before: int
    ) -> list[Any]:
        """After the engine's loops, before :meth:`end`: the requests it
        admitted in this step, now resident.  The engine only appends
        admissions to its running list (``num_before`` long when its step
        began) and removes what it preempted, so without a preemption they
        are its tail; each is classified (prefilling or decoding) once, here."""
        lanes = self.lanes
        if decision.preempted:
            lane_of = lanes.lane_of
            admitted = [r for r in running_after if r not in lane_of]
        else:
            admitted = list(running_after[num_before:])
        evicted = self.evicted_for_quota
        for request in admitted:
            lanes.admit(request, can_progress_unpaid(request))
            if evicted:
                evicted.discard(request)
        decision.admitted = admitted
        return admitted

    def end(self, decision: StepDecision, outcome: StepOutcome) -> None:
        """Asked last in every step, with what the engine scheduled (after
        :meth:`record_admissions`): the one settle.  Every charge whose
        request did not end up scheduled at a sampling position is refunded
        (``StepGate.settle``, or ``Ledger.settle_repeat`` for a repeated
        step), prompt charges and drafts of what ran are kept and the rest
        refunded, the recompute budget earns, and the idle wait is worked
        out (:attr:`idle_wait_s`)."""
        self.current = None
        num_scheduled = outcome.num_scheduled_tokens
        sampled = SampledView(num_scheduled)
        admitted = decision.admitted
        if decision.repeat:
            # The quick settlement counts every decoding stream in the lanes
            # as sampled; an admission cut short of its sampling position (its
            # user could not pay) is one of them now, so such a step settles
            # key by key (issue 31: tokens counted that were neither taken
            # nor given).
            all_sampled = (
                not decision.preempted
                and len(num_scheduled) - len(admitted) == decision.running_at_start
                and not any(request.is_prefill_chunk for request in admitted)
            )
            self.ledger.settle_repeat(cast("list[Key]", decision.resident), sampled, all_sampled)
        else:
            plan = decision.plan
            lanes = self.lanes
            for request in plan.prefills:
                if cast(Any, request).request_id in num_scheduled:
                    lanes.set_progressing(request, can_progress_unpaid(request))
            # Every prepaid stream sampled iff, with nothing preempted, every
            # visible request was scheduled (all of them decoding streams,
            # each at its sampling position): a count, not a look at each.
            undisturbed = (
                not plan.prefills
                and not plan.reserved
                and not decision.preempted
                and len(num_scheduled) - len(admitted) == decision.num_offered
            )
            self.gate.settle(sampled, all_prepaid_sampled=undisturbed)
        prompt_cost = self.prompt_cost
        if prompt_cost.weight:
            self._settle_prompt_cost(decision, outcome)
        drafts = self.drafts
        if drafts is not None:
            self._settle_drafts(outcome)
        self.budget.earn(len(num_scheduled))
        if (
            outcome.total_num_scheduled_tokens == 0
            and not decision.held_for_other_reasons
            and not self.facts.data_parallel
        ):
            wait_ns = self.gate.idle_wait_ns()
            if wait_ns is not None and wait_ns > 0:
                wait_ns = self._unasked_wait_ns(decision.view, wait_ns)
            self.idle_wait_s = None if wait_ns is None else wait_ns / 1e9
        else:
            self.idle_wait_s = None

    def _unasked_wait_ns(self, view: EngineView, wait_ns: int) -> int:
        """``wait_ns`` (the refused users'), shortened to when a waiting user
        the empty step never asked can run: with every model-runner slot
        held, a user with nothing resident, whose request a throttled stream
        would give way for once its quota returns (``begin`` frees the slot
        then)."""
        if view.free_slots() > 0 or not view.has_waiting():
            return wait_ns
        lanes, ledger, gate = self.lanes, self.ledger, self.gate
        now = ledger.now_ns
        seen: set[str] = set()
        for request in view.admittable_waiting():
            user = lanes.user_of.get(request)
            if user is None or user in seen or request in self.evicted_for_quota:
                continue
            seen.add(user)
            if user in ledger.blocked or lanes.resident_count(user):
                continue
            if self.displacement.victim_for(request, waiting=True, paid=True) is None:
                continue
            ready = gate.ready_at_ns(user, now) - now
            if 0 < ready < wait_ns:
                wait_ns = ready
        return wait_ns

    def idle_wait_ns(self) -> int | None:
        """Asked after a step that ran nothing: how long the engine may wait
        for input before the next user can run (None: no user was held)."""
        wait_s = self.idle_wait_s
        return None if wait_s is None else int(wait_s * 1e9)

    def _settle_prompt_cost(self, decision: StepDecision, outcome: StepOutcome) -> None:
        """Keep the prompt charges of what was scheduled, refund the rest, and
        move the users refused for their prompt cost behind every other user.
        Their prefills are offered for free; at the front of the order they
        would take the visible room of the users behind them step after step
        while paying off a debt (when the active cap is below the resident
        requests)."""
        prompt_cost = self.prompt_cost
        if prompt_cost.step_charges:
            num_scheduled = outcome.num_scheduled_tokens

            def scheduled(request: Any) -> int:
                return num_scheduled.get(request.request_id, 0)

            prompt_cost.settle(scheduled, self.ledger.now_ns)
        refused = decision.refused_for_prompts
        if refused:
            order = self.lanes.order
            for user in refused:
                if user in order:
                    order.move_to_end(user)
            borrowing = self.gate.borrowing
            if borrowing is not None and not self._borrowers_refused_for_prompts:
                borrows = borrowing.table.borrows
                self._borrowers_refused_for_prompts = any(borrows(u) for u in refused)

    def _settle_drafts(self, outcome: StepOutcome) -> None:
        """The single refund point for drafts paid in this step."""
        scheduled = outcome.num_scheduled_tokens
        spec = outcome.scheduled_spec_decode_tokens

        def drafts_dispatched(req_id: Any) -> int:
            return len(spec.get(req_id, ())) if req_id in scheduled else 0

        assert self.drafts is not None
        self.drafts.settle_step(outcome, self.ledger.now_ns, drafts_dispatched)


class _BorrowedPrompts:
    """Borrowing seen as the lender of prompt chunks (``PromptCost``'s
    ``PromptLender``): paid on the cap a borrowed output token is paid on
    (a ceiled borrower's ceiling, and its group's cap), free of any cap for a
    borrower without a ceiling, nothing for a user that does not borrow."""

    __slots__ = ("borrowing",)

    def __init__(self, borrowing: Borrowing) -> None:
        self.borrowing = borrowing

    def room(self, user: str, now_ns: int) -> int | None:
        borrowing = self.borrowing
        table = borrowing.table
        if not table.borrows(user):
            return 0
        if not table.ceiled(user):
            return None
        cap = borrowing.cap
        return 0 if cap is None else cap.available(user, now_ns)

    def take(self, user: str, now_ns: int, tokens: int) -> int:
        borrowing = self.borrowing
        if not borrowing.table.borrows(user):
            return 0
        if not borrowing.table.ceiled(user):
            return tokens
        cap = borrowing.cap
        return 0 if cap is None else cap.take_up_to(user, now_ns, tokens)

    def refund(self, user: str, now_ns: int, tokens: int) -> None:
        borrowing = self.borrowing
        cap = borrowing.cap
        if cap is not None and borrowing.table.ceiled(user):
            cap.refund(user, now_ns, tokens)


def _cap_scope(borrowing: Borrowing, user: str) -> tuple[str, str]:
    """Whose borrowed tokens share the cap ``user``'s are paid on: its
    group's members (a group's cap counts them all), or the user alone."""
    group = borrowing.table.group_of(user)
    return ("user", user) if group is None else ("group", group)


def tokens_held(request: Any) -> int:
    """What recomputing an evicted request costs (as if no prefix were cached)."""
    held: int = request.num_computed_tokens
    return held


def generated_of(request: Any) -> int:
    """Output tokens a request has generated (victims: least first)."""
    generated: int = request.num_output_tokens
    return generated


def priority_of(request: Any) -> int:
    """A request's priority value (smaller: more important)."""
    priority: int = request.priority
    return priority


def uncomputed(request: Any) -> int:
    """Positions of ``request`` whose KV is not computed: what its admission
    would prefill (without what the prefix cache holds, not known yet)."""
    left: int = request.num_tokens - request.num_computed_tokens
    return left


def output_left(request: Any) -> int:
    """Tokens the request may still output (at most: it may stop sooner)."""
    left: int = max(request.max_tokens - request.num_output_tokens, 1)
    return left


class SampledView:
    """``key in view``: the request was scheduled at a sampling position."""

    __slots__ = ("_scheduled",)

    def __init__(self, num_scheduled_tokens: dict[str, int]) -> None:
        self._scheduled = num_scheduled_tokens

    def __contains__(self, request: Any) -> bool:
        return request.request_id in self._scheduled and not request.is_prefill_chunk

    def select(self, requests: list[Any]) -> list[Any]:
        """Those of ``requests`` in the view, in order (one call for a user's streams)."""
        scheduled = self._scheduled
        return [r for r in requests if r.request_id in scheduled and not r.is_prefill_chunk]


def can_progress_unpaid(request: Any) -> bool:
    """At least two positions left: the next chunk need not sample."""
    remaining: int = (
        request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
    )
    return remaining >= 2
