"""A model's layer matrices through each CPU GEMM kernel kvserve could run them with, at several row counts.

`python -m kvserve.bench.gemm_kernels` times one decode step's worth of layer matrices (q/k/v, o,
gate/up and down, times the layer count; random weights of the model's shapes) through kvserve's
Q4_1 kernel (`--weights native`), torch's int4 GEMM with bfloat16 activations (what native ran
before it, its casts included) and the float32 linear of the dequantized path. It isolates the
kernels from the rest of a step, which `kvserve bench executor` and `step_profile` measure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.executor.attention.cpu_backend import ensure_kernels
from kvserve.executor.model_config import load_model_config
from kvserve.executor.weights.gguf_q4_1 import GROUP, dequantize, random_q4_1
from kvserve.executor.weights.invariance import linear_shapes
from kvserve.executor.weights.linear import make_linear
from kvserve.executor.weights.model_store import ensure_model_dir
from kvserve.executor.weights.q4_1_linear import make_q4_1_linear

Kernel = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class GemmKernelsConfig:
    """The flags of `python -m kvserve.bench.gemm_kernels`."""

    model: str | None = field(default=None, metadata=flag("whose shapes (default: the default model)"))
    num_threads: int = field(default=2, metadata=flag("torch threads"))
    rows: tuple[int, ...] = field(
        default=(1, 8, 32, 64, 256), metadata=flag("activation rows per call", metavar="N", nargs="+")
    )
    repeats: int = field(default=5, metadata=flag("timed passes over the layers per row count (the median counts)"))


def kernels_for(n_in: int, n_out: int, generator: torch.Generator) -> dict[str, Kernel]:
    """One random Q4_1 matrix of [n_out, n_in], as each kernel holds it."""
    weight = random_q4_1(n_out, n_in, generator)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
    zero = weight.m.float() + 8 * weight.d.float()  # its form: (q - 8)·scale + zero
    scales = torch.stack([weight.d.float(), zero], dim=-1).transpose(0, 1).contiguous().bfloat16()
    fp32 = make_linear(dequantize(weight))

    def int4(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, GROUP, scales).float()

    return {"kvserve q4_1": make_q4_1_linear(weight), "torch int4 (bf16)": int4, "float32 linear": fp32}


def step_ms(layers: list[tuple[int, Kernel]], rows: int, repeats: int) -> float:
    """The median time of one pass over every layer's matrices, each called with `rows` rows."""
    inputs = {n_in: torch.randn(rows, n_in) for n_in, _ in layers}
    times = []
    for _ in range(repeats + 1):  # the first pass warms the caches
        started = time.perf_counter()
        for n_in, kernel in layers:
            kernel(inputs[n_in])
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.bench.gemm_kernels", description=__doc__.split("\n")[0], formatter_class=HelpFormatter
    )
    add_flags(parser, GemmKernelsConfig)
    args = config_from_args(GemmKernelsConfig, parser.parse_args(argv))
    torch.set_num_threads(args.num_threads)
    ensure_kernels()
    config = load_model_config(ensure_model_dir(args.model))
    shapes = [shape for name, shape in linear_shapes(config, config.vocab_size).items() if name != "lm_head"]
    generator = torch.Generator().manual_seed(0)
    # Every layer its own matrices, as in the model: together they outgrow the caches, as a step's do.
    per_matrix = [
        (n_in, kernels_for(n_in, n_out, generator)) for _ in range(config.num_layers) for n_in, n_out in shapes
    ]
    names = list(per_matrix[0][1])
    print(f"{config.num_layers} layers of {shapes} (in, out), {args.num_threads} threads: ms per decode step")
    print("| rows | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    with torch.inference_mode():
        for rows in args.rows:
            cells = []
            for name in names:
                layers = [(n_in, kernels[name]) for n_in, kernels in per_matrix]
                cells.append(f"{step_ms(layers, rows, args.repeats):.3g}")
            print(f"| {rows} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
