"""`kvserve bench structured` runs both of its constraints through the real step path.

A tiny random model with the default model's tokenizer keeps it fast; the figures it yields
mean nothing, but every constrained row must decode under its grammar for the timed steps
(the harness raises if one finishes early, or if a grammar forbids every token).
"""

from __future__ import annotations

import json

import pytest

from kvserve.testing.tiny_checkpoints import TINY, with_tokenizer, write_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory, default_model_dir):
    from kvserve.executor.model_runner import ModelRunner
    from kvserve.executor.runner_config import RunnerConfig

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("structured") / "llama", **(TINY | dict(vocab_size=49152)))
    runner = ModelRunner(RunnerConfig(model=str(with_tokenizer(path, default_model_dir)), kv_cache_gb=0.05))
    yield runner
    runner.close()


def test_both_constraints_time_every_row_decoding(tiny_runner) -> None:
    from kvserve.bench.structured import CONSTRAINTS, run_structured_bench
    from kvserve.scheduler.server.intake.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_runner.info().tokenizer_path)
    lines: list[str] = []
    results = run_structured_bench(tiny_runner, tokenizer, [1, 3], steps=4, repeats=1, progress=lines.append)
    assert [(r.constraint, r.batch) for r in results] == [(c, b) for c in CONSTRAINTS for b in (1, 3)]
    for r in results:
        assert r.free.total_ms > 0 and r.constrained.total_ms > 0
        assert r.constrained.schedule_ms > r.free.schedule_ms, "constrained plans fill bitmasks; free ones do not"
    assert sum("tools:" in line for line in lines) == 2


def test_the_tools_grammar_is_the_one_a_required_tool_choice_compiles(tiny_runner) -> None:
    """The bench's matcher accepts a hermes call to one of its tools, and not free text."""
    from kvserve.bench.structured import BENCH_TOOLS, bench_factory
    from kvserve.scheduler.server.intake.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_runner.info().tokenizer_path)
    factory = bench_factory("tools", tokenizer, tiny_runner)
    name, _, _ = BENCH_TOOLS[2]
    call = {"name": name, "arguments": {"severity": "low", "steps": ["step number one"] * 12}}
    text = "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    matcher = factory.new_matcher()
    assert all(matcher.accept(t) for t in tokenizer.encode(text)), "a well-formed call to a bench tool is accepted"
    assert matcher.accept(tiny_runner.info().eos_token_ids[0]) and matcher.is_finished
    assert not factory.new_matcher().accept(tokenizer.encode("Sure")[0]), "free text is not a call"
