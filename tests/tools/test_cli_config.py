"""Configuration surface: CLI flag validation, refused modes, help, engine config.

Three kinds of tests:

* fast CLI tests -- ``vllm-output-rate serve <tiny> <bad flags>`` must fail
  before vLLM is imported (a stand-in ``vllm`` package ahead on the path
  records any import), with exactly one ``vllm-output-rate: error:`` line;
* slow CLI tests (marked ``server``: a real ``serve`` that imports vLLM) --
  refused modes (data parallel without a store) are detected while vLLM builds its config, so vLLM is
  imported (~15-25 s each on 2 cores) but no engine runs;
* in-process tests on ``EngineArgs`` / ``AsyncEngineArgs`` with the plugin's
  patches installed, and the vLLM version guard.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from server_harness import CLI, free_port, run_cli, server_env
from vllm_output_rate.adapter import compat
from vllm_output_rate.adapter import patches as patches_module  # no vLLM import at load
from vllm_output_rate.adapter.compat import UnsupportedVllmVersion, require_supported_vllm
from vllm_output_rate.adapter.series import SERIES
from vllm_output_rate.settings import (
    DEFAULT_FLAG,
    DEFAULT_KEY,
    GROUPS_FLAG,
    OVERRIDES_FLAG,
    OVERRIDES_KEY,
    OutputRateConfigError,
)

SCHEDULER_CLS = "vllm_output_rate.adapter.scheduler.OutputRateScheduler"
ERROR_PREFIX = "vllm-output-rate: error: "
#: A hang guard for a real refused ``serve`` (vLLM is imported: ~15-25 s
#: idle, more under load), not a speed limit.
REFUSAL_TIMEOUT_S = 150.0
#: The stand-in ``vllm`` package writes this file when anything imports it.
VLLM_IMPORTED_ENV = "VLLM_OUTPUT_RATE_TEST_VLLM_IMPORTED"


# -- helpers -----------------------------------------------------------------------


def _stderr_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def _start_cli(args: list[str]) -> tuple[subprocess.Popen, float]:
    """Start ``vllm-output-rate ARGS`` in its own process group."""
    proc = subprocess.Popen(
        [str(CLI), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=server_env(),
        start_new_session=True,
    )
    return proc, time.monotonic()


def _finish_cli(
    proc: subprocess.Popen, start: float, timeout: float
) -> tuple[subprocess.CompletedProcess, float]:
    """Wait for a CLI started by :func:`_start_cli`; on timeout stop its whole group by PID."""
    try:
        out, err = proc.communicate(timeout=max(1.0, start + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{proc.args} did not exit within {timeout}s; stderr tail:\n{err[-3000:]}")
    elapsed = time.monotonic() - start
    _assert_group_gone(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), elapsed


def _assert_group_gone(pgid: int) -> None:
    """No process of the CLI's group (engine core, workers) may outlive it."""
    deadline = time.monotonic() + 10
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            pytest.fail("processes of the refused `serve` were still running after it exited")
        time.sleep(0.2)


# -- fixtures ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_tripwire(tmp_path_factory) -> dict[str, str]:
    """``env`` for a CLI run in which importing vLLM leaves a file behind
    (and fails): a stand-in ``vllm`` package ahead of the real one."""
    root = tmp_path_factory.mktemp("vllm-tripwire")
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(
        "import os\n"
        f"open(os.environ[{VLLM_IMPORTED_ENV!r}], 'w').close()\n"
        "raise ImportError('vllm was imported')\n"
    )
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


@pytest.fixture(scope="session")
def plugin():
    """vLLM with the plugin's patches installed (what vLLM's plugin loader does)."""
    import vllm_output_rate

    vllm_output_rate.register()
    vllm_output_rate.register()  # idempotent
    from vllm_output_rate.adapter import patches

    return patches


@pytest.fixture(autouse=True)
def _restore_frontend_flag(monkeypatch):
    """Creating an engine config flips a process-global; keep other tests unaffected."""
    monkeypatch.setattr(patches_module, "_frontend_active", patches_module._frontend_active)


def _on(default=5, overrides=None) -> dict:
    section = {DEFAULT_KEY: default}
    if overrides is not None:
        section[OVERRIDES_KEY] = overrides
    return {"output_rate": section}


def _engine_args(tiny_model_dir, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=tiny_model_dir, max_model_len=256, **kwargs)


# -- fast CLI refusals of bad flag values -------------------------------------------

D, O = DEFAULT_FLAG, OVERRIDES_FLAG

