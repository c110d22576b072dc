"""`python -m kvserve.bench.step_profile`, run as users run it (a child process: its profiler and
torch.compile must not leave their state in the test process, where they broke the link tests that
follow): the step, its ops and a neighbour on a tiny random Llama; the compiled forward on the
default model."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from kvserve.testing.tiny_checkpoints import TINY, write_tiny_checkpoint


def _step_profile(*argv: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.bench.step_profile", *argv], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama", **TINY))


def test_it_reports_the_step_its_busiest_ops_and_the_step_beside_a_busy_neighbour(tiny_llama) -> None:
    argv = ["--model", tiny_llama, "--dtype", "float32", "--batch", "3", "--steps", "3", "--profile-steps", "2"]
    argv += ["--kv-cache-dtype", "bfloat16"]
    out = [line for line in _step_profile(*argv, "--neighbours", "1", "--top", "500") if not line.startswith("USDT")]
    assert out[0].startswith("float32, KV bfloat16, weights dequantized,"), out[0]
    assert "batch 3: median decode step" in out[0]
    assert out[1].startswith("beside 1 busy process(es): median decode step")
    ops, total = out[2:-1], out[-1]
    assert total.startswith("all ops") and 10 <= len(ops) <= 500
    self_ms = [float(line.split()[-4]) for line in ops]
    assert self_ms == sorted(self_ms, reverse=True)  # the busiest first
    # Every op is listed (the ranking among the small ones is the machine's), so the
    # batch-invariant CPU kernels are there however loaded the machine is.
    for kernel in ("kvserve_cpu::paged_attention", "kvserve_cpu::store_kv", "kvserve_cpu::silu_mul"):
        assert any(line.startswith(kernel) for line in ops), kernel
    spinning = [p for p in psutil.process_iter(["cmdline"]) if "while True: pass" in (p.info["cmdline"] or [])]
    assert not spinning  # the neighbour is gone


@pytest.mark.slow
def test_compile_compares_the_compiled_forward_with_the_eager_one() -> None:
    """On the native path: inductor lowers oneDNN's prepacked linears (the dequantized paths) only
    with frozen weights, which a served model does not have. About a minute, the compile included."""
    out = _step_profile("--weights", "native", "--steps", "2", "--profile-steps", "1", "--top", "1", "--compile")
    (line,) = [line for line in out if line.startswith("torch.compile")]
    assert "ms compiled; logits" in line
