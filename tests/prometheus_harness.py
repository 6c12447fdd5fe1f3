"""A real Prometheus (and promtool) for tests: the shipped rules and dashboard, checked.

Prometheus runs as a child of the test process on 127.0.0.1 (a free port),
with its storage in a temporary folder, scraping the given targets and
evaluating the given rule files every second; it is stopped by its PID.  A
test is skipped when no binary is installed (``make setup`` installs
Debian's ``prometheus`` package, which brings ``promtool``), as the Redis
tests are without ``redis-server``.

:func:`dashboard_queries` lists every PromQL expression of the Grafana
dashboard (panel targets and template-variable queries) with Grafana's
variables replaced, for the parse check and the server test.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import httpx
import pytest
import yaml

from vllm_output_rate.tools.serverproc import free_port

REPO = Path(__file__).resolve().parents[1]
DASHBOARDS = REPO / "dashboards"
DASHBOARD = DASHBOARDS / "vllm-output-rate.json"
RULES = DASHBOARDS / "vllm-output-rate.rules.yml"
RULE_TESTS = DASHBOARDS / "tests" / "rules_test.yml"

#: What Grafana puts in place of a variable set to "All" (a regex matcher).
ALL_VALUES = {"model": ".*", "user": ".*"}


def promtool_binary() -> str | None:
    return shutil.which("promtool")


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``promtool ARGS`` (the test is skipped without the binary)."""
    binary = promtool_binary()
    if binary is None:
        pytest.skip("no promtool binary (make setup installs Debian's prometheus package)")
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@dataclass(frozen=True)
class DashboardQuery:
    """One expression of the dashboard: where it is, and the PromQL sent."""

    where: str  # "panel 7 'Borrowed tokens/s per user' A" or "variable user"
    expr: str


_LABEL_VALUES = re.compile(r"^label_values\((?P<metric>.+),\s*(?P<label>\w+)\)$", re.S)


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with Grafana's ``$name`` / ``${name}`` variables replaced by ``values``."""
    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"dashboard variable ${name} has no test value")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)


def dashboard_queries(path: Path = DASHBOARD, values: Mapping[str, str] = ALL_VALUES) -> list[DashboardQuery]:
    """Every panel target's ``expr`` and every ``label_values(METRIC, LABEL)``
    variable query (as ``count by (LABEL) (METRIC)``: the same series answer it)."""
    board = json.loads(Path(path).read_text())
    queries: list[DashboardQuery] = []
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        match = _LABEL_VALUES.match(variable["query"].strip())
        assert match, f"variable {variable['name']}: only label_values(...) queries are checked"
        metric = substitute(match["metric"], values)
        queries.append(DashboardQuery(f"variable {variable['name']}", f"count by ({match['label']}) ({metric})"))
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            where = f"panel {panel['id']} {panel['title']!r} {target['refId']}"
            queries.append(DashboardQuery(where, substitute(target["expr"], values)))
    return queries


class PrometheusServer:
    """One ``prometheus`` child process scraping ``targets`` (``host:port``)."""

    def __init__(
        self,
        work_dir: Path,
        targets: Sequence[str],
        rule_files: Sequence[Path] = (RULES,),
        interval: str = "1s",
    ) -> None:
        binary = prometheus_binary()
        if binary is None:
            pytest.skip("no prometheus binary (make setup installs Debian's prometheus package)")
        self.binary = binary
        self.work_dir = Path(work_dir)
        self.port = free_port()
        self.targets = list(targets)
        self.rule_files = [Path(path).resolve() for path in rule_files]
        self.interval = interval
        self.proc: subprocess.Popen | None = None
        self.log_path = self.work_dir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        config = {
            "global": {"scrape_interval": self.interval, "scrape_timeout": self.interval,
                       "evaluation_interval": self.interval},
            "rule_files": [str(path) for path in self.rule_files],
            "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": self.targets}]}],
        }
        path = self.work_dir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self, timeout_s: float = 60.0) -> "PrometheusServer":
        """Start Prometheus and wait until it says it is ready."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            f"--config.file={self._write_config()}",
            f"--storage.tsdb.path={self.work_dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.work_dir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus did not become ready:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM by PID (Prometheus shuts down cleanly), then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def api(self, path: str, **params: Any) -> Any:
        """``GET /api/v1/PATH``'s ``data``; a PromQL error raises with Prometheus' message."""
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30, trust_env=False)
        body = response.json()
        if body.get("status") != "success":
            raise PromQLError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` evaluates to now (``[{"metric": ..., "value": [t, "v"]}]``)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def firing(self, alertname: str) -> list[dict]:
        """The alerts named ``alertname`` in state firing (``/api/v1/alerts``)."""
        return [alert for alert in self.api("alerts")["alerts"]
                if alert["labels"].get("alertname") == alertname and alert["state"] == "firing"]

    def rules(self) -> list[dict]:
        """Every loaded rule, with its ``health`` and ``lastError``."""
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

    def wait_for(self, what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        """Poll ``check()`` once a second until it returns something true."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
            time.sleep(1.0)

    def __enter__(self) -> "PrometheusServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PromQLError(RuntimeError):
    """Prometheus refused a query (a parse or evaluation error)."""