BAD_FLAGS = [
    # (id, extra args, substrings the single error line must contain)
    ("malformed-json", [D, "5", O, '{"a": 1'], [O, "malformed JSON"]),
    ("json-nan-constant", [D, "5", O, '{"a": NaN}'], [O, "malformed JSON", "NaN"]),
    ("json-infinity-constant", [D, "5", O, '{"a": Infinity}'], [O, "malformed JSON", "Infinity"]),
    ("json-list", [D, "5", O, "[1, 2]"], [O, "must be a JSON object", "list"]),
    ("json-string", [D, "5", O, '"user-a"'], [O, "must be a JSON object", "str"]),
    ("json-number", [D, "5", O, "20"], [O, "must be a JSON object", "int"]),
    ("json-negative-number", [D, "5", O, "-1"], [O, "must be a JSON object"]),
    ("empty-user", [D, "5", O, '{"": 20}'], [O, "user names must be non-empty"]),
    ("long-user", [D, "5", O, '{"%s": 20}' % ("u" * 257)], [O, "longer than 256"]),
    ("default-not-number", [D, "fast"], [D, "must be a number", "'fast'"]),
    ("default-empty", [D, ""], [D, "must be a number"]),
    ("default-zero", [D, "0"], [D, "must be positive"]),
    ("default-negative", [D, "-5"], [D, "must be positive"]),
    ("default-negative-eq", [D + "=-0.5"], [D, "must be positive"]),
    ("default-nan", [D, "nan"], [D, "must be a number", "NaN"]),
    ("default-inf", [D, "inf"], [D, "must be finite"]),
    ("default-minus-inf", [D, "-inf"], [D, "must be finite"]),
    ("default-overflow", [D, "1e999"], [D, "must be finite"]),
    ("default-missing-value", [D], [D, "expected one argument"]),
    ("override-not-number", [D, "5", O, '{"a": "fast"}'], [O + "['a']", "must be a number"]),
    ("override-bool", [D, "5", O, '{"a": true}'], [O + "['a']", "must be a number"]),
    ("override-null", [D, "5", O, '{"a": null}'], [O + "['a']", "must be a number"]),
    ("override-zero", [D, "5", O, '{"a": 0}'], [O + "['a']", "must be positive"]),
    ("override-negative", [D, "5", O, '{"a": -3}'], [O + "['a']", "must be positive"]),
    ("override-overflow", [D, "5", O, '{"a": 1e999}'], [O + "['a']", "must be finite"]),
    ("override-huge-int", [D, "5", O, '{"a": 1%s}' % ("0" * 400)], [O + "['a']", "too large"]),
    ("override-without-default", [O, '{"a": 20}'], [O, "requires " + D]),
    ("bad-override-without-default", [O, "{bad"], [O, "requires " + D]),
]


@pytest.mark.parametrize(
    "args,expected", [pytest.param(a, e, id=i) for i, a, e in BAD_FLAGS]
)
def test_bad_flag_value_is_one_line_error(tiny_model_dir, vllm_tripwire, tmp_path, args, expected):
    imported = tmp_path / "vllm-imported"
    env = {**vllm_tripwire, VLLM_IMPORTED_ENV: str(imported)}
    proc = run_cli(["serve", tiny_model_dir, "--host", "127.0.0.1", *args], timeout=60, env=env)

    assert not imported.exists(), "vLLM was imported before the flags were refused"
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = _stderr_lines(proc)
    assert len(lines) == 1, f"expected exactly one stderr line, got:\n{proc.stderr}"
    line = lines[0]
    assert line.startswith(ERROR_PREFIX), line
    for part in expected:
        assert part in line, f"{part!r} not in {line!r}"
    assert "Traceback" not in proc.stderr
    assert proc.stdout == "", "vLLM must not have started:\n" + proc.stdout[-2000:]


# -- slow CLI refusals of unsupported modes ------------------------------------------

# One real ``serve`` refusal; every refused mode goes through the same check and
# the same one-line error path, and each one is refused in-process below
# (REFUSED_ENGINE_ARGS).  A real serve costs a vLLM import (~13 s of a core).
REFUSED_MODES = [
    (
        "data-parallel",
        ["--data-parallel-size", "2"],
        "does not support data_parallel_size > 1 without --output-rate-store",
    ),
]


HELP_RUN = "help"


@pytest.fixture(scope="module")
def serve_runs(tiny_model_dir):
    """Every real ``serve`` of this module, started side by side, then awaited.

    Each one imports vLLM (~13 s of one core); run one after the other they
    took ~40 s of the suite, side by side on two cores about half of that.
    id -> (completed process, seconds from its start to its exit).
    """
    commands = {
        mode: [
            "serve", tiny_model_dir,
            "--host", "127.0.0.1", "--port", str(free_port()),
            "--max-model-len", "256",
            D, "5",
            *args,
        ]
        for mode, args, _ in REFUSED_MODES
    }
    commands[HELP_RUN] = ["serve", tiny_model_dir, "--help=OutputRate"]
    started = {key: _start_cli(args) for key, args in commands.items()}
    runs = {}
    try:
        for key, (proc, start) in started.items():
            runs[key] = _finish_cli(proc, start, timeout=REFUSAL_TIMEOUT_S)
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    return runs


