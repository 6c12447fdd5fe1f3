"""StepPolicy.close (``policy/step.py``): the engine's shutdown stops every quota it holds."""

from __future__ import annotations

from vllm_output_rate.factory import make_limiter, make_step_policy
from vllm_output_rate.policy.step import EngineFacts
from vllm_output_rate.settings import OutputRateSettings


def test_close_stops_the_rates_the_ceilings_and_the_groups():
    settings = OutputRateSettings.from_additional_config({"output_rate": {
        "default_user_output_tokens_per_second": 10,
        "user_output_tokens_per_second": {"a": {"rate": 1, "ceil": 50, "group": "g"}},
        "groups": {"g": 20},
    }})
    rates = make_limiter(settings)
    policy = make_step_policy(
        settings, rates, EngineFacts(chunked_prefill=True, priority_policy=False, data_parallel=False),
        max_model_len=64, spec_decode=False, can_release=lambda request: True,
    )
    closed: list[str] = []
    ceiling = policy.borrowing.ceiling
    rates.close = lambda: closed.append("rates")
    ceiling.close = lambda: closed.append("ceilings")
    policy.groups.close = lambda: closed.append("groups")
    policy.close()
    assert closed == ["rates", "ceilings", "groups"]
