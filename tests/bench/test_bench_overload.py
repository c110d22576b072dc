"""`kvserve bench overload`: it floods a full server and reports the rejections (behaviour, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def test_bench_overload_refuses_the_whole_flood_and_reports_latencies() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvserve", "bench", "overload", "--flood", "24", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["flood"] == result["rejected"] == 24 and result["queued_after"] == 8
    assert 0 < result["median_ms"] <= result["p99_ms"] <= result["max_ms"]