@pytest.mark.server
@pytest.mark.parametrize(
    "mode,message", [pytest.param(i, m, id=i) for i, _, m in REFUSED_MODES]
)
def test_unsupported_mode_is_refused_by_serve(serve_runs, mode, message):
    proc, elapsed = serve_runs[mode]
    print(f"refusal {mode}: {elapsed:.1f}s")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = _stderr_lines(proc)
    assert lines, "no error message on stderr"
    last = lines[-1]
    assert last.startswith(ERROR_PREFIX + "per-user output rate limiting " + message), (
        proc.stderr[-3000:]
    )
    # The message is printed once and no other error line accompanies it
    # (vLLM itself may print unrelated warnings, e.g. about Triton).
    assert sum(ERROR_PREFIX in line for line in lines) == 1, proc.stderr
    assert not any("error" in line.lower() for line in lines[:-1]), proc.stderr


# -- help ---------------------------------------------------------------------------


def test_serve_help_lists_output_rate_group(plugin, capsys):
    """Plain ``serve --help`` lists config groups; OutputRate must be one of them.

    In-process on the parser vLLM's ``serve`` builds (same code path as the
    CLI, without paying another vLLM import); the CLI itself is covered by
    the ``--help=OutputRate`` test below.
    """
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # vLLM's serve parser lives in a series-dependent module (moved in 0.33).
    parser = compat.installed_series().make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--help"])
    assert info.value.code in (0, None)
    text = capsys.readouterr().out
    group_lines = [
        line for line in text.splitlines()
        if line.strip().startswith("OutputRate ") and "Per-user output-token rate limits" in line
    ]
    assert len(group_lines) == 1, text


