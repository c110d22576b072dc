"""The Hugging Face `generate` baseline: static batching on the same requests and model.

Requests are taken in order in batches of `batch_size`, left-padded to the batch's longest
prompt, and decoded greedily with `min_new_tokens = max_new_tokens = ` the batch's largest
max_tokens, so every output has at least its requested length (EOS cannot end it early).
Only each request's own max_tokens count as useful output: tokens a short request is
forced to produce while it waits for the batch's longest are the waste static batching
pays. All requests arrive at t=0, so a request's e2e is the end of its batch. One short
untimed generate runs first, as kvserve's servers get one untimed warm-up request.

`kvserve bench baseline-hf` (`register`, `run`) runs it alone on a `bench serve` workload.
torch and transformers are imported inside the functions: `kvserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from tqdm import tqdm

from kvserve.bench.load_driver import RequestRecord, RunResult
from kvserve.bench.report import HF_GENERATE
from kvserve.bench.report_output import ReportOutput, write_outputs
from kvserve.bench.sessions import Workload
from kvserve.config import defaults
from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True, slots=True)
class HfBaselineConfig:
    """`kvserve bench baseline-hf`'s flags."""

    workload: str = field(default="mixed", metadata=flag("requests to run", choices=("mixed", "shared-prefix")))
    num_requests: int = field(default=32, metadata=flag("requests in the workload"))
    seed: int = field(default=0, metadata=flag("workload seed (same requests as bench serve)"))
    max_tokens_cap: int = field(default=0, metadata=flag("cap every request's max_tokens (0: no cap)"))
    batch_size: int = field(default=8, metadata=flag("static batch size"))
    model: str = field(default=defaults.DEFAULT_MODEL, metadata=flag("model name, HF directory or .gguf"))
    threads: int = field(default=0, metadata=flag("torch CPU threads (0: torch's default)"))
    progress: bool = field(default=True, metadata=flag("show a progress bar"))


log = structlog.get_logger(__name__)

DEFAULT_BATCH_SIZE = 8


@dataclass(slots=True)
class HFRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int


def requests_from_workload(workload: Workload) -> list[HFRequest]:
    """Single-turn requests of a workload (multi-turn sessions contribute their first turn)."""
    return [HFRequest(s.session_id, list(s.turns[0].new_token_ids), s.turns[0].max_tokens) for s in workload.sessions]


def load_model(model_dir: str | Path, num_threads: int | None = None) -> PreTrainedModel:
    """The model in fp32 on CPU, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if num_threads:
        torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model


def _pad_id(model: PreTrainedModel) -> int:
    config = model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id, model.config.eos_token_id, 0):
        token = (candidate[0] if candidate else None) if isinstance(candidate, list) else candidate
        if token is not None:
            return int(token)
    return 0


def _warm_up(model: Any, request: HFRequest, pad_id: int, device: str = "cpu") -> None:
    """One short untimed generate, so one-time start-up costs do not count against the baseline."""
    import torch

    prompt = torch.tensor([request.prompt_token_ids[:16]], dtype=torch.long, device=device)
    with torch.inference_mode():
        model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=2,
            min_new_tokens=2,
            pad_token_id=pad_id,
        )


def run_hf_baseline(
    model: Any,  # a PreTrainedModel that can `generate` (a GenerationMixin method, not PreTrainedModel's)
    requests: list[HFRequest],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    workload_name: str = "mixed",
    progress: bool = True,
    device: str = "cpu",
) -> tuple[RunResult, int]:
    """Generate every request with static batches; returns the run and the total tokens generated
    (useful + padding waste). `device`: where `model` is (the GPU check runs it on CUDA)."""
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not requests:
        raise ValueError("no requests to run")
    pad_id = _pad_id(model)
    _warm_up(model, requests[0], pad_id, device)
    records: list[RequestRecord] = []
    generated_total = 0
    bar = tqdm(
        total=len(requests), desc=f"hf-generate {workload_name}", file=sys.stderr, disable=not progress, leave=False
    )
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        new_tokens = max(r.max_tokens for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long, device=device)
        attention = torch.zeros((len(batch), width), dtype=torch.long, device=device)
        for row, r in enumerate(batch):
            input_ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids, device=device)
            attention[row, width - len(r.prompt_token_ids) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad_id,
            )
        produced = out.shape[1] - width
        generated_total += produced * len(batch)
        batch_end = time.perf_counter() - start
        for r in batch:
            records.append(
                RequestRecord(
                    r.request_id,
                    0,
                    len(r.prompt_token_ids),
                    r.max_tokens,
                    output_tokens=min(produced, r.max_tokens),
                    e2e_s=batch_end,
                )
            )
        bar.update(len(batch))
    bar.close()
    duration = time.perf_counter() - start
    log.info("hf baseline done", requests=len(requests), batch_size=batch_size, seconds=round(duration, 2))
    return RunResult(
        configuration=HF_GENERATE, workload=workload_name, records=records, duration_s=duration
    ), generated_total


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "baseline-hf",
        help="Hugging Face generate (static batching) on a bench workload",
        description="Run the requests `bench serve` would send through transformers' generate: batches "
        "of a fixed size, left-padded, greedy, min_new_tokens = max_new_tokens. Reports output "
        "tokens/s (only each request's own max_tokens count).",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, HfBaselineConfig)
    add_flags(parser, ReportOutput)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import datetime as dt

    from kvserve.bench import workloads
    from kvserve.bench.report import BenchReport, summarize_run
    from kvserve.executor.weights.model_store import ensure_model_dir
    from kvserve.log_config import configure_logging

    config = config_from_args(HfBaselineConfig, args)
    configure_logging()
    model_dir = ensure_model_dir(config.model)
    model = load_model(model_dir, num_threads=config.threads or None)
    [workload] = workloads.build(
        config.workload, config.num_requests, model.config.vocab_size, config.seed, config.max_tokens_cap or None
    )
    run_result, generated = run_hf_baseline(
        model,
        requests_from_workload(workload),
        batch_size=config.batch_size,
        workload_name=workload.name,
        progress=config.progress,
    )
    report = BenchReport(
        meta={
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "model_dir": str(model_dir),
            "batch_size": config.batch_size,
            "hf_generated_tokens": generated,
            "seed": config.seed,
        }
    )
    report.results = [summarize_run(run_result)]
    return write_outputs(report, config_from_args(ReportOutput, args), stream=sys.stdout)
