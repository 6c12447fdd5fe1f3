"""Prompt cost in the scheduler: vLLM's hooks for ``input_token_weight``.

:class:`PromptCostHooks` is a base of the scheduler mixin; the rule, the
debt and the bound are :mod:`vllm_output_rate.policy.prompt_cost`'s.  At
weight 0 (the default) the per-request hook is the plain charging hook and
none of this runs, so decisions are exactly those without prompt cost; a
reload that changes the weight swaps the hook between steps.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import Request, RequestStatus

from vllm_output_rate.policy.prompt_cost import PromptCost


class PromptCostHooks:
    """Charge computed prompt positions at dispatch; skip what cannot pay."""

    def _init_prompt_cost(self, weight: object) -> None:
        """Called once from the mixin's ``__init__``, after the gate exists."""
        self.output_rate_prompt_cost = prompt_cost = PromptCost(self._ledger, weight)
        # Its debts and group turns hold users back beyond their quota: the
        # gate's idle wait asks it when they can go (at weight 0 it holds
        # nobody, and the wait is the quota's).
        self.output_rate_gate.prompt_cost = prompt_cost
        # The same dict, never rebound: the step tests it without a call.
        self._prompt_debts = prompt_cost.debt
        self._refused_for_prompts: set[str] = set()
        self._prompt_cost_on = False
        self.set_input_token_weight(weight)

    def set_input_token_weight(self, weight: object) -> None:
        """Charge prompt tokens at ``weight`` from the next step on (0: free)."""
        prompt_cost = self.output_rate_prompt_cost
        prompt_cost.set_weight(weight)
        self._prompt_cost_on = on = prompt_cost.weight > 0
        hook = self._charge_with_prompt_cost if on else self._charge_at_sampling_position
        if self._draft_account is not None:
            hook = self._charge_with_drafts  # it charges the prompt cost itself
        self._charging_reserve_prefill_lookahead = hook
        self._reserve_prefill_lookahead = hook

    def _charge_with_prompt_cost(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """The charging hook with prompt cost: the chunk's uncharged prompt
        positions are paid for (possibly into debt) or the chunk waits."""
        if self._prepaid is None:  # outside a step of ours
            return self._charge_at_sampling_position(request, num_computed_tokens, num_new_tokens)
        prompt_cost = self.output_rate_prompt_cost
        num_prompt = request.num_prompt_tokens
        if num_computed_tokens < num_prompt and prompt_cost.uncharged(
            request, num_computed_tokens, num_new_tokens, num_prompt
        ):
            user = self._lanes.user_of[request]
            if not prompt_cost.can_pay(request, user):
                if request.status == RequestStatus.RUNNING:
                    self._refused_visible += 1
                self._behind_others(user)
                return 0
            num_new_tokens = self._charge_at_sampling_position(
                request, num_computed_tokens, num_new_tokens
            )
            if num_new_tokens > 0:
                prompt_cost.charge(request, user, num_computed_tokens, num_new_tokens, num_prompt)
            return num_new_tokens
        return self._charge_at_sampling_position(request, num_computed_tokens, num_new_tokens)

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        # A new request of a user in prompt debt cannot go in this step:
        # whatever the prefix cache holds, it computes at least its last
        # prompt position, never charged, and a user in debt cannot pay.
        # Skipped here, before vLLM's prefix-cache lookup, rather than in
        # _ec_transfer_pending after it: a flood's queued prompts would
        # otherwise cost a lookup each in every step until the debt is paid
        # (same decision, same refusal recorded).  Preempted requests take
        # the full path: their recompute below the charged mark is free.
        if (
            self._prompt_debts
            and self._prompt_cost_on
            and self._step_plan is not None
            and request.status == RequestStatus.WAITING
            and request.num_computed_tokens == 0
        ):
            user = self._lanes.user_of[request]
            if user in self._prompt_debts and request not in self.output_rate_prompt_cost.charged_upto:
                self._resume_charging()  # as every waiting-loop hook does first
                self.output_rate_prompt_cost.can_pay(request, user)  # records the refusal
                self._behind_others(user)
                return False
        return super()._handle_blocked_waiting_request(request)

    def _ec_transfer_pending(self, request: Request, num_computed_tokens: int) -> bool:
        if super()._ec_transfer_pending(request, num_computed_tokens):
            return True
        if not self._prompt_cost_on or self._step_plan is None:
            return False
        # After the prefix-cache lookup: a request that would compute prompt
        # positions nobody paid for yet is skipped while its user cannot pay,
        # instead of stopping admission for everybody behind it.
        num_prompt = request.num_prompt_tokens
        if num_computed_tokens >= num_prompt or not self.output_rate_prompt_cost.uncharged(
            request, num_computed_tokens, num_prompt, num_prompt
        ):
            return False
        user = self._lanes.user_of[request]
        if self.output_rate_prompt_cost.can_pay(request, user):
            return False
        self._behind_others(user)
        return True

    def _behind_others(self, user: str) -> None:
        """Remember a user refused for its prompt cost: it goes to the back of
        the service order when the step is settled (see _settle_prompt_cost)."""
        self._refused_for_prompts.add(user)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any):
        prompt_cost = self.output_rate_prompt_cost
        prompt_cost.forget(request)
        user = self._lanes.user_of.get(request)
        result = super()._free_request(request, *args, **kwargs)
        if user is not None and user not in self._lanes.order:
            prompt_cost.forget_user(user)
        return result

    def _settle_prompt_cost(self, output) -> None:
        """End of a step (after the ledger's settle): keep the prompt charges of
        what was scheduled, refund the rest, and move the users refused for
        their prompt cost behind every other user.  Their prefills are shown to
        vLLM for free; at the front of the order they would take the visible
        room of the users behind them step after step while paying off a debt
        (when the active cap is below the resident requests)."""
        prompt_cost = self.output_rate_prompt_cost
        if prompt_cost.step_charges:
            num_scheduled = output.num_scheduled_tokens
            prompt_cost.settle(
                lambda request: num_scheduled.get(request.request_id, 0), self._ledger.now_ns
            )
        refused = self._refused_for_prompts
        if refused:
            order = self._lanes.order
            for user in refused:
                if user in order:
                    order.move_to_end(user)
            refused.clear()
