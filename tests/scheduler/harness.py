"""Drive a Scheduler against the fake executor in strict mode and collect what each completion produced."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.executor.fake.executor import FakeExecutor, FakeExecutorConfig
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import StepPlan
from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core.outputs import SequenceOutput
from kvserve.scheduler.core.scheduler import Scheduler
from kvserve.scheduler.core.scheduler_config import SchedulerConfig


def strict_executor(
    num_blocks: int,
    block_size: int,
    num_cpu_blocks: int = 0,
    vocab_size: int = 50,
    *,
    draft: bool = False,
    loras: tuple[str, ...] = (),
    kv_disk_dir: str | None = None,
    kv_host_gb: float = 0.0,
) -> FakeExecutor:
    """A strict fake executor over a plain vocabulary: checks every plan, needs no model files.
    `draft`: it is also a (fake) draft model, for `--speculative draft`; `loras`: the LoRA adapters'
    names it knows (`--lora NAME=PATH`, PATHs made up); `kv_disk_dir` and `kv_host_gb`: its tiers below the
    pool (`--kv-disk-dir`, `--kv-host-gb`)."""
    return FakeExecutor(
        FakeExecutorConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            num_cpu_blocks=num_cpu_blocks,
            vocab_size=vocab_size,
            strict=True,
            draft_model="fake" if draft else None,
            lora=tuple(f"{name}=/adapters/{name}" for name in loras),
            kv_disk_dir=kv_disk_dir,
            kv_host_gb=kv_host_gb,
        )
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    outputs: list[SequenceOutput] = field(default_factory=list)


@dataclass
class Harness:
    config: SchedulerConfig
    vocab_size: int = 50
    check: bool = True
    scheduler: Scheduler = field(init=False)
    executor: FakeExecutor = field(init=False)
    completions: dict[tuple[str, int], Completion] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)
    clock: FakeClock = field(default_factory=FakeClock)
    loras: tuple[str, ...] = ()
    """The LoRA adapters the executor knows."""
    kv_disk_dir: str | None = None
    """The executor's disk tier, which the scheduler then uses (as the service sets it up)."""
    kv_host_gb: float = 0.0
    """The executor's host-memory tier."""

    def __post_init__(self) -> None:
        self.scheduler = Scheduler(self.config, clock=self.clock)
        self.executor = strict_executor(
            self.config.num_blocks,
            self.config.block_size,
            self.config.num_cpu_blocks,
            self.vocab_size,
            draft=self.config.speculative == "draft",
            loras=self.loras,
            kv_disk_dir=self.kv_disk_dir,
            kv_host_gb=self.kv_host_gb,
        )
        info = self.executor.info()
        self.scheduler.set_disk_tier(info.kv_fingerprint, info.kv_disk_keys, info.kv_tiers, info.kv_block_bytes)

    def add(self, request_id: str, prompt: list[int], **sampling_and_options) -> None:
        options = {
            k: sampling_and_options.pop(k)
            for k in ("priority", "namespace", "arrival_time", "constraint", "lora_name")
            if k in sampling_and_options
        }
        sampling_and_options.setdefault("seed", 7)
        self.scheduler.add_request(request_id, prompt, SamplingParams(**sampling_and_options), **options)

    def collect(self, outputs: list[SequenceOutput]) -> None:
        for out in outputs:
            completion = self.completions.setdefault((out.request_id, out.index), Completion())
            assert completion.finish_reason is None, f"output after finish for {out.request_id}#{out.index}"
            completion.tokens.extend(out.new_token_ids)
            completion.outputs.append(out)
            completion.finish_reason = out.finish_reason
            assert out.num_output_tokens == len(completion.tokens)

    def schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        if self.check:
            self.scheduler.check_invariants()
        self.plans.append(plan)
        return plan

    def step(self) -> StepPlan:
        plan = self.schedule()
        if not plan.is_empty:
            self.finish_step(plan)
        return plan

    def finish_step(self, plan: StepPlan) -> None:
        result = self.executor.execute(plan)
        self.collect(self.scheduler.update(result))
        if self.check:
            self.scheduler.check_invariants()

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_unfinished():
            plan = self.step()
            steps += 1
            assert not plan.is_empty, "scheduler stalled with unfinished requests:\n" + self.scheduler.debug_dump()
            assert steps < max_steps, "too many steps"
        return steps

    def tokens(self, request_id: str, index: int = 0) -> list[int]:
        return self.completions[(request_id, index)].tokens

    def reason(self, request_id: str, index: int = 0) -> FinishReason | None:
        return self.completions[(request_id, index)].finish_reason
