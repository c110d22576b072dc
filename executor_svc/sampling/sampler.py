"""The batched sampler: penalties, greedy or seeded sampling with top-k/top-p/min-p, logprobs.

Every row is processed in one vectorised pass. Random draws use the exponential race
(argmax of p_i / E_i with E_i ~ Exp(1)), i.e. Gumbel-max, with E_i from a hash of
(seed, output position, token id): a sequence draws the same token whatever else is in
the batch and after a recompute. Greedy rows take the exact argmax, with no noise.

Before a sequence has `min_tokens` outputs, its EOS (unless ignore_eos) and stop token ids
are masked out, by the rules in `kvserve.protos.stop_rules` that the scheduler applies too.
Structured output's token masks (`kvserve.executor.sampling.token_mask`) come after the penalties, so
nothing can re-admit a token the grammar forbids. Logprobs are reported from the
penalised, grammar-masked logits before temperature and filtering (the model's
distribution over what may follow, as vLLM reports by default).
"""

from __future__ import annotations

import torch

from kvserve.executor.sampling.penalties import apply_penalties
from kvserve.executor.sampling.seeded_noise import row_key, uniform_noise
from kvserve.executor.sampling.token_mask import TokenMasks, apply_token_masks
from kvserve.executor.sequence_state import SequenceState
from kvserve.protos.step import SampledToken, TokenLogprob
from kvserve.protos.stop_rules import stop_token_ids, stop_tokens_allowed


def sample(
    logits: torch.Tensor,
    seqs: list[SequenceState],
    eos_token_ids: list[int] | tuple[int, ...] = (),
    masks: TokenMasks | None = None,
) -> list[SampledToken]:
    """Pick one token per row of `logits` [n, vocab] (float32) for the matching sequence,
    within `masks` for the constrained rows."""
    n, _vocab = logits.shape
    if n == 0:
        return []
    params = [s.sampling for s in seqs]
    held_back = _suppress_early_stops(logits, seqs, eos_token_ids)
    penalised = [
        i
        for i, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    ]
    if penalised:
        rows = torch.tensor(penalised, dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, rows)
        apply_penalties(
            sub,
            prompt_tokens=[seqs[i].token_ids[: seqs[i].prompt_len] for i in penalised],
            output_tokens=[seqs[i].token_ids[seqs[i].prompt_len :] for i in penalised],
            repetition=[params[i].repetition_penalty for i in penalised],
            presence=[params[i].presence_penalty for i in penalised],
            frequency=[params[i].frequency_penalty for i in penalised],
        )
        logits = logits.index_copy(0, rows, sub)
    if masks is not None:
        apply_token_masks(logits, masks, may_empty=held_back)

    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        keys = [row_key(seqs[i].seed, seqs[i].output_len) for i in random_rows]
        drawn = _draw(logits.index_select(0, rows), [params[i] for i in random_rows], keys)
        chosen = chosen.index_copy(0, rows, drawn)
    return _outputs(logits, chosen, seqs)


def _suppress_early_stops(
    logits: torch.Tensor, seqs: list[SequenceState], eos_token_ids: list[int] | tuple[int, ...]
) -> bool:
    """Mask the stop tokens of every row that may not stop yet (kvserve.protos.stop_rules), so the
    scheduler never receives a stop token it would have to disregard. True if any was masked."""
    vocab = logits.shape[1]
    held_back = False
    for i, seq in enumerate(seqs):
        if stop_tokens_allowed(seq.sampling, seq.output_len):
            continue
        banned = [t for t in stop_token_ids(seq.sampling, eos_token_ids) if 0 <= t < vocab]
        if banned:
            logits[i, banned] = float("-inf")
            held_back = True
    return held_back


def filtered_logits(
    logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Temperature-scaled logits with tokens outside top-k / top-p / min-p set to -inf."""
    _n, vocab = logits.shape
    device = logits.device
    scaled = logits / torch.tensor(temperature, dtype=logits.dtype, device=device)[:, None]
    if any(m > 0.0 for m in min_p):
        probs = scaled.softmax(-1)
        floor = torch.tensor(min_p, dtype=probs.dtype, device=device)[:, None] * probs.max(-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=device)[:, None]
        drop = rank >= k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= mass_before > torch.tensor(top_p, dtype=sorted_probs.dtype, device=device)[:, None]
        drop[:, 0] = False
        scaled = scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled


def _draw(logits: torch.Tensor, params: list, keys: list[int]) -> torch.Tensor:
    scaled = filtered_logits(
        logits,
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )
    exponential = -torch.log(uniform_noise(keys, logits.shape[1], logits.device))
    return (scaled - torch.log(exponential)).argmax(dim=-1)


def _outputs(logits: torch.Tensor, chosen: torch.Tensor, seqs: list[SequenceState]) -> list[SampledToken]:
    token_ids = chosen.tolist()
    outputs = [SampledToken(seq_id=s.seq_id, token_id=t) for s, t in zip(seqs, token_ids)]
    wants = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    if not wants:
        return outputs
    rows = torch.tensor(wants, dtype=torch.long, device=logits.device)
    logprobs = logits.index_select(0, rows).log_softmax(-1)
    picked = logprobs.gather(1, chosen.index_select(0, rows)[:, None])[:, 0].tolist()
    top_n = max(seqs[i].sampling.logprobs or 0 for i in wants)  # never None: `wants` has only set ones
    top_vals, top_ids = logprobs.topk(top_n, dim=-1) if top_n > 0 else (None, None)
    for j, i in enumerate(wants):
        outputs[i].logprob = picked[j]
        n = seqs[i].sampling.logprobs
        if n:
            assert top_ids is not None and top_vals is not None  # n > 0, so top_n > 0
            outputs[i].top_logprobs = [
                TokenLogprob(token_id=t, logprob=v) for t, v in zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())
            ]
    return outputs