@pytest.mark.server
def test_serve_help_output_rate_group_shows_flags(serve_runs):
    proc, elapsed = serve_runs[HELP_RUN]
    print(f"serve --help=OutputRate: {elapsed:.1f}s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "OutputRate:" in text, text
    section = text[text.index("OutputRate:"):]
    assert f"{DEFAULT_FLAG} N" in section, text
    assert f"{OVERRIDES_FLAG} JSON" in section, text
    assert "Requires --default-" in section  # help of the overrides flag (wrapped)


def test_parser_group_holds_the_rate_flags(plugin):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    groups = [g for g in parser._action_groups if g.title == "OutputRate"]
    assert len(groups) == 1
    options = [opt for action in groups[0]._group_actions for opt in action.option_strings]
    assert options == [DEFAULT_FLAG, OVERRIDES_FLAG, GROUPS_FLAG]


# -- in-process: EngineArgs.create_engine_config -------------------------------------


def test_feature_on_selects_sync_scheduler(plugin, tiny_model_dir):
    config = _engine_args(
        tiny_model_dir, additional_config=_on(5, {"user-a": 20})
    ).create_engine_config()
    sched = config.scheduler_config
    assert sched.async_scheduling is False  # the CPU platform forces it off
    assert sched.scheduler_cls == SCHEDULER_CLS
    assert config.additional_config["output_rate"] == {
        DEFAULT_KEY: 5,
        OVERRIDES_KEY: {"user-a": 20},
    }
    assert plugin.frontend_active() is True


def test_feature_on_changes_nothing_but_the_scheduler_class(plugin, tiny_model_dir):
    stock_create = type(_engine_args(tiny_model_dir)).create_engine_config.__wrapped__
    stock = stock_create(_engine_args(tiny_model_dir, additional_config=_on(5)))
    ours = _engine_args(tiny_model_dir, additional_config=_on(5)).create_engine_config()
    assert stock.scheduler_config.scheduler_cls is None
    for field in dataclasses.fields(stock.scheduler_config):
        if field.name == "scheduler_cls":
            continue
        assert getattr(ours.scheduler_config, field.name) == getattr(
            stock.scheduler_config, field.name
        ), field.name


@pytest.mark.parametrize(
    "additional_config",
    [None, {}, {"unrelated": 1}, {"output_rate": None}, {"output_rate": {}}],
    ids=["none", "empty", "unrelated-key", "section-none", "section-empty"],
)
def test_feature_off_leaves_config_stock(plugin, tiny_model_dir, additional_config):
    from vllm.engine.arg_utils import EngineArgs

    stock_create = EngineArgs.create_engine_config.__wrapped__
    assert not getattr(stock_create, "_vllm_output_rate_patch", False)
    assert getattr(EngineArgs.create_engine_config, "_vllm_output_rate_patch", False)

    kwargs = {} if additional_config is None else {"additional_config": additional_config}
    stock = stock_create(_engine_args(tiny_model_dir, **kwargs))
    patched = _engine_args(tiny_model_dir, **kwargs).create_engine_config()

    assert patched.scheduler_config.scheduler_cls is None
    assert patched.additional_config == stock.additional_config
    if not (additional_config or {}).get("output_rate", "absent") in (None, {}):
        assert "output_rate" not in patched.additional_config
    assert patched.scheduler_config == stock.scheduler_config
    assert str(patched) == str(stock)
    assert patched.compute_hash() == stock.compute_hash()
    assert plugin.frontend_active() is False


def test_feature_off_does_not_refuse_anything(plugin, tiny_model_dir):
    config = _engine_args(tiny_model_dir, scheduler_cls="some.Class").create_engine_config()
    assert config.scheduler_config.scheduler_cls == "some.Class"
    config = _engine_args(tiny_model_dir, pipeline_parallel_size=2).create_engine_config()
    assert config.parallel_config.pipeline_parallel_size == 2


P = "additional_config['output_rate']"
BAD_ADDITIONAL = [
    ("section-not-object", {"output_rate": 5}, [P, "must be an object", "int"]),
    ("section-list", {"output_rate": [5]}, [P, "must be an object", "list"]),
    ("unknown-key", {"output_rate": {DEFAULT_KEY: 5, "defualt": 1}}, [P, "unknown keys", "defualt"]),
    ("default-zero", _on(0), [f"{P}['{DEFAULT_KEY}']", "must be positive"]),
    ("default-negative", _on(-1), [f"{P}['{DEFAULT_KEY}']", "must be positive"]),
    ("default-nan", _on(float("nan")), [f"{P}['{DEFAULT_KEY}']", "NaN"]),
    ("default-inf", _on(float("inf")), [f"{P}['{DEFAULT_KEY}']", "must be finite"]),
    ("default-string", _on("fast"), [f"{P}['{DEFAULT_KEY}']", "must be a number"]),
    ("default-bool", _on(True), [f"{P}['{DEFAULT_KEY}']", "must be a number"]),
    ("overrides-list", _on(5, [1]), [f"{P}['{OVERRIDES_KEY}']", "must be a JSON object"]),
    ("overrides-empty-user", _on(5, {"": 1}), [f"{P}['{OVERRIDES_KEY}']", "non-empty"]),
    ("overrides-zero", _on(5, {"u": 0}), [f"{P}['{OVERRIDES_KEY}']['u']", "must be positive"]),
    ("overrides-inf", _on(5, {"u": float("inf")}), [f"{P}['{OVERRIDES_KEY}']['u']", "must be finite"]),
    ("recompute-budget-negative", {"output_rate": {DEFAULT_KEY: 5, "recompute_budget": -0.1}},
     [f"{P}['recompute_budget']", "non-negative number"]),
    ("recompute-budget-string", {"output_rate": {DEFAULT_KEY: 5, "recompute_budget": "lots"}},
     [f"{P}['recompute_budget']", "non-negative number"]),
    ("recompute-budget-nan", {"output_rate": {DEFAULT_KEY: 5, "recompute_budget": float("nan")}},
     [f"{P}['recompute_budget']", "non-negative number"]),
    ("input-token-weight-negative", {"output_rate": {DEFAULT_KEY: 5, "input_token_weight": -0.5}},
     [f"{P}['input_token_weight']", "non-negative finite number"]),
    ("input-token-weight-string", {"output_rate": {DEFAULT_KEY: 5, "input_token_weight": "half"}},
     [f"{P}['input_token_weight']", "must be a number"]),
    ("input-token-weight-bool", {"output_rate": {DEFAULT_KEY: 5, "input_token_weight": True}},
     [f"{P}['input_token_weight']", "must be a number"]),
    ("input-token-weight-inf", {"output_rate": {DEFAULT_KEY: 5, "input_token_weight": float("inf")}},
     [f"{P}['input_token_weight']", "non-negative finite number"]),
    (
        "overrides-without-default",
        {"output_rate": {OVERRIDES_KEY: {"u": 1}}},
        [f"{P}['{OVERRIDES_KEY}']", f"requires '{DEFAULT_KEY}'"],
    ),
]


@pytest.mark.parametrize(
    "additional_config,expected", [pytest.param(c, e, id=i) for i, c, e in BAD_ADDITIONAL]
)
def test_bad_additional_config_raises(plugin, tiny_model_dir, additional_config, expected):
    with pytest.raises(OutputRateConfigError) as info:
        _engine_args(tiny_model_dir, additional_config=additional_config).create_engine_config()
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


REFUSED_ENGINE_ARGS = [
    ("data-parallel", {"data_parallel_size": 2}, "data_parallel_size > 1 without --output-rate-store"),
    ("pipeline-parallel", {"pipeline_parallel_size": 2}, "pipeline_parallel_size > 1"),
    ("scheduler-cls", {"scheduler_cls": "some.Class"}, "custom scheduler_cls ('some.Class')"),
    (
        "kv-connector",
        {"kv_transfer_config": {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}},
        "KV connectors",
    ),
    ("kv-offloading", {"kv_offloading_size": 1.0}, "KV offloading"),
]


@pytest.mark.parametrize(
    "kwargs,mode", [pytest.param(k, m, id=i) for i, k, m in REFUSED_ENGINE_ARGS]
)
def test_unsupported_mode_is_refused_in_process(plugin, tiny_model_dir, kwargs, mode, monkeypatch):
    # From a process whose front end is off: an earlier test of the session
    # (any scheduler test with limits) may have turned it on.
    monkeypatch.setattr(plugin, "_frontend_active", False)
    with pytest.raises(OutputRateConfigError, match="does not support") as info:
        _engine_args(tiny_model_dir, additional_config=_on(5), **kwargs).create_engine_config()
    assert mode in str(info.value)
    assert plugin.frontend_active() is False


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}


