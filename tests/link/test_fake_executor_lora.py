"""The fake executor's LoRA adapters: `--lora NAME=PATH` like the real one, names reported, tokens salted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.executor.config_error import ExecutorConfigError
from kvserve.executor.entry import build_parser, fake_config_from_args
from kvserve.executor.fake.adapters import lora_names
from kvserve.executor.fake.executor import FakeExecutor, FakeExecutorConfig
from kvserve.executor.fake.tokens import expected_completion
from kvserve.protos.sampling import SamplingParams
from kvserve.protos.step import NewSequence, PlanError, StepPlan
from kvserve.testing.plan_driver import PlanDriver

PROMPT = list(range(10, 21))
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8)


def plain_fake(*loras: str) -> FakeExecutor:
    """A fake over the plain vocabulary range(50), with adapters whose paths do not exist."""
    return FakeExecutor(FakeExecutorConfig(num_blocks=64, block_size=4, vocab_size=50, strict=True, lora=loras))


def generate(loras: tuple[str, ...], lora: str, sampling: SamplingParams = GREEDY, n: int = 10) -> list[int]:
    """The first `n` tokens of PROMPT under adapter `lora` on a fresh fake given `loras`."""
    driver = PlanDriver(plain_fake(*loras), 64)
    seq = driver.add(1, PROMPT, sampling=sampling, seed=5, lora_name=lora)
    while len(seq.outputs) < n:
        driver.step()
    return seq.outputs[:n]


def test_lora_names_in_the_order_given_and_bad_specs_refused() -> None:
    assert lora_names(["a=/x", "b=/y/z", "c=rel/path=with=equals"]) == ("a", "b", "c")
    assert lora_names([]) == ()
    for bad in (["noequals"], ["=/x"], ["a="], ["a=/x", "a=/y"]):
        with pytest.raises(ExecutorConfigError, match="--lora"):
            lora_names(bad)


def test_the_adapters_are_reported_without_loading_anything() -> None:
    fake = plain_fake("alpha=/does/not/exist", "beta=/nor/this")
    assert fake.info().lora_names == ["alpha", "beta"]
    assert plain_fake().info().lora_names == []


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_adapter_has_its_own_tokens_and_the_base_model_is_unchanged(sampling: SamplingParams) -> None:
    loras = ("alpha=/a", "beta=/b")
    outputs = {lora: generate(loras, lora, sampling) for lora in ("", "alpha", "beta")}
    assert len({tuple(tokens) for tokens in outputs.values()}) == 3
    assert outputs[""] == generate((), "", sampling), "adapters given change nothing for the base model"
    assert outputs["alpha"] == generate(("alpha=/elsewhere",), "alpha", sampling), "a function of the name alone"
    greedy = sampling.temperature == 0.0
    for lora, tokens in outputs.items():
        assert tokens == expected_completion(PROMPT, 5, 10, greedy=greedy, lora_name=lora)


def test_a_new_sequence_under_an_unknown_adapter_is_refused() -> None:
    fake = plain_fake("alpha=/a")
    plan = StepPlan(1, new_seqs=[NewSequence(1, PROMPT, 11, 0, 11, [0, 1, 2], GREEDY, 0, lora_name="gamma")])
    with pytest.raises(
        PlanError, match=r"new seq 1: LoRA adapter 'gamma' was not given to this executor \(it has 'alpha'\)"
    ):
        fake.execute(plan)
    fake.execute(StepPlan(2, new_seqs=[NewSequence(1, PROMPT, 11, 0, 11, [0, 1, 2], GREEDY, 0, lora_name="alpha")]))


def test_the_runners_lora_flag_configures_the_fake(default_model_dir) -> None:
    args = build_parser().parse_args(
        ["--executor", "fake", "--tokenizer-path", str(default_model_dir), "--lora", "a=/x", "--lora", "b=/y"]
    )
    assert fake_config_from_args(args).lora == ("a=/x", "b=/y")


def test_a_malformed_lora_flag_is_refused_with_exit_2(default_model_dir) -> None:
    argv = ["--executor", "fake", "--tokenizer-path", str(default_model_dir), "--lora", "nameonly"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.executor", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "--lora 'nameonly': expected NAME=PATH" in proc.stderr and "Traceback" not in proc.stderr
