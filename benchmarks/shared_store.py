"""Cost of the shared (Redis lease) store: per-call limiter cost and round trips.

1. Limiter calls as the scheduler makes them (``take_up_to`` + ``refund`` +
   ``available`` per user per step), in-memory limiter vs lease limiter
   spending local leases (no network inside a call): ns per step of 16 users,
   median of repeats, alternating.
2. Round trips: one lease limiter (its real background thread) against a real
   redis-server (started here, 127.0.0.1, random port, stopped by PID) with
   100 users all wanting quota all the time for ``--seconds``: script calls
   per second and Redis commands per second (from ``INFO commandstats``).

3. With ``--cluster``: the same round-trip measurement against a real
   three-node Redis Cluster (``benchkit.RedisClusterProcess``, stopped by PID): script calls per second summed over the nodes
   (one per node a user of the batch lives on, per round trip).

Prints a table and writes ``docs/benchmarks/shared_store.json`` (``--out PREFIX``
elsewhere).  Usage::

    python benchmarks/shared_store.py [--cluster]
"""

from __future__ import annotations

import argparse
import statistics
import time

from vllm_output_rate.policy.limiter import OutputRateLimiter
from vllm_output_rate.stores.backend import LeaseGrant
from vllm_output_rate.stores.lease import LeasedOutputRateLimiter
from vllm_output_rate.tools.redisproc import RedisProcess
from vllm_output_rate_harness import benchkit

SCHEMA = "vllm-output-rate-shared-store/1"

USERS = [f"user-{i}" for i in range(16)]


class Plenty:
    """A store that grants everything asked (to measure the local path only)."""

    def lease(self, burst_ns, asks, engine=""):
        return [LeaseGrant(a.want, 0) for a in asks]

    def publish_fingerprint(self, engine_id, fingerprint):
        return {}

    def describe(self):
        return "plenty"

    def close(self):
        pass


def step_cost(limiter, clock, refill, steps: int = 2000) -> float:
    """ns per step of limiter calls; ``refill`` (the lease thread's work) is not timed."""
    perf = time.perf_counter_ns
    spent = 0
    for _ in range(steps):
        clock[0] += 1_000_000
        now = clock[0]
        refill(now)
        t = perf()
        for user in USERS:
            got = limiter.take_up_to(user, now, 4)
            if got:
                limiter.refund(user, now, 1)
            limiter.available(user, now)
        spent += perf() - t
    return spent / steps


def bench_calls(rounds: int) -> dict:
    # Rates high enough that nobody is ever refused: the common case.
    mem_clock = [10**15]
    mem = OutputRateLimiter(10**6)
    lease_clock = [10**15]
    leased = LeasedOutputRateLimiter(
        10**6, {}, Plenty(), clock=lambda: lease_clock[0], start=False
    )

    def refill(now):  # the lease thread's job, every 50 ms of the fake clock
        if now % 50_000_000 < 1_000_000:
            leased.rounds.run(now)

    for user in USERS:
        leased.want(user, lease_clock[0])
    leased.rounds.run(lease_clock[0], only_new=True)
    mem_ns, lease_ns = [], []
    for _ in range(rounds):
        mem_ns.append(step_cost(mem, mem_clock, lambda now: None))
        lease_ns.append(step_cost(leased, lease_clock, refill))
    return {
        "users_per_step": len(USERS),
        "in_memory_ns_per_step": statistics.median(mem_ns),
        "lease_ns_per_step": statistics.median(lease_ns),
    }


def bench_round_trips(seconds: float, n_users: int, cluster: bool = False) -> dict:
    from vllm_output_rate.stores.redis_store import RedisLeaseBackend

    if cluster:
        srv = benchkit.RedisClusterProcess().start()
        clients = [srv.node(i) for i in range(len(srv.ports))]
    else:
        srv = RedisProcess().start()
        clients = [srv.client()]
    try:
        backend = RedisLeaseBackend(srv.url, prefix="bench")
        lim = LeasedOutputRateLimiter(50, {}, backend)
        for client in clients:
            client.config_resetstat()
        users = [f"u{i}" for i in range(n_users)]
        end = time.monotonic() + seconds
        taken = 0
        while time.monotonic() < end:
            now = time.monotonic_ns()
            for user in users:
                taken += lim.take_up_to(user, now, 2)
            time.sleep(0.005)
        stats = dict(lim.stats)
        lim.close()
        # Commands sent by the engine (script calls, pings, cluster probes) vs
        # the per-user commands the script runs inside Redis.
        sent = ("evalsha", "eval", "script|load", "script", "ping", "cluster|info", "cluster|slots",
                "cluster|shards", "cluster|nodes", "command", "command|docs", "command|info")
        client_calls = total_calls = 0
        for client in clients:
            commands = client.info("commandstats")
            client_calls += sum(
                v["calls"] for k, v in commands.items() if k.removeprefix("cmdstat_") in sent
            )
            total_calls += sum(
                v["calls"] for k, v in commands.items()
                if k not in ("cmdstat_config|resetstat", "cmdstat_info")
            )
    finally:
        srv.stop()
    return {
        "store": "redis cluster, 3 primaries" if cluster else "single redis",
        "users": n_users,
        "seconds": seconds,
        "round_trips_per_s": stats["round_trips"] / seconds,
        "engine_commands_per_s": client_calls / seconds,
        "redis_commands_incl_script_inner_per_s": total_calls / seconds,
        "tokens_per_s": taken / seconds,
        "expected_tokens_per_s": 50 * n_users,
        "lease_stats": stats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(benchkit.RESULTS_DIR / "shared_store"), metavar="PREFIX",
                    help="writes PREFIX.json (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--users", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cluster", action="store_true",
                    help="also measure round trips against a real 3-node Redis Cluster")
    args = ap.parse_args()
    report = benchkit.start_report(SCHEMA, args)
    calls = report["calls"] = bench_calls(args.rounds)
    trips = report["round_trips"] = bench_round_trips(args.seconds, args.users)
    if args.cluster:
        report["cluster_round_trips"] = bench_round_trips(args.seconds, args.users, cluster=True)
    benchkit.write_outputs(benchkit.finish_report(report), args.out)
    ratio = calls["lease_ns_per_step"] / calls["in_memory_ns_per_step"]
    print(f"limiter calls for {calls['users_per_step']} users per step: in-memory "
          f"{calls['in_memory_ns_per_step'] / 1000:.1f} us, lease {calls['lease_ns_per_step'] / 1000:.1f} us "
          f"(x{ratio:.2f}; no network inside a call)")
    print(f"{trips['users']} active users, {trips['seconds']:.0f} s, one engine: "
          f"{trips['round_trips_per_s']:.1f} round trips/s, {trips['engine_commands_per_s']:.1f} "
          f"commands/s sent (issue's ceiling {trips['users'] * 20}; inside Redis incl. the "
          f"script's per-user commands {trips['redis_commands_incl_script_inner_per_s']:.0f}/s); "
          f"{trips['tokens_per_s']:.0f} of {trips['expected_tokens_per_s']} tok/s spent")
    if args.cluster:
        c = report["cluster_round_trips"]
        print(f"{c['users']} active users, {c['seconds']:.0f} s, one engine, {c['store']}: "
              f"{c['round_trips_per_s']:.1f} round trips/s, {c['engine_commands_per_s']:.1f} "
              f"commands/s sent over all nodes (issue's ceiling {c['users'] * 20}); "
              f"{c['tokens_per_s']:.0f} of {c['expected_tokens_per_s']} tok/s spent")


if __name__ == "__main__":
    main()