def test_speculative_decoding_is_accepted(plugin, tiny_model_dir):
    # (vLLM itself allows async scheduling only with EAGLE/MTP/draft-model/
    # ngram-GPU drafting, which the CPU build cannot configure; the async
    # scheduler is driven with drafts in tests/adapter/test_spec_decode.py.)
    try:
        config = _engine_args(
            tiny_model_dir, additional_config=_on(5), speculative_config=dict(NGRAM),
        ).create_engine_config()
        assert config.speculative_config is not None
        assert config.scheduler_config.scheduler_cls == patches_module.SCHEDULER_CLS
    finally:
        patches_module._set_frontend_active(False)  # as with the feature off


def test_data_parallel_is_accepted_with_a_store():
    """The refusal looks at the store setting only; the built config of a
    data-parallel engine with a store passes every check."""
    with_store = {"output_rate": {"default_user_output_tokens_per_second": 5,
                                  "store": {"url": "redis://127.0.0.1:1/0"}}}
    config = _fake_vllm_config(**{"parallel_config.data_parallel_size": 2})
    config.additional_config = with_store
    patches_module.check_vllm_config(config)
    args = SimpleNamespace(**{name: None for name in (
        "pipeline_parallel_size", "speculative_config", "kv_transfer_config",
        "ec_transfer_config", "kv_offloading_size", "enable_lora", "scheduler_cls")})
    args.data_parallel_size = 2
    args.additional_config = with_store
    patches_module.check_engine_args(args)
    args.additional_config = {"output_rate": {"default_user_output_tokens_per_second": 5}}
    with pytest.raises(OutputRateConfigError, match="without --output-rate-store"):
        patches_module.check_engine_args(args)


def test_lora_is_left_alone_with_the_feature_off(plugin, tiny_model_dir):
    config = _engine_args(
        tiny_model_dir, enable_lora=True, max_loras=1, max_lora_rank=8
    ).create_engine_config()
    assert config.lora_config is not None and config.lora_config.max_loras == 1
    assert config.scheduler_config.scheduler_cls is None


def test_lora_runs_with_the_feature_on(plugin, tiny_model_dir):
    """No longer refused: hidden requests' adapters count against max_loras
    (policy/step.StepDecision.adapter_fits, tests/adapter/test_lora.py)."""
    config = _engine_args(
        tiny_model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, additional_config=_on(5)
    ).create_engine_config()
    assert config.lora_config is not None and config.lora_config.max_loras == 2
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    assert plugin.frontend_active() is True


def _fake_vllm_config(**changes):
    """A resolved config with every refused mode off (attribute names as vLLM's)."""

    model = SimpleNamespace(
        runner_type="generate", is_encoder_decoder=False, is_multimodal_model=False,
        is_hybrid=False, is_attention_free=False, is_diffusion=False,
    )
    config = SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(data_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=None, kv_transfer_config=None, ec_transfer_config=None,
        lora_config=None, additional_config=None,
    )
    for path, value in changes.items():
        target = config
        *parents, leaf = path.split(".")
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, leaf, value)
    return config


RESOLVED_REFUSALS = [
    ("model_config.runner_type", "pooling", "pooling models"),
    ("model_config.is_encoder_decoder", True, "encoder-decoder models"),
    ("model_config.is_hybrid", True, "hybrid (attention + state-space) models"),
    ("model_config.is_attention_free", True, "attention-free models"),
    ("model_config.is_diffusion", True, "diffusion models"),
    ("kv_transfer_config", object(), "KV connectors"),
    ("ec_transfer_config", object(), "EC connectors"),
    ("parallel_config.data_parallel_size", 2, "data_parallel_size > 1 without --output-rate-store"),
    ("parallel_config.pipeline_parallel_size", 2, "pipeline_parallel_size > 1"),
]


def test_multimodal_and_lora_configs_are_accepted():
    """No longer refused (tests/adapter/test_multimodal.py, test_lora.py)."""
    patches_module.check_vllm_config(
        _fake_vllm_config(**{"model_config.is_multimodal_model": True, "lora_config": object()})
    )


