"""The periodic `engine stats` line reports the pool's usage as block counts, from `SchedulerStats`."""

from __future__ import annotations

from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import SampledToken, StepResult
from kvserve.scheduler.core.scheduler import Scheduler
from kvserve.scheduler.core.scheduler_config import SchedulerConfig
from kvserve.scheduler.server.observability.stats_logger import StatsLogger


class _Recorder:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.lines.append((event, fields))


def test_stats_line_has_free_cached_referenced_and_reserved_blocks() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=40, block_size=4, max_model_len=32, kv_reservation="max-model-len")
    )
    scheduler.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10, ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.update(StepResult(plan.step_id, [SampledToken(plan.new_seqs[0].seq_id, 9)]))
    stats = scheduler.stats()
    now = [0.0]
    recorder = _Recorder()
    logger = StatsLogger(5.0, clock=lambda: now[0], logger=recorder)
    now[0] = 6.0
    fields = logger.observe_step(stats, 5, 1)
    assert fields is not None and recorder.lines == [("engine stats", fields)]
    assert fields["blocks_referenced"] == 2 and fields["blocks_reserved"] == 8 - 2
    assert fields["blocks_free"] == 40 - 2 and fields["blocks_cached"] == 0
    assert fields["blocks_free"] + fields["blocks_cached"] + fields["blocks_referenced"] == 40
