"""The offline ``LLM(...)`` API with ``additional_config["output_rate"]``.

Runs the real engine in this process (no engine-core subprocess) on the tiny
model: pacing of a limited user (wide margin), identity validation, beam
search refusal.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    engine = LLM(
        tiny_model_dir,
        max_model_len=256,
        additional_config={
            "output_rate": {
                "default_user_output_tokens_per_second": 1000,
                "user_output_tokens_per_second": {"slow": 20},
            }
        },
    )
    yield engine
    del engine
    mp.undo()


def test_engine_uses_the_rate_limited_scheduler(llm):
    from vllm_output_rate.adapter.scheduler import OutputRateSchedulerMixin

    core = llm.llm_engine.engine_core.engine_core
    assert isinstance(core.scheduler, OutputRateSchedulerMixin)


def test_limited_user_is_paced_and_complete(llm):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=40, ignore_eos=True, extra_args={"output_rate_user": "slow"})
    start = time.monotonic()
    outputs = llm.generate(["hello", "world"], params, use_tqdm=False)
    elapsed = time.monotonic() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [40, 40]
    # 80 tokens at 20 tok/s, shared by both requests: at least (80 - burst)
    # / 20 s.  The burst allows 0.1 * 20 + 1 = 3 tokens at once.
    assert elapsed >= (80 - 3) / 20 * 0.95


def test_bad_identity_is_refused_even_when_params_predate_the_engine(llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_output_rate.adapter import patches

    for bad in (7, "", "x" * 257):
        # Built while no rate-limited engine exists in the process, so
        # SamplingParams' own check is not armed; the engine checks anyway.
        patches._set_frontend_active(False)
        try:
            params = SamplingParams(max_tokens=2, extra_args={"output_rate_user": bad})
        finally:
            patches._set_frontend_active(True)
        with pytest.raises((ValueError, VLLMValidationError), match="output_rate_user"):
            llm.generate(["hi"], params, use_tqdm=False)


def test_beam_search_is_refused(llm):
    from vllm.sampling_params import BeamSearchParams

    with pytest.raises(ValueError, match="beam search"):
        llm.beam_search([{"prompt": "hi"}], BeamSearchParams(beam_width=2, max_tokens=4))