@pytest.mark.parametrize(
    "path,value,mode", [pytest.param(p, v, m, id=m) for p, v, m in RESOLVED_REFUSALS]
)
def test_resolved_config_refusals(path, value, mode):
    """The checks on the built config, one refused mode at a time (one message format)."""
    patches_module.check_vllm_config(_fake_vllm_config())  # all off: accepted
    with pytest.raises(OutputRateConfigError) as info:
        patches_module.check_vllm_config(_fake_vllm_config(**{path: value}))
    message = str(info.value)
    assert message.startswith(f"per-user output rate limiting does not support {mode}: ")
    assert "\n" not in message


def test_every_refusal_has_one_message_format_and_a_check():
    modes = [r.mode for r in patches_module.REFUSALS]
    assert len(modes) == len(set(modes))
    for refusal in patches_module.REFUSALS:
        assert refusal.on_args is not None or refusal.on_config is not None, refusal.mode
        assert str(refusal.error()) == (
            f"per-user output rate limiting does not support {refusal.mode}: {refusal.why}"
        )


# -- in-process: CLI parsing into additional_config -----------------------------------


@pytest.fixture()
def cli_parser(plugin):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def _from_cli(parser, argv):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv))


def test_flags_land_in_additional_config(cli_parser, tiny_model_dir):
    engine_args = _from_cli(
        cli_parser,
        ["--model", tiny_model_dir, "--max-model-len", "256",
         D, "7.5", O, '{"user-a": 20, "user-b": 0.5}'],
    )
    assert engine_args.additional_config == {
        "output_rate": {DEFAULT_KEY: 7.5, OVERRIDES_KEY: {"user-a": 20.0, "user-b": 0.5}}
    }
    config = engine_args.create_engine_config()
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS


def test_recompute_budget_flag_lands_in_the_section_and_the_scheduler(cli_parser, tiny_model_dir):
    from vllm_output_rate.settings import OutputRateSettings

    engine_args = _from_cli(
        cli_parser, ["--model", tiny_model_dir, D, "3", "--output-rate-recompute-budget", "0.1"]
    )
    assert engine_args.additional_config["output_rate"]["recompute_budget"] == 0.1
    settings = OutputRateSettings.from_additional_config(engine_args.additional_config)
    assert settings.recompute_budget == 0.1
    assert settings.to_config()["recompute_budget"] == 0.1
    default = OutputRateSettings.from_additional_config({"output_rate": {DEFAULT_KEY: 3}})
    assert default.recompute_budget == 0.25 and "recompute_budget" not in default.to_config()


@pytest.mark.parametrize("value", ["-0.5", "lots", "inf", "nan"])
def test_recompute_budget_flag_rejects_bad_values(cli_parser, tiny_model_dir, capsys, value):
    with pytest.raises(SystemExit):
        cli_parser.parse_args(
            ["--model", tiny_model_dir, D, "3", f"--output-rate-recompute-budget={value}"]
        )
    assert "must be a non-negative number" in capsys.readouterr().err


def test_recompute_budget_flag_needs_the_feature_on(cli_parser, tiny_model_dir):
    with pytest.raises(OutputRateConfigError, match="need the feature on"):
        _from_cli(cli_parser, ["--model", tiny_model_dir, "--output-rate-recompute-budget", "0"])


def test_input_token_weight_flag_lands_in_the_section(cli_parser, tiny_model_dir):
    from vllm_output_rate.settings import OutputRateSettings

    engine_args = _from_cli(
        cli_parser, ["--model", tiny_model_dir, D, "3", "--output-rate-input-token-weight", "0.5"]
    )
    assert engine_args.additional_config["output_rate"]["input_token_weight"] == 0.5
    settings = OutputRateSettings.from_additional_config(engine_args.additional_config)
    assert settings.input_token_weight == 0.5
    assert settings.to_config()["input_token_weight"] == 0.5
    default = OutputRateSettings.from_additional_config({"output_rate": {DEFAULT_KEY: 3}})
    assert default.input_token_weight == 0 and "input_token_weight" not in default.to_config()


@pytest.mark.parametrize(
    "value,problem",
    [("-0.5", "non-negative finite number"), ("half", "must be a number"),
     ("inf", "non-negative finite number"), ("nan", "non-negative finite number")],
)
def test_input_token_weight_flag_rejects_bad_values(cli_parser, tiny_model_dir, capsys, value, problem):
    with pytest.raises(SystemExit):
        cli_parser.parse_args(
            ["--model", tiny_model_dir, D, "3", f"--output-rate-input-token-weight={value}"]
        )
    err = capsys.readouterr().err
    assert "--output-rate-input-token-weight" in err and problem in err


def test_input_token_weight_flag_needs_the_feature_on(cli_parser, tiny_model_dir):
    with pytest.raises(OutputRateConfigError, match="--output-rate-input-token-weight needs"):
        _from_cli(cli_parser, ["--model", tiny_model_dir, "--output-rate-input-token-weight", "1"])


def test_default_flag_alone(cli_parser, tiny_model_dir):
    engine_args = _from_cli(cli_parser, ["--model", tiny_model_dir, D, "3"])
    assert engine_args.additional_config == {"output_rate": {DEFAULT_KEY: 3.0, OVERRIDES_KEY: {}}}


