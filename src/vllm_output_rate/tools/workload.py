"""The GPU twin's workload, seeded and scalable: users, their limits and what they send.

Plain Python (no vLLM, no third-party import), so the benchmark harness's
GPU twin and ``vllm-output-rate bench --scenario twin`` (a real server) can
drive the very same users.  :func:`build_twin_workload` returns a
:class:`TwinWorkload`; R below is ``concurrency`` (the running requests the
engine is sized for):

* four **hard-capped heavy users** ``cap-0`` .. ``cap-3`` at 0.25 R, 0.5 R,
  R and 2 R tok/s, each with R/8 closed-loop streams;
* six **borrowers** guaranteed 0.05 R tok/s: ``borrow-0`` .. ``borrow-3``
  of weight 1 without a ceiling (R/4 streams each: together they can fill
  every slot the caps leave), ``borrow-w2`` of weight 2 with a ceiling of
  4 R and ``borrow-w3`` of weight 3 with a ceiling of 6 R (R/8 streams each);
* a **group** ``research`` capped at 0.5 R whose two members ``grp-0`` and
  ``grp-1`` have 0.4 R each (R/16 streams each);
* the **long tail**: every other configured user (``u00000`` ...) capped at
  50 tok/s, sending open-loop requests (Poisson arrivals, about
  ``light_share`` of the engine's decode capacity in output tokens) spread
  over users by a Pareto(1.2) weight, so a few send many and most send none
  or one;
* prompt tokens cost ``0.01`` of an output token (``input_token_weight``).

Closed-loop streams send a fixed, seeded sequence of jobs, each when the
previous one finished; open-loop requests are sent at fixed times whatever
happens.  Lengths (heavy: 128-256 prompt and 64-512 output tokens; light:
256-768 and 32-256; the KV-pressure variant's heavy ones 384-512 and
1,000-1,500) are multiplied by ``length_scale`` so the workload fits a small
engine too.

With ``length_scale`` 1 the random draws are made in the order
``benchmarks/gpu_twin.py`` made them when this module was written, so a
seed gives the twin's own workload there.
"""

from __future__ import annotations

import bisect
import json
import random
from dataclasses import dataclass, field

#: Every long-tail user's cap (tok/s); also the default for unknown users.
LIGHT_RATE = 50.0
#: Quota cost of one computed prompt token.
INPUT_TOKEN_WEIGHT = 0.01
#: Hard caps as fractions of R.
CAP_FACTORS = (0.25, 0.5, 1.0, 2.0)
#: Borrowers: name -> weight; all guaranteed BORROWER_FACTOR x R.
BORROWER_WEIGHTS = {"borrow-0": 1, "borrow-1": 1, "borrow-2": 1, "borrow-3": 1, "borrow-w2": 2, "borrow-w3": 3}
BORROWER_FACTOR = 0.05
#: Borrowers with a ceiling: name -> ceiling as a multiple of R (the others have none).
CEILING_FACTORS = {"borrow-w2": 4, "borrow-w3": 6}
GROUP = "research"
GROUP_FACTOR = 0.5
GROUP_MEMBER_FACTOR = 0.4
GROUP_MEMBERS = ("grp-0", "grp-1")
#: A decode step of 20 ms: the engine's output capacity assumed when none is given.
DEFAULT_STEP_S = 0.020
#: Token lengths (lo, hi) before ``length_scale``.
HEAVY_PROMPT, HEAVY_OUTPUT = (128, 256), (64, 512)
PRESSURE_PROMPT, PRESSURE_OUTPUT = (384, 512), (1000, 1500)
LIGHT_PROMPT, LIGHT_OUTPUT = (256, 768), (32, 256)
PARETO_ALPHA = 1.2


@dataclass(frozen=True)
class Job:
    """One request of a closed-loop stream."""

    prompt_len: int
    max_tokens: int
    think_s: float = 0.0  # the pause before this request is sent


@dataclass
class TwinWorkload:
    """What :func:`build_twin_workload` returns (the first seven fields in the
    order of the harness's ``Workload``)."""

    #: The limits file's content (``--output-rate-limits-file``).
    limits: dict
    #: Open-loop requests: (send time s, user, prompt tokens, max output tokens), by time.
    arrivals: list[tuple[float, str, int, int]] = field(default_factory=list)
    #: Closed-loop users: user -> streams, each a sequence of jobs sent one after another.
    streams: dict[str, list[list[Job]]] = field(default_factory=dict)
    #: Hard-capped users: user -> tok/s.
    capped: dict[str, float] = field(default_factory=dict)
    #: Borrowers: user -> weight.
    borrowers: dict[str, float] = field(default_factory=dict)
    #: Users whose first-token times are reported (the long tail that sent something).
    in_quota: set[str] = field(default_factory=set)
    input_token_weight: float = INPUT_TOKEN_WEIGHT
    #: group -> (its rate, its members).
    groups: dict[str, tuple[float, tuple[str, ...]]] = field(default_factory=dict)
    concurrency: int = 0
    seed: int = 0

    @property
    def users(self) -> list[str]:
        """Every configured user (the limits file's entries)."""
        return list(self.limits["user_output_tokens_per_second"])

    @property
    def stream_count(self) -> int:
        return sum(len(s) for s in self.streams.values())

    def limits_text(self) -> str:
        """The limits file, as JSON (YAML readers take it too); the burst is
        not a limits-file key (startup only): :meth:`serve_args` carries it."""
        limits = {k: v for k, v in self.limits.items() if k != "burst_seconds"}
        return json.dumps(limits, indent=1) + "\n"

    def serve_args(self, limits_path: str) -> list[str]:
        """How the engine is started for this workload: the limits file, the
        burst when the workload sets one, and resident slots beyond the active
        ones (throttled streams keep their KV without taking a running place),
        as the README sizes it."""
        r = self.concurrency
        burst = self.limits.get("burst_seconds")
        flags = [] if burst is None else ["--output-rate-burst-seconds", f"{burst:g}"]
        return ["--output-rate-limits-file", limits_path, *flags, "--max-num-seqs", str(2 * r),
                "--max-num-active-seqs", str(r)]


