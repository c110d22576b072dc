"""LoRA adapters in the scheduling core: a request's adapter reaches the executor in every NewSequence.

The strict fake executor salts every draw with the sequence's adapter (and refuses an adapter it
was not given), so a NewSequence that lost its `lora_name` on the way (a recompute, a swap-in, a
re-sync after an executor loss) changes the completion, which is compared with the one computed
without any executor (`expected_completion(..., lora_name=...)`).
"""

from __future__ import annotations

import pytest

from kvserve.executor.fake.tokens import expected_completion
from kvserve.protos.step import NewSequence, PlanError, StepPlan
from kvserve.protos.stop_rules import FinishReason
from kvserve.testing.scheduler_config import checked_configs
from tests.scheduler.harness import Harness, strict_executor

LORAS = ("alpha", "beta")
PROMPT = [1, 2, 3, 4]
# Each request grows to 4 + 11 computed tokens = 4 blocks; 6 blocks cannot hold two.
config = checked_configs(num_blocks=6, block_size=4, max_model_len=32)
REQUESTS = {"first": "alpha", "second": "beta", "third": ""}


def add_all(h: Harness) -> None:
    """The same prompt under each adapter and the base model, each in its own namespace (as the server does)."""
    for arrival, (request_id, lora) in enumerate(REQUESTS.items()):
        h.add(
            request_id,
            PROMPT,
            max_tokens=12,
            ignore_eos=True,
            arrival_time=float(arrival),
            namespace=f"ns-{lora or 'base'}",
            lora_name=lora,
        )


def new_sequences(h: Harness, seq_id: int) -> list[NewSequence]:
    return [s for plan in h.plans for s in plan.new_seqs if s.seq_id == seq_id]


def test_the_fake_model_gives_each_adapter_its_own_tokens() -> None:
    completions = {lora: expected_completion(PROMPT, 7, 12, lora_name=lora) for lora in ("", *LORAS)}
    assert len({tuple(c) for c in completions.values()}) == 3
    assert completions[""] == expected_completion(PROMPT, 7, 12), "the base model's tokens are unchanged"


@pytest.mark.parametrize("how", ["recompute", "swap", "resync"])
def test_every_new_sequence_carries_the_requests_adapter(how: str) -> None:
    h = Harness(config(preemption_mode="swap", num_cpu_blocks=16) if how == "swap" else config(), loras=LORAS)
    add_all(h)
    seq_ids = {rid: request.seqs[0].seq_id for rid, request in h.scheduler.view().requests.items()}
    if how == "resync":
        for _ in range(5):
            h.step()
        assert h.scheduler.reset_executor() == []
        h.executor = strict_executor(6, 4, 0, h.vocab_size, loras=LORAS)
    h.run()
    for request_id, lora in REQUESTS.items():
        sent = new_sequences(h, seq_ids[request_id])
        assert sent and all(s.lora_name == lora for s in sent), (request_id, [s.lora_name for s in sent])
        assert h.tokens(request_id) == expected_completion(PROMPT, 7, 12, lora_name=lora), request_id
        assert h.reason(request_id) is FinishReason.LENGTH
    resent = [len(new_sequences(h, seq_id)) for seq_id in seq_ids.values()]
    assert max(resent) >= 2, f"no sequence came back to the executor ({how})"
    if how == "swap":
        assert any(plan.swap_in for plan in h.plans)


def test_the_same_adapter_in_the_same_namespace_hits_the_prefix_cache() -> None:
    h = Harness(config(num_blocks=32), loras=LORAS)
    prompt = list(range(1, 14))
    h.add("one", prompt, max_tokens=2, namespace="ns-alpha", lora_name="alpha")
    h.run()
    h.add("two", prompt, max_tokens=2, namespace="ns-alpha", lora_name="alpha")
    h.run()
    assert h.completions[("two", 0)].outputs[-1].num_cached_tokens > 0
    assert h.tokens("one") == h.tokens("two") == expected_completion(prompt, 7, 2, lora_name="alpha")


def test_the_fake_executor_refuses_an_adapter_it_was_not_given() -> None:
    fake = strict_executor(8, 4, loras=LORAS)
    h = Harness(config(num_blocks=8))
    h.add("r", PROMPT, max_tokens=2, lora_name="gamma")
    plan: StepPlan = h.scheduler.schedule()
    with pytest.raises(PlanError, match="'gamma' was not given to this executor"):
        fake.execute(plan)
