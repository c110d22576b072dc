"""The runner on the real default model reproduces transformers' greedy `generate`, token for token.

The HF model, the runner and HF's reference outputs are built once per module. Each
scenario drives the runner with hand-built plans (`PlanDriver`): whole prompts one at a
time, chunked prefill of 7 tokens, half the prompt's blocks taken from another sequence's
cache (shared or copied), and all prompts batched together with staggered arrivals.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.runner_config import RunnerConfig
from kvserve.testing.plan_driver import PlanDriver

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPTS = [
    "Here is a short encyclopedia entry about European geography, written for school children. "
    "It covers rivers, mountains and cities. The capital of France is",
    "Write a short poem about the sea and the wind, in the style of a children's song, with a chorus "
    "that repeats after every verse and a final verse about coming home:",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively so that large '
    'values of n do not overflow the recursion limit."""\n',
    "Question: What is the boiling point of water at sea level in degrees Celsius, and how does it change "
    "when you climb a high mountain such as Everest?\nAnswer:",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who "
    "had never once left the valley. One winter morning,",
    "List three benefits of regular exercise for office workers who sit at a desk for most of the day, "
    "with one sentence of explanation for each:\n1.",
    "Translate to French: 'Good morning, how are you today? I hope the weather is nice where you live, "
    "and that your family is doing well after the long trip.'",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick "
    "brown fox jumps over the lazy dog. Then the fox",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(default_model_dir, prompt_ids, runner) -> list[list[int]]:
    """HF's greedy tokens (after `runner`, so both run under the runner's CPU thread policy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            input_ids = torch.tensor([ids])
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=model.config.eos_token_id,
            )
            outputs.append(generated[0, len(ids) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    runner = ModelRunner(RunnerConfig(dtype="float32", kv_cache_gb=0.25))
    yield runner
    runner.close()


def _assert_matches_hf(ours: dict[int, list[int]], hf_outputs: list[list[int]]) -> None:
    compared = 0
    for i, expected in enumerate(hf_outputs):
        got = ours[i][: len(expected)]
        assert got == expected, f"prompt {i}: runner {got} != HF {expected}"
        compared += len(expected)
    # HF stops early only at EOS; most prompts must run the full 32 tokens for this to mean much.
    assert compared >= 0.75 * NEW_TOKENS * len(hf_outputs)


def test_hf_reference_is_nontrivial(hf_outputs):
    assert len(hf_outputs) >= 8
    assert len({tuple(o) for o in hf_outputs}) == len(hf_outputs)


def test_greedy_matches_hf_one_prompt_at_a_time(runner, prompt_ids, hf_outputs):
    ours = {}
    for i, ids in enumerate(prompt_ids):
        driver = PlanDriver(runner)
        driver.add(i, ids, NEW_TOKENS)
        ours.update(driver.run())
    _assert_matches_hf(ours, hf_outputs)


def test_greedy_matches_hf_with_chunked_prefill_of_7(runner, prompt_ids, hf_outputs):
    driver = PlanDriver(runner)
    for i, ids in enumerate(prompt_ids):
        driver.add(i, ids, NEW_TOKENS, chunk_size=7)
    ours = driver.run()
    prefill_steps = -(-max(len(ids) for ids in prompt_ids) // 7)
    assert len(driver.last_results) >= prefill_steps + NEW_TOKENS - 1
    _assert_matches_hf(ours, hf_outputs)


@pytest.mark.parametrize("copy_prefix", [False, True], ids=["shared", "copied"])
def test_greedy_matches_hf_with_half_the_blocks_from_another_sequence(runner, prompt_ids, hf_outputs, copy_prefix):
    driver = PlanDriver(runner)
    block_size = runner.info().block_size
    donors: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        # The donor holds the first half of the prompt's blocks (full ones), then diverges.
        half = (-(-len(ids) // block_size)) // 2
        assert half >= 1 and half * block_size < len(ids), f"prompt {i} is too short"
        donors[i] = [half]
        donor_prompt = ids[: half * block_size] + [42, 1337, 7]
        driver.add(100 + i, donor_prompt, max_new_tokens=1, retain=True)
    driver.run()
    shared = 0
    for i, ids in enumerate(prompt_ids):
        half = donors[i][0]
        prefix = driver.retained[100 + i][:half]
        shared += half
        driver.add(i, ids, NEW_TOKENS, prefix_blocks=prefix, copy_prefix=copy_prefix)
    ours = driver.run()
    _assert_matches_hf(ours, hf_outputs)


def test_greedy_matches_hf_in_mixed_batches(runner, prompt_ids, hf_outputs):
    driver = PlanDriver(runner)
    mixed_steps = 0
    for i, ids in enumerate(prompt_ids):
        # Arrivals staggered by two steps: prefills (some chunked) run alongside decodes.
        driver.add(i, ids, NEW_TOKENS, chunk_size=None if i % 2 else 11)
        for _ in range(2):
            plan_had_decode = any(s.num_computed >= s.prompt_len for s in driver.active.values())
            plan_had_prefill = any(s.num_computed < s.prompt_len for s in driver.active.values())
            mixed_steps += plan_had_decode and plan_had_prefill
            driver.step()
    ours = driver.run()
    assert mixed_steps >= 4
    _assert_matches_hf(ours, hf_outputs)
