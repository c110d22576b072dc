"""The suite's time against its budget: `--time-budget-s` stops a run that passes it, naming the slowest tests.

CI cuts a run off at 90 minutes with no report at all. Past its budget (`.ci/run` gives 60
minutes: twice the 30-minute goal, and half an hour short of the cut-off) a run stops after
the test in progress, fails, and names the ten tests that took the most time, so the report
says where the time went instead of nothing. Every run with a budget ends with one line of its
time against the budget and the goal.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

SLOWEST_NAMED = 10
GOAL_S = 30 * 60
"""The suite's goal, set-up included (README, CONTRIBUTING): what the closing line measures a run against."""


class TimeBudget:
    """Per-test times (set-up, call and teardown together) and the run's elapsed time."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.started = time.monotonic()
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def slowest(self, count: int = SLOWEST_NAMED) -> list[tuple[str, float]]:
        return sorted(self.seconds.items(), key=lambda item: item[1], reverse=True)[:count]

    def describe_slowest(self) -> str:
        return "\n".join(f"  {seconds:7.1f} s  {nodeid}" for nodeid, seconds in self.slowest())

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        if self.elapsed() > self.budget_s:
            pytest.exit(
                f"the suite passed its time budget ({self.elapsed():.0f} s > {self.budget_s:.0f} s) after {nodeid}; "
                f"its {SLOWEST_NAMED} slowest tests:\n{self.describe_slowest()}",
                returncode=pytest.ExitCode.TESTS_FAILED,
            )

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter) -> None:
        elapsed = self.elapsed()
        terminalreporter.write_line(
            f"time budget: tests took {elapsed:.0f} s, {elapsed / self.budget_s:.0%} of the {self.budget_s:.0f} s "
            f"budget (the whole run's goal, set-up included, is {GOAL_S} s)"
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--time-budget-s",
        type=float,
        default=None,
        help="stop and fail the run once it has taken this many seconds, naming its slowest tests",
    )


def pytest_configure(config: pytest.Config) -> None:
    budget_s = config.getoption("--time-budget-s")
    if budget_s is not None and not hasattr(config, "workerinput"):  # pytest-xdist: the controller keeps time
        config.pluginmanager.register(TimeBudget(budget_s), "kvserve-time-budget")
