"""`kvserve bench speculative` end to end, on fake-executor servers whose model copies its input.

The fake executor runs kvserve's real scheduler, proposers and verification bookkeeping; only
the model is fake (`--copy-period`, so lookup drafts are accepted). The run must measure off
and each method at each concurrency on the same requests, read the draft counters, and find
every greedy reply equal to off's; a target server is driven on the same requests.
"""

from __future__ import annotations

import pytest

from kvserve.bench.speculative import SpeculativeBenchConfig, render, run_speculative_bench
from kvserve.testing.server_launcher import serving
from tests.http.http_clients import FAKE_ARGS

pytestmark = pytest.mark.timeout(600)

COPYING = "--copy-period 6 --step-latency-ms 2"


def test_methods_against_off_at_each_concurrency_with_the_same_text() -> None:
    with serving([*FAKE_ARGS, "--copy-period", "6"], http=True, name="target") as target:
        config = SpeculativeBenchConfig(
            methods=("ngram", "suffix"),
            workloads=("copy", "mixed"),
            concurrency=(1, 2),
            num_requests=2,
            max_tokens_cap=24,
            executor="fake",
            serve_args=COPYING,
            targets=(f"other={target.http_url}",),
            progress=False,
        )
        report = run_speculative_bench(config, progress=lambda _line: None)
    results = report["results"]
    keys = [(r["concurrency"], r["configuration"], r["workload"]) for r in results]
    assert keys == [
        (c, name, w)
        for c in (1, 2)
        for name in ("kvserve off", "kvserve ngram", "kvserve suffix", "other")
        for w in ("copy", "mixed")
    ]
    for r in results:
        assert r["num_failed"] == 0, r["errors"]
        assert r["num_requests"] == max(2, 2 * r["concurrency"])
        same_requests = [o for o in results if (o["concurrency"], o["workload"]) == (r["concurrency"], r["workload"])]
        assert {o["total_output_tokens"] for o in same_requests} == {r["total_output_tokens"]}
        if r["configuration"] == "other":
            assert "drafts" not in r  # not a kvserve server's counters
        elif r["configuration"] == "kvserve off":
            assert r["vs_off"] == 1.0 and r["drafts"]["draft_tokens_proposed"] == 0
        else:
            assert r["same_text_as_off"], r["different_sessions"]
            assert r["acceptance"] > 0.5 and r["tokens_per_verify_step"] > 1.5
    table = render(report)
    assert "workload copy" in table and "workload mixed" in table and "kvserve suffix" in table