def test_flags_merge_with_other_additional_config(cli_parser, tiny_model_dir):
    engine_args = _from_cli(
        cli_parser, ["--model", tiny_model_dir, D, "3", "--additional-config", '{"other": 1}']
    )
    assert engine_args.additional_config == {
        "other": 1,
        "output_rate": {DEFAULT_KEY: 3.0, OVERRIDES_KEY: {}},
    }


def test_flags_and_additional_config_section_are_refused_together(cli_parser, tiny_model_dir):
    argv = [
        "--model", tiny_model_dir, D, "3",
        "--additional-config", '{"output_rate": {"%s": 2}}' % DEFAULT_KEY,
    ]
    with pytest.raises(OutputRateConfigError) as info:
        _from_cli(cli_parser, argv)
    assert D in str(info.value) and "--additional-config" in str(info.value)


def test_overrides_flag_without_default_is_refused(cli_parser, tiny_model_dir):
    with pytest.raises(OutputRateConfigError, match="requires " + D):
        _from_cli(cli_parser, ["--model", tiny_model_dir, O, '{"a": 1}'])


def test_no_flags_parse_like_stock(cli_parser, tiny_model_dir):
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    args = cli_parser.parse_args(["--model", tiny_model_dir, "--additional-config", '{"x": 1}'])
    assert args.default_user_output_tokens_per_second is None
    assert args.user_output_tokens_per_second is None
    stock_from_cli = EngineArgs.__dict__["from_cli_args"].__func__.__wrapped__
    assert AsyncEngineArgs.from_cli_args(args) == stock_from_cli(AsyncEngineArgs, args)
    assert AsyncEngineArgs.from_cli_args(args).additional_config == {"x": 1}


@pytest.mark.parametrize(
    "argv,expected",
    [
        ([D, "0"], [D, "must be positive"]),
        ([D, "nan"], [D, "NaN"]),
        ([D, "5", O, "[1]"], [O, "must be a JSON object"]),
        ([D, "5", O, '{"a": -1}'], [O, "must be positive"]),
    ],
    ids=["zero", "nan", "list", "negative-override"],
)
def test_parser_rejects_bad_values(cli_parser, tiny_model_dir, capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        cli_parser.parse_args(["--model", tiny_model_dir, *argv])
    assert info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    for part in expected:
        assert part in err, err


# -- version guard -----------------------------------------------------------------

SERIES_NAMES = [s.name for s in SERIES.values()]


def test_supported_series_are_0_32_and_0_33():
    assert SERIES_NAMES == ["0.32", "0.33"]
    assert compat.supported_text() == "0.32.x or 0.33.x"


@pytest.mark.parametrize(
    "version", ["0.31.2", "0.34.0", "0.34.1+cpu", "1.0.0", "0.3.2", "0.320.0", "garbage", "0", ""]
)
def test_unsupported_versions_raise(version):
    with pytest.raises(UnsupportedVllmVersion) as info:
        require_supported_vllm(version)
    message = str(info.value)
    assert version in message
    for name in SERIES_NAMES:
        assert f"{name}.x" in message
    assert "\n" not in message


@pytest.mark.parametrize("series", SERIES_NAMES)
@pytest.mark.parametrize("patch", [".0", ".3+cpu", ".1rc1", ".0.post1"])
def test_supported_versions_pass(series, patch):
    version = series + patch
    assert require_supported_vllm(version) == version
    assert compat.series_of(version).name == series


def test_installed_version_is_supported():
    version = compat.installed_vllm_version()
    assert version is not None
    assert require_supported_vllm() == version
    assert compat.installed_series().name in SERIES_NAMES
    assert version.startswith(compat.installed_series().name + ".")


def test_missing_vllm_raises(monkeypatch):
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: None)
    with pytest.raises(UnsupportedVllmVersion, match="not installed"):
        require_supported_vllm()


@pytest.mark.parametrize("version", ["0.31.0", "0.34.0"])
def test_register_refuses_unsupported_vllm(monkeypatch, version):
    import vllm_output_rate
    from vllm_output_rate.adapter import patches

    applied = []
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
    monkeypatch.setattr(patches, "apply_all", lambda: applied.append(True))
    with pytest.raises(UnsupportedVllmVersion, match=version):
        vllm_output_rate.register()
    assert applied == [], "patches must not be installed on an unsupported vLLM"


@pytest.fixture()
def no_real_vllm_serve(monkeypatch):
    """Guard for in-process ``cmd_serve``: never let it reach vLLM's real serve."""
    import vllm.entrypoints.cli.main as vllm_cli_main

    calls = []
    monkeypatch.setattr(vllm_cli_main, "main", lambda: calls.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)
    return calls


