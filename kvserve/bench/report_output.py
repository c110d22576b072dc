"""Where a `bench serve` or `bench baseline-hf` report goes: the table, `--json`, `--plot`."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TextIO

from kvserve.bench.report import BenchReport, render_table
from kvserve.bench.sweep import render_sweep_table
from kvserve.config.flags import flag


@dataclass(frozen=True, slots=True)
class ReportOutput:
    """The output flags both serving benchmarks share."""

    JSON_HELP: ClassVar[str] = "write the JSON report to PATH (no PATH or '-': stdout)"

    json: str | None = field(default=None, metadata=flag(JSON_HELP, nargs="?", const="-", metavar="PATH"))
    plot: str | None = field(default=None, metadata=flag("write a PNG of latencies and throughput", metavar="PATH"))


def write_outputs(report: BenchReport, output: ReportOutput, *, stream: TextIO) -> int:
    """Table (stderr when the JSON goes to stdout), JSON, plot; a sweep's own table and plot.
    Exit status 1 when any request failed."""
    table_stream = sys.stderr if output.json == "-" else stream
    print(render_table(report) if report.sweep is None else render_sweep_table(report.sweep), file=table_stream)
    if output.json == "-":
        print(report.to_json(), file=stream)
    elif output.json:
        Path(output.json).write_text(report.to_json() + "\n")
        print(f"json: {output.json}", file=table_stream)
    if output.plot:
        from kvserve.bench.plot import plot_results, plot_sweep

        print(f"plot: {output.plot}", file=table_stream)
        if report.sweep is None:
            plot_results(report.results, output.plot)
        else:
            plot_sweep(report.sweep, output.plot)
    return 1 if any(r["num_failed"] for r in report.results) else 0
