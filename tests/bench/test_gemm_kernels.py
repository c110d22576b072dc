"""`python -m kvserve.bench.gemm_kernels`, run as users run it, on a tiny random Llama's shapes."""

from __future__ import annotations

import subprocess
import sys

from kvserve.testing.tiny_checkpoints import TINY, write_tiny_checkpoint


def test_it_times_every_kernel_at_every_row_count(tmp_path) -> None:
    model = write_tiny_checkpoint(tmp_path / "llama", "llama", **TINY)
    argv = ["--model", str(model), "--num-threads", "1", "--rows", "1", "5", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.bench.gemm_kernels", *argv], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert lines[0] == "| rows | kvserve q4_1 | torch int4 (bf16) | float32 linear |"
    rows = [line.strip("|").split("|") for line in lines[2:]]
    assert [int(cells[0]) for cells in rows] == [1, 5]
    assert all(float(cell) > 0 for cells in rows for cell in cells[1:])