def _lengths(rng: random.Random, bounds: tuple[int, int], scale: float) -> int:
    lo, hi = bounds
    if scale == 1.0:
        return rng.randint(lo, hi)
    return rng.randint(max(1, round(lo * scale)), max(1, round(hi * scale)))


def build_twin_workload(concurrency: int, *, users: int = 10_000, idle_users: int = 0, duration_s: float = 60.0,
                        seed: int = 0, capacity_tok_s: float | None = None, light_share: float = 0.10,
                        length_scale: float = 1.0, kv_pressure: bool = False,
                        never_hit: bool = False, burst_s: float | None = None) -> TwinWorkload:
    """The twin's workload for an engine of ``concurrency`` running requests.

    ``users``: configured users in all (the twelve named ones and the long
    tail); ``idle_users``: more configured users who send nothing;
    ``capacity_tok_s``: the engine's decode capacity, which sets the
    long tail's arrival rate (default: ``concurrency`` requests every 20 ms);
    ``never_hit``: the same users and load with every limit at 1e9;
    ``burst_s``: the quotas' ``burst_seconds`` (None: the default), which
    should cover the engine's longest step.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if not length_scale > 0 or not duration_s > 0 or not 0 <= light_share:
        raise ValueError("length_scale and duration_s must be positive, light_share not negative")
    rng = random.Random(seed)
    r = concurrency
    cap_users = {f"cap-{i}": r * f for i, f in enumerate(CAP_FACTORS)}
    group_users = {u: GROUP_MEMBER_FACTOR * r for u in GROUP_MEMBERS}
    entries: dict = dict(cap_users)
    for user, weight in BORROWER_WEIGHTS.items():
        ceiling = CEILING_FACTORS.get(user)
        entries[user] = {"rate": BORROWER_FACTOR * r, "ceil": None if ceiling is None else ceiling * r,
                         "weight": weight}
    for user, rate in group_users.items():
        entries[user] = {"rate": rate, "group": GROUP}
    n_light = users - len(entries)
    if n_light < 1:
        raise ValueError(f"users must be more than the {len(entries)} named ones, got {users}")
    light = [f"u{i:05d}" for i in range(n_light)]
    for user in light:
        entries[user] = LIGHT_RATE
    for i in range(idle_users):
        entries[f"idle{i:06d}"] = LIGHT_RATE
    group_rate = GROUP_FACTOR * r
    limits = {
        "default_user_output_tokens_per_second": LIGHT_RATE,
        "user_output_tokens_per_second": entries,
        "groups": {GROUP: {"rate": group_rate}},
        "input_token_weight": INPUT_TOKEN_WEIGHT,
    }
    if never_hit:
        limits = {
            "default_user_output_tokens_per_second": 1e9,
            "user_output_tokens_per_second": {
                u: ({"rate": 1e9, "group": GROUP} if u in group_users else 1e9) for u in entries
            },
            "groups": {GROUP: {"rate": 1e9}},
            "input_token_weight": INPUT_TOKEN_WEIGHT,
        }
    if burst_s is not None:
        limits["burst_seconds"] = burst_s

    def heavy_job() -> Job:
        if kv_pressure:
            return Job(_lengths(rng, PRESSURE_PROMPT, length_scale), _lengths(rng, PRESSURE_OUTPUT, length_scale))
        return Job(_lengths(rng, HEAVY_PROMPT, length_scale), _lengths(rng, HEAVY_OUTPUT, length_scale))

    jobs_per_stream = max(4, int(duration_s * 30 / 64) + 2)
    streams: dict[str, list[list[Job]]] = {}
    for user in list(cap_users) + list(BORROWER_WEIGHTS):
        n = r // 4 if BORROWER_WEIGHTS.get(user) == 1 else r // 8
        streams[user] = [[heavy_job() for _ in range(jobs_per_stream)] for _ in range(max(1, n))]
    for user in group_users:
        streams[user] = [[heavy_job() for _ in range(jobs_per_stream)] for _ in range(max(1, r // 16))]
    capacity = capacity_tok_s if capacity_tok_s is not None else r / DEFAULT_STEP_S
    mean_out = sum(LIGHT_OUTPUT) / 2 * length_scale
    rate = light_share * capacity / mean_out
    cum, total = [], 0.0
    for _ in light:
        total += rng.paretovariate(PARETO_ALPHA)
        cum.append(total)
    arrivals = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        user = light[bisect.bisect_left(cum, rng.random() * total)]
        arrivals.append((t, user, _lengths(rng, LIGHT_PROMPT, length_scale), _lengths(rng, LIGHT_OUTPUT, length_scale)))
    return TwinWorkload(
        limits, arrivals, streams, capped={} if never_hit else dict(cap_users),
        borrowers=dict(BORROWER_WEIGHTS), in_quota={u for _, u, _, _ in arrivals},
        input_token_weight=INPUT_TOKEN_WEIGHT, groups={GROUP: (1e9 if never_hit else group_rate, GROUP_MEMBERS)},
        concurrency=r, seed=seed,
    )