@pytest.mark.parametrize(
    "version,expected", [("0.31.0", "0.31.0"), ("0.34.1", "0.34.1"), (None, "not installed")]
)
def test_cmd_serve_refuses_unsupported_vllm(
    monkeypatch, capsys, tiny_model_dir, no_real_vllm_serve, version, expected
):
    from vllm_output_rate.tools import cli

    monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
    with pytest.raises(SystemExit) as info:
        cli.cmd_serve([tiny_model_dir, D, "5"])
    assert info.value.code not in (0, None)
    assert no_real_vllm_serve == []
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(ERROR_PREFIX) and expected in lines[0]


def test_cmd_serve_turns_config_error_into_one_line(monkeypatch, capsys, tiny_model_dir, no_real_vllm_serve):
    import vllm.entrypoints.cli.main as vllm_cli_main
    from vllm_output_rate.tools import cli

    def refuse():
        raise OutputRateConfigError("per-user output rate limiting does not support X: why")

    monkeypatch.setattr(vllm_cli_main, "main", refuse)
    with pytest.raises(SystemExit) as info:
        cli.cmd_serve([tiny_model_dir, D, "5"])
    assert info.value.code not in (0, None)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [ERROR_PREFIX + "per-user output rate limiting does not support X: why"]


def test_cmd_serve_passes_arguments_through(capsys, tiny_model_dir, no_real_vllm_serve):
    from vllm_output_rate.tools import cli

    argv = [tiny_model_dir, "--host", "127.0.0.1", D, "5", O, '{"a": 2}']
    cli.cmd_serve(argv)
    assert no_real_vllm_serve == [["vllm", "serve", *argv]]
    assert capsys.readouterr().err == ""


# -- a store the engines could never use ------------------------------------------

STORE_PASSWORD = "st0re-pw-7731"
WRONG_STORE_PASSWORD = "wr0ng-pw-7731"


@pytest.fixture(scope="module")
def password_store():
    from redis_harness import RedisServer

    pytest.importorskip("redis")
    srv = RedisServer(password=STORE_PASSWORD).start()
    yield srv
    srv.stop()


def test_wrong_store_password_is_refused_while_the_flags_are_merged(
    cli_parser, tiny_model_dir, password_store, monkeypatch
):
    # Parsing the flag moves its password into this variable: restored afterwards.
    monkeypatch.setenv("OUTPUT_RATE_STORE_PASSWORD", "")
    url = f"redis://:{WRONG_STORE_PASSWORD}@127.0.0.1:{password_store.port}/0"
    with pytest.raises(OutputRateConfigError) as caught:
        _from_cli(cli_parser, ["--model", tiny_model_dir, D, "5", "--output-rate-store", url])
    message = str(caught.value)
    assert message.startswith("--output-rate-store redis://127.0.0.1:"), message
    assert "refused the password" in message and WRONG_STORE_PASSWORD not in message


@pytest.mark.server
def test_wrong_store_password_is_refused_by_serve(tiny_model_dir, password_store):
    """A real ``serve``: exits non-zero with one error line naming the flag, no engine left."""
    url = f"redis://:{WRONG_STORE_PASSWORD}@127.0.0.1:{password_store.port}/0"
    proc, start = _start_cli([
        "serve", tiny_model_dir,
        "--host", "127.0.0.1", "--port", str(free_port()),
        "--max-model-len", "256", "--enforce-eager",
        D, "5", "--output-rate-store", url,
    ])
    proc, elapsed = _finish_cli(proc, start, timeout=REFUSAL_TIMEOUT_S)
    print(f"wrong store password refused after {elapsed:.1f}s")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert WRONG_STORE_PASSWORD not in output
    lines = _stderr_lines(proc)
    assert lines and lines[-1].startswith(ERROR_PREFIX + "--output-rate-store redis://127.0.0.1:"), (
        proc.stderr[-3000:]
    )
    assert "refused the password" in lines[-1]
    assert sum(ERROR_PREFIX in line for line in lines) == 1, proc.stderr


def test_wrong_store_password_is_refused_before_vllm_loads(
    tiny_model_dir, password_store, vllm_tripwire, tmp_path
):
    """``vllm-output-rate serve`` checks the store before importing vLLM, so the
    refusal does not wait for vLLM to load."""
    imported = tmp_path / "vllm-imported"
    env = {**vllm_tripwire, VLLM_IMPORTED_ENV: str(imported), "OUTPUT_RATE_STORE_PASSWORD": ""}
    url = f"redis://:{WRONG_STORE_PASSWORD}@127.0.0.1:{password_store.port}/0"
    proc = run_cli(
        ["serve", tiny_model_dir, "--host", "127.0.0.1", D, "5", "--output_rate_store", url],
        timeout=60,
        env=env,
    )
    assert not imported.exists(), "vLLM was imported before the store was refused"
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(
        ERROR_PREFIX + f"--output-rate-store redis://127.0.0.1:{password_store.port}/0: "
    ), lines[0]
    assert "refused the password" in proc.stderr and WRONG_STORE_PASSWORD not in proc.stderr
