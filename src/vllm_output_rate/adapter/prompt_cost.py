"""Prompt cost in the scheduler: vLLM's hooks for ``input_token_weight``.

:class:`PromptCostHooks` is a base of the scheduler mixin; the rule, the
debt and the bound are :mod:`vllm_output_rate.policy.prompt_cost`'s.  At
weight 0 (the default) none of this runs, so decisions are exactly those
without prompt cost; a reload may change the weight between steps.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import Request, RequestStatus


class PromptCostHooks:
    """Charge computed prompt positions at dispatch; skip what cannot pay."""

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        # A new request of a user in prompt debt cannot go in this step:
        # whatever the prefix cache holds, it computes at least its last
        # prompt position, never charged, and a user in debt cannot pay.
        # Skipped here, before vLLM's prefix-cache lookup, rather than in
        # _ec_transfer_pending after it: a flood's queued prompts would
        # otherwise cost a lookup each in every step until the debt is paid
        # (same decision, same refusal recorded).  Preempted requests take
        # the full path: their recompute below the charged mark is free.
        step = self._step
        if step is None:
            return super()._handle_blocked_waiting_request(request)
        prompt_cost = self.output_rate_prompt_cost
        if (
            prompt_cost.debt
            and prompt_cost.weight
            and request.status == RequestStatus.WAITING
            and request.num_computed_tokens == 0
        ):
            user = self._lanes.user_of[request]
            if user in prompt_cost.debt and request not in prompt_cost.charged_upto:
                prompt_cost.can_pay(request, user)  # records the refusal
                step.refused_for_prompts.add(user)
                return False
        return super()._handle_blocked_waiting_request(request)

    def _ec_transfer_pending(self, request: Request, num_computed_tokens: int) -> bool:
        if super()._ec_transfer_pending(request, num_computed_tokens):
            return True
        step = self._step
        if step is None or not self.output_rate_prompt_cost.weight:
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
        step.refused_for_prompts.add(user)  # behind every other user next
        return True

    def _free_request(self, request: Request, *args: Any, **kwargs: Any):
        if self._lanes is None:  # built without our __init__: stock
            return super()._free_request(request, *args, **kwargs)
        prompt_cost = self.output_rate_prompt_cost
        prompt_cost.forget(request)
        user = self._lanes.user_of.get(request)
        result = super()._free_request(request, *args, **kwargs)
        if user is not None and user not in self._lanes.order:
            prompt_cost.forget_user(user)
        return result
