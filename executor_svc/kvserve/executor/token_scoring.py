"""Teacher-forced scoring: every position's log-probability of the next token, and its argmax.

`kvserve bench quality` measures a configuration (dtype, `--weights`) by perplexity on a
fixed text and by top-1 agreement with the fp32 path. Both must come from the code that
serves requests, so scoring runs the runner's own forward pass (its weights, kernels and
paged attention) as one prefill, keeping the logits of every row instead of the last only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.executor.model.input_batch import build_input_batch
from kvserve.executor.model_runner import ModelRunner
from kvserve.executor.sampling.row_softmax import log_softmax
from kvserve.executor.sequence_state import SequenceState
from kvserve.protos.sampling import SamplingParams


@dataclass(slots=True)
class TokenScores:
    """Row i scores the prediction of token i + 1 from tokens 0..i."""

    logprobs: torch.Tensor
    """[n - 1] float32: log p(token[i + 1] | tokens[: i + 1])."""
    argmax: torch.Tensor
    """[n - 1] int64: the greedy choice after tokens[: i + 1]."""


def every_position_logits(runner: ModelRunner, token_ids: list[int], split: int | None = None) -> torch.Tensor:
    """Logits [n, vocab] at every position of `token_ids`, through the runner's own forward pass on its
    first KV blocks: one prefill, or with `split` a prefill of that many tokens then an extend over the
    cached context (which exercises the paged cache). It overwrites those blocks, so use it on a runner
    that serves nothing else (a benchmark's, a test's)."""
    block_size = runner.config.block_size
    num_blocks = -(-len(token_ids) // block_size)
    if num_blocks > runner.cache.num_blocks:
        raise ValueError(
            f"{len(token_ids)} tokens need {num_blocks} KV blocks; the runner has {runner.cache.num_blocks}"
        )
    state = SequenceState(
        seq_id=0,
        token_ids=list(token_ids),
        prompt_len=len(token_ids),
        block_table=list(range(num_blocks)),
        sampling=SamplingParams(temperature=0.0),
        seed=0,
    )
    chunks = [(0, len(token_ids))] if split is None else [(0, split), (split, len(token_ids) - split)]
    logits: list[torch.Tensor] = []
    with torch.inference_mode():
        for start, count in chunks:
            state.num_computed_tokens, state.num_scheduled_tokens = start, count
            batch = build_input_batch(
                [state], block_size, runner.device, runner.model.scale, runner.dtype, runner.model_config.num_kv_heads
            )
            batch.sample_indices = torch.arange(count, device=runner.device)
            out = runner.model.forward(batch, runner.cache, runner.backend)
            assert out is not None  # None only on a tensor-parallel rank other than 0; a ModelRunner here is rank 0
            logits.append(out)
    return torch.cat(logits)


def score_tokens(runner: ModelRunner, token_ids: list[int]) -> TokenScores:
    """Score `token_ids` in one prefill on the runner's first KV blocks (see `every_position_logits`)."""
    if len(token_ids) < 2:
        raise ValueError("scoring needs at least two tokens")
    logits = every_position_logits(runner, token_ids)[:-1]
    with torch.inference_mode():
        targets = torch.tensor(token_ids[1:], dtype=torch.long, device=logits.device)
        logprobs = log_softmax(logits).gather(1, targets[:, None]).squeeze(1)
    return TokenScores(logprobs=logprobs.cpu(), argmax=logits.argmax(dim=-1).cpu())
