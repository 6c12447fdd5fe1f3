"""Prompt cost in the scheduler: vLLM's hooks for ``input_token_weight``.

:class:`PromptCostHooks` is a base of the scheduler mixin; the rule, the
debt and the bound are :mod:`vllm_output_rate.policy.prompt_cost`'s, the
decisions the step's (``StepDecision.may_consider``, ``may_start``,
``tokens_for``).  At weight 0 (the default) none of it runs, so decisions
are exactly those without prompt cost; a reload may change the weight
between steps.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import Request, RequestStatus


class PromptCostHooks:
    """Skip a new request whose user is in prompt debt; forget a finished
    request's prompt charges."""

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        # Before vLLM's own checks and its prefix-cache lookup: a new request
        # of a user in prompt debt is skipped (StepDecision.may_consider).
        step = self._step
        if (
            step is not None
            and request.status == RequestStatus.WAITING
            and request.num_computed_tokens == 0
            and not step.may_consider(request)
        ):
            return False
        return super()._handle_blocked_waiting_request(request)

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
