"""`kvserve bench scheduler`: it measures steady decode steps and reports the documented keys."""

from __future__ import annotations

import argparse
import json

from kvserve.bench import scheduler as bench_scheduler
from kvserve.bench.scheduler import FeedbackExecutor, build_scheduler, run_scheduler_bench, warm_up


def test_warm_up_reaches_steady_decode_with_a_shared_prefix() -> None:
    # 8 x 400 prompt tokens exceed one step's 2048-token budget: the requests admitted in
    # later steps hit the 300-token shared prefix that the first ones computed.
    scheduler = build_scheduler(running=8, prefix_sharing=True, prompt_len=400, steps=3)
    executor = FeedbackExecutor()
    warm_up(scheduler, executor, 8)
    plan = scheduler.schedule()
    assert len(plan.known_seqs) == 8 and all(s.num_scheduled_tokens == 1 for s in plan.known_seqs)
    stats = scheduler.stats()
    assert stats.prefix_hit_tokens >= 2 * 288
    scheduler.update(executor.execute(plan))
    scheduler.check_invariants()


def test_result_fields() -> None:
    result = run_scheduler_bench(running=4, prefix_sharing=False, prompt_len=20, steps=5)
    assert result.running == 4 and result.steps == 5
    assert result.us_per_step > 0 and result.us_per_seq == result.us_per_step / 4


def test_cli_json_keys(capsys) -> None:
    parser = argparse.ArgumentParser()
    bench_scheduler.register(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["scheduler", "--running", "3", "--steps", "4", "--prompt-len", "20", "--json"])
    assert args.func(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["running"], r["prefix_sharing"]) for r in rows] == [(3, False), (3, True)]
    for row in rows:
        assert {"running", "prefix_sharing", "us_per_step", "us_per_seq"} <= set(row)
