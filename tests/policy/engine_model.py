"""A small engine model of vLLM's v1 scheduler loop, in plain Python (issue 43, Required 3).

Not vLLM: a deterministic model of what the plugin's step policy sees of it,
so that the promises of SPEC section 10 can be judged over thousands of
generated examples in seconds (``tests/policy/test_step_model.py``).  The real
scheduler stays the check that the adapter translates faithfully
(``tests/adapter/test_charge_path_machine.py``).

What is modelled (the order of checks follows vLLM 0.32's
``Scheduler.schedule``, as the adapter's hooks meet it):

* **Requests**: a prompt length, ``max_tokens``, a priority, a user, an
  arrival number.  ``num_computed_tokens`` advances by what a step schedules;
  a chunk that reaches the last known position (``num_tokens``) samples one
  token; a request finishes at ``max_tokens`` output tokens.  No prefix cache,
  no stop tokens, no drafts, synchronous scheduling only (the output of step N
  is applied before step N+1 is scheduled).
* **Slots**: ``max_num_seqs`` resident requests at most; the waiting loop
  stops once the requests its running list holds reach the active cap the
  policy reports (stock: ``max_num_active_seqs``, else ``max_num_seqs``).
* **Token budget** per step, spent in list order; without chunked prefill a
  waiting request whose whole prompt does not fit the budget left stops the
  waiting loop (vLLM's ``break``).
* **KV blocks** of ``block_size`` tokens: a request holds
  ``ceil(computed / block_size)`` blocks; an allocation that does not fit the
  free blocks fails.  In the running loop a failure first asks the policy for
  a victim (the plugin's evicting KV manager), then preempts vLLM's way: the
  last request of the running list (FCFS) or the least important, latest one
  (PRIORITY), until the request fits or preempted itself.  The waiting loop
  does not run in a step that preempted; an allocation failure there stops it.
* **Waiting queue**: first come first served, preempted requests back at the
  front; or by (priority, arrival).  A request the policy does not admit goes
  through vLLM's skip path (it keeps its place; the loop goes on).

One step (:meth:`Engine.step`), in the order an engine loop calls the policy:

1. ``policy.begin(engine, now)`` -> a decision; it may evict hidden resident
   requests first (``engine.evict``) and names the running list vLLM's loop
   sees (``decision.visible``; None: every resident request, stock);
2. the running loop: per request ``decision.tokens_for``; on a failed KV
   allocation ``decision.victim_for`` before vLLM's own preemption;
3. the waiting loop (only if nothing was preempted): per request
   ``decision.active_cap()`` (the cap on the running list),
   ``decision.may_admit`` (before the cache lookup), ``decision.may_start``
   (after it), then ``decision.tokens_for``, then the allocation;
4. computed tokens advance; ``policy.end(decision, record)`` (the one settle);
   the engine's idle wait is ``policy.idle_wait_ns()`` after a step that
   scheduled nothing;
5. outputs: every request scheduled at its sampling position gains a token;
   finished requests leave (``policy.on_free``).

:class:`StockPolicy` is no policy at all (the equivalence reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

WAITING = "waiting"
PREEMPTED = "preempted"
RUNNING = "running"
FINISHED = "finished"


class Req:
    """One request; compared by identity (the policy uses it as its key)."""

    __slots__ = (
        "request_id", "user", "num_prompt_tokens", "max_tokens", "priority", "arrival",
        "num_computed_tokens", "num_output_tokens", "status", "blocks", "sample_steps",
    )

    def __init__(self, request_id: str, user: str, prompt: int, max_tokens: int,
                 priority: int, arrival: int) -> None:
        self.request_id = request_id
        self.user = user
        self.num_prompt_tokens = prompt
        self.max_tokens = max_tokens
        self.priority = priority
        self.arrival = arrival
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.status = WAITING
        self.blocks = 0
        self.sample_steps: list[int] = []  # step numbers at which it sampled

    def __hash__(self) -> int:
        # Sets of requests iterate in arrival order, not in the order of
        # their addresses: every example replays exactly, run after run.
        return self.arrival

    # What the policy's helpers read of a vLLM request, under the same names.
    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    num_output_placeholders = 0

    @property
    def is_prefill_chunk(self) -> bool:
        return self.num_computed_tokens < self.num_tokens

    def __repr__(self) -> str:
        return f"<{self.request_id} {self.user} {self.num_computed_tokens}/{self.num_tokens}>"


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8
    max_num_active_seqs: int | None = None
    token_budget: int = 64
    num_blocks: int = 10_000
    block_size: int = 16
    chunked: bool = True
    priority: bool = False

    @property
    def active_cap(self) -> int:
        if self.max_num_active_seqs is None:
            return self.max_num_seqs
        return min(self.max_num_active_seqs, self.max_num_seqs)


@dataclass
class StepRecord:
    """What one step did."""

    number: int
    now_ns: int
    scheduled: dict[Req, int] = field(default_factory=dict)  # request -> tokens, in order
    sampled: list[Req] = field(default_factory=list)  # scheduled at the sampling position
    prompt_computed: dict[str, int] = field(default_factory=dict)  # user -> prompt positions
    visible: list[Req] = field(default_factory=list)  # the running list vLLM's loop began with
    preempted: list[Req] = field(default_factory=list)  # by vLLM's rule or by the policy
    evicted: list[Req] = field(default_factory=list)  # the policy's victims among them
    admitted: list[Req] = field(default_factory=list)
    finished: list[Req] = field(default_factory=list)
    idle_wait_ns: int | None = None
    active_cap: int = 0  # the cap on the running list the waiting loop last read
    running_len: int = 0  # the running list at the end of the waiting loop
    running_after: list[Req] = field(default_factory=list)  # the running list after the loops
    #: Why vLLM's waiting loop stopped before the queue's end (None: it did not).
    waiting_stop: str | None = None

    @property
    def total_tokens(self) -> int:
        return sum(self.scheduled.values())

    def trace(self) -> tuple:
        """The decisions, comparable across engines: who got how many tokens
        in which order, who was preempted."""
        return (
            tuple((r.request_id, n) for r, n in self.scheduled.items()),
            tuple(r.request_id for r in self.preempted),
        )


class Decision(Protocol):
    """One step's answers to the engine loop's questions."""

    visible: list[Req] | None

    def active_cap(self) -> int: ...
    def may_admit(self, request: Req) -> bool: ...
    def may_start(self, request: Req, computed: int) -> bool: ...
    def tokens_for(self, request: Req, computed: int, new: int) -> int: ...
    def victim_for(self, request: Req) -> Req | None: ...


class Policy(Protocol):
    def on_add(self, request: Req) -> None: ...
    def on_preempt(self, request: Req) -> None: ...
    def on_free(self, request: Req) -> None: ...
    def begin(self, engine: Engine, now_ns: int) -> Decision: ...
    def end(self, decision: Decision, record: StepRecord) -> None: ...
    def idle_wait_ns(self) -> int | None: ...


class _StockDecision:
    visible = None

    def __init__(self, cap: int) -> None:
        self._cap = cap

    def active_cap(self) -> int:
        return self._cap

    def may_admit(self, request: Req) -> bool:
        return True

    def may_start(self, request: Req, computed: int) -> bool:
        return True

    def tokens_for(self, request: Req, computed: int, new: int) -> int:
        return new

    def victim_for(self, request: Req) -> Req | None:
        return None


class StockPolicy:
    """No policy: the engine decides as stock vLLM."""

    def on_add(self, request: Req) -> None:
        pass

    on_preempt = on_free = on_add

    def begin(self, engine: Engine, now_ns: int) -> Decision:
        return _StockDecision(engine.config.active_cap)

    def end(self, decision: Decision, record: StepRecord) -> None:
        pass

    def idle_wait_ns(self) -> int | None:
        return None


class Engine:
    """The model engine; see the module docstring for what one step does."""

    def __init__(self, config: EngineConfig, policy: Policy | None = None) -> None:
        self.config = config
        self.policy = policy if policy is not None else StockPolicy()
        self.requests: dict[str, Req] = {}
        #: Resident requests (KV and a model-runner slot), admission order.
        self.resident: list[Req] = []
        #: The list vLLM's loops run on during a step (the resident list
        #: between steps).
        self.running: list[Req] = self.resident
        self.waiting: list[Req] = []
        self.free_blocks = config.num_blocks
        self.steps = 0
        self._arrivals = 0
        self._held_out: list[Req] = []  # evicted in the step: back in the queue at its end
        self._record: StepRecord | None = None

    # -- requests ---------------------------------------------------------

    def add(self, user: str, prompt: int, max_tokens: int, priority: int = 0) -> Req:
        self._arrivals += 1
        request = Req(f"r{self._arrivals}", user, prompt, max_tokens, priority, self._arrivals)
        self.policy.on_add(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return request

    def abort(self, request: Req) -> None:
        if request.status == FINISHED:
            return
        if request in self.resident:
            self.resident.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request)

    def live(self) -> list[Req]:
        return [r for r in self.requests.values() if r.status != FINISHED]

    # -- KV -----------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _allocate(self, request: Req, computed: int, new: int) -> bool:
        need = self.blocks_for(computed + new) - request.blocks
        if need > self.free_blocks:
            return False
        if need > 0:
            self.free_blocks -= need
            request.blocks += need
        return True

    def _release(self, request: Req) -> None:
        self.free_blocks += request.blocks
        request.blocks = 0

    def _preempt(self, request: Req) -> None:
        """vLLM's ``_preempt_request``: blocks freed, back to the front of the queue."""
        self._release(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        self.policy.on_preempt(request)
        self.waiting.insert(0, request)
        if self._record is not None:
            self._record.preempted.append(request)

    def evict(self, victim: Req) -> None:
        """The policy preempts a resident request (not in vLLM's running
        list): held out of the waiting queue until the step ends, as the
        adapter does (re-admitted at once, it would take back its slot)."""
        if victim in self.resident:
            self.resident.remove(victim)
        if victim in self.running and self.running is not self.resident:
            self.running.remove(victim)
        self._preempt(victim)
        self.waiting.remove(victim)
        self._held_out.append(victim)
        if self._record is not None:
            self._record.evicted.append(victim)

    def give_up(self, victim: Req) -> None:
        """Before the step's loops, the policy preempts a resident request to
        hand its slot to another (it waits at the front of the queue)."""
        if victim in self.resident:
            self.resident.remove(victim)
        self._preempt(victim)
        if self._record is not None:
            self._record.evicted.append(victim)

    def queue_order(self) -> list[Req]:
        """The waiting queue in the order the waiting loop meets it."""
        if self.config.priority:
            return sorted(self.waiting, key=lambda r: (r.priority, r.arrival))
        return list(self.waiting)

    def _finish(self, request: Req) -> None:
        self._release(request)
        request.status = FINISHED
        self.policy.on_free(request)

    def _peek(self) -> Req:
        if self.config.priority:
            return min(self.waiting, key=lambda r: (r.priority, r.arrival))
        return self.waiting[0]

    # -- one step -------------------------------------------------------------

    def step(self, now_ns: int) -> StepRecord:
        cfg = self.config
        self.steps += 1
        record = self._record = StepRecord(self.steps, now_ns)
        self._held_out = []
        decision = self.policy.begin(self, now_ns)
        # begin() may have evicted hidden requests from the resident list.
        resident_start = list(self.resident)
        visible = decision.visible
        self.running = list(resident_start) if visible is None else list(visible)
        record.visible = list(self.running)
        budget = cfg.token_budget
        scheduled = record.scheduled

        # The running loop.  Only vLLM's own preemptions stop the waiting
        # loop (the policy's evictions are not in vLLM's list).
        vllm_preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            new = request.num_tokens - request.num_computed_tokens
            new = min(new, budget)
            new = decision.tokens_for(request, request.num_computed_tokens, new)
            if new == 0:
                index += 1
                continue
            fitted = True
            while not self._allocate(request, request.num_computed_tokens, new):
                if decision.victim_for(request) is not None:
                    continue  # the policy evicted one: try again
                if cfg.priority:
                    victim = max(self.running, key=lambda r: (r.priority, r.arrival))
                    at = self.running.index(victim)
                    del self.running[at]
                    if at < index:
                        index -= 1
                    if victim in scheduled:
                        budget += scheduled.pop(victim)
                else:
                    victim = self.running.pop()
                self._preempt(victim)
                vllm_preempted = True
                if victim is request:
                    fitted = False
                    break
            if not fitted:
                break
            scheduled[request] = new
            budget -= new
            index += 1

        # The waiting loop, only in a step that preempted nothing.
        if not vllm_preempted:
            skipped: list[Req] = []
            while budget > 0 and self.waiting:
                cap = decision.active_cap()
                record.active_cap = cap
                if len(self.running) >= cap:
                    record.waiting_stop = "active cap"
                    break
                request = self._peek()
                if not decision.may_admit(request):
                    self.waiting.remove(request)
                    skipped.append(request)
                    continue
                computed = request.num_computed_tokens  # no prefix cache
                if not decision.may_start(request, computed):
                    self.waiting.remove(request)
                    skipped.append(request)
                    continue
                new = request.num_tokens - computed
                if not cfg.chunked and new > budget:
                    record.waiting_stop = "whole prefill over the budget"
                    break
                new = min(new, budget)
                new = decision.tokens_for(request, computed, new)
                if new == 0:
                    record.waiting_stop = "cut to 0 tokens"
                    break
                if not self._allocate(request, computed, new):
                    if decision.victim_for(request) is not None and self._allocate(
                        request, computed, new
                    ):
                        pass
                    else:
                        record.waiting_stop = "no KV"
                        break
                self.waiting.remove(request)
                self.running.append(request)
                request.status = RUNNING
                record.admitted.append(request)
                scheduled[request] = new
                budget -= new
            self.waiting[0:0] = skipped
        record.running_len = len(self.running)
        record.running_after = list(self.running)

        # The resident list again: preempted ones out, admissions in.
        gone = set(map(id, record.preempted))
        # A new list: the policy may hold the one the step began with.
        self.resident = [r for r in resident_start if id(r) not in gone] + record.admitted
        self.running = self.resident
        self.waiting[0:0] = self._held_out
        self._held_out = []

        # Computed tokens advance (vLLM's _update_after_schedule).
        for request, n in scheduled.items():
            start = request.num_computed_tokens
            request.num_computed_tokens = start + n
            prompt = min(start + n, request.num_prompt_tokens) - start
            if prompt > 0:
                record.prompt_computed[request.user] = record.prompt_computed.get(request.user, 0) + prompt
            if not request.is_prefill_chunk:
                record.sampled.append(request)
        self._record = None
        self.policy.end(decision, record)
        if not scheduled:
            record.idle_wait_ns = self.policy.idle_wait_ns()

        # Outputs (vLLM's update_from_output, synchronous scheduling).
        for request in record.sampled:
            request.num_output_tokens += 1
            request.sample_steps.append(self.steps)
            if request.num_output_tokens >= request.max_tokens:
                self.resident.remove(request)
                self._finish(request)
                record.finished.append(request)
        return record
