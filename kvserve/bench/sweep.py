"""`bench serve --sweep FLAG=V1,V2,...`: the same workload on a fresh server per value of one `kvserve serve` flag.

Each value gets its own server, started as `--start-server` starts one, with `--FLAG V` after
every `--server-arg`, so two values never share a process, a cache or the CPU. The runs give one
point per value and workload: output tokens/s, TTFT p50 and p99, ITL p99, the KV partial-block
waste at that server's own block size, and peak running sequences. `render_sweep_table` prints
them; `plot.plot_sweep` draws them against the value.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.bench.load_driver import RunResult
from kvserve.bench.report import BenchReport, format_ms, headline, run_waste

LAUNCHER_FLAGS = ("host", "port", "http-port")
"""Set by the launcher for every started server: sweeping them would fight it."""


@dataclass(frozen=True, slots=True)
class SweepSpec:
    """One `kvserve serve` flag (without its dashes) and the values to run it at, in order."""

    flag: str
    values: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> SweepSpec:
        """`FLAG=V1,V2,...` (`--FLAG=...` also works); ValueError on anything else."""
        name, sep, listed = spec.partition("=")
        flag = name.strip().removeprefix("--")
        values = tuple(v.strip() for v in listed.split(","))
        if not sep or not flag or not all(values):
            raise ValueError(f"--sweep wants FLAG=V1,V2,... (e.g. block-size=8,16,32), got {spec!r}")
        if flag in LAUNCHER_FLAGS:
            raise ValueError(f"--sweep {flag}: the launcher sets --{flag} for every server it starts")
        if len(set(values)) != len(values):
            raise ValueError(f"--sweep {flag}: a value is listed twice in {listed!r}")
        return cls(flag, values)

    def configuration(self, value: str) -> str:
        """The name of the run at `value` in the report."""
        return f"kvserve {self.flag}={value}"

    def server_args(self, value: str) -> list[str]:
        return [f"--{self.flag}", value]

    def variants(self) -> list[tuple[str, list[str]]]:
        """(configuration, extra server arguments) for each value, in order."""
        return [(self.configuration(v), self.server_args(v)) for v in self.values]

    def check(self) -> None:
        """ValueError (argparse's own message) unless `kvserve serve` takes `--FLAG V` for every value,
        so a typo fails before the first server starts rather than after a run."""
        from kvserve.cli import build_parser

        parser = build_parser()
        for value in self.values:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    parser.parse_args(["serve", *self.server_args(value)])
                except SystemExit:
                    lines = err.getvalue().strip().splitlines()
                    raise ValueError(lines[-1] if lines else f"kvserve serve rejects --{self.flag} {value}") from None


def sweep_points(spec: SweepSpec, report: BenchReport, runs: Sequence[RunResult]) -> dict[str, Any]:
    """`report.sweep`: the flag, its values and one point per value and workload, in run order."""
    points = []
    for value in spec.values:
        for run in (r for r in runs if r.configuration == spec.configuration(value)):
            summary = report.find(run.configuration, run.workload)
            if summary is None:
                continue
            waste = run_waste(run, 0) if run.block_size > 0 else None
            points.append(
                {
                    "value": value,
                    **headline(summary),
                    "block_size": run.block_size or None,
                    "kv_waste_pct": waste.waste_pct if waste is not None and waste.num_sequences else None,
                }
            )
    return {"flag": spec.flag, "values": list(spec.values), "points": points}


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def render_sweep_table(sweep: dict[str, Any]) -> str:
    """One row per value and workload; latencies in ms."""
    flag = f"--{sweep['flag']}"
    width = max(len(flag), *(len(p["value"]) for p in sweep["points"])) if sweep["points"] else len(flag)
    header = (
        f"{flag:<{width}} {'workload':<16} {'block':>5} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p99':>8} {'KV waste %':>10} {'peak':>5} {'preempt':>7} {'fail':>4}"
    )
    lines = [f"sweep over {flag}, latencies in ms", header, "-" * len(header)]
    for p in sweep["points"]:
        lines.append(
            f"{p['value']:<{width}} {p['workload']:<16} {p['block_size'] or '-':>5} "
            f"{_fmt(p['output_throughput'], 1):>10} {format_ms(p, 'ttft_p50'):>9} {format_ms(p, 'ttft_p99'):>9} "
            f"{format_ms(p, 'itl_p99'):>8} {_fmt(p['kv_waste_pct'], 2):>10} {p['peak_running']:>5} "
            f"{p['preemptions']:>7} {p['num_failed']:>4}"
        )
    return "\n".join(lines)
