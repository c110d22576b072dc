"""The batched sampler: penalties, logit biases, greedy or seeded sampling with top-k/top-p/min-p, logprobs.

Every row is processed in one vectorised pass. Random draws use the exponential race
(argmax of p_i / E_i with E_i ~ Exp(1)), i.e. Gumbel-max, with E_i from a hash of
(seed, output position, token id): a sequence draws the same token whatever else is in
the batch and after a recompute. Greedy rows take the exact argmax, with no noise.

Before a sequence has `min_tokens` outputs, its EOS (unless ignore_eos) and stop token ids
are masked out, by the rules in `kvserve.protos.stop_rules` that the scheduler applies too.
Each row's `logit_bias` (`kvserve.executor.sampling.logit_bias`; -100 bans) is added after the
penalties. Structured output's token masks (`kvserve.executor.sampling.token_mask`) come after
both, so nothing can re-admit a token the grammar forbids. Logprobs are reported from the
penalised, biased, grammar-masked logits before temperature and filtering (the model's
distribution over what may follow, as vLLM reports by default). The filters' probabilities and the
logprobs come from `kvserve.executor.sampling.row_softmax`: on the CPU kernels' path, the same bits on
any x86 CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.executor.sampling.logit_bias import apply_logit_bias
from kvserve.executor.sampling.penalties import apply_penalties
from kvserve.executor.sampling.row_softmax import log_softmax, softmax
from kvserve.executor.sampling.seeded_noise import row_key, uniform_noise, uniform_noise_at
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
    banned = apply_logit_bias(logits, [p.logit_bias for p in params])
    if masks is not None:
        apply_token_masks(logits, masks, may_empty=held_back or banned)

    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(random_rows) == n:
        chosen = _draw(logits, params, [row_key(s.seed, s.output_len) for s in seqs])
    elif random_rows:
        chosen = logits.argmax(dim=-1)
        rows = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        keys = [row_key(seqs[i].seed, seqs[i].output_len) for i in random_rows]
        drawn = _draw(logits.index_select(0, rows), [params[i] for i in random_rows], keys)
        chosen = chosen.index_copy(0, rows, drawn)
    else:
        chosen = logits.argmax(dim=-1)
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
    """Temperature-scaled logits with tokens outside top-k / top-p / min-p set to -inf.

    Each filter runs only on the rows that ask for it, so a row's result never depends on
    what shares its batch: a row at top_p = 1.0 sorted beside a top_p = 0.9 row would lose
    tail tokens whose float32 cumulative mass rounds past 1.0.
    """
    _n, vocab = logits.shape
    device = logits.device
    scaled = logits / torch.tensor(temperature, dtype=logits.dtype, device=device)[:, None]
    min_p_rows = [i for i, m in enumerate(min_p) if m > 0.0]
    if min_p_rows:
        scaled = _on_rows(scaled, min_p_rows, lambda sub: _min_p(sub, [min_p[i] for i in min_p_rows]))
    sorted_rows = [i for i in range(len(top_k)) if 0 < top_k[i] < vocab or top_p[i] < 1.0]
    if sorted_rows:
        ks = [top_k[i] if 0 < top_k[i] < vocab else vocab for i in sorted_rows]
        ps = [top_p[i] for i in sorted_rows]
        scaled = _on_rows(scaled, sorted_rows, lambda sub: _top_k_top_p(sub, ks, ps))
    return scaled


def _on_rows(x: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`fn` applied to the given rows of `x` only (the whole tensor, without a gather, when all are given)."""
    if len(rows) == x.shape[0]:
        return fn(x)
    index = torch.tensor(rows, dtype=torch.long, device=x.device)
    return x.index_copy(0, index, fn(x.index_select(0, index)))


def _min_p(scaled: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    probs = softmax(scaled)
    floor = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None] * probs.max(-1, keepdim=True).values
    return scaled.masked_fill(probs < floor, float("-inf"))


def _top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep each row's `top_k` largest, then the smallest prefix of those whose mass reaches `top_p`.

    A row at top_p >= 1.0 is cut by rank alone: its threshold is infinite, since a float32
    cumulative sum can exceed 1.0 in the tail. The sort is stable, so ties fall the same way every time.
    """
    vocab = scaled.shape[1]
    device = scaled.device
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=device)[None, :]
    drop = rank >= torch.tensor(top_k, device=device)[:, None]
    sorted_probs = softmax(sorted_logits.masked_fill(drop, float("-inf")))
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    threshold = [p if p < 1.0 else float("inf") for p in top_p]
    drop |= mass_before > torch.tensor(threshold, dtype=sorted_probs.dtype, device=device)[:, None]
    drop[:, 0] = False
    return scaled.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


SPARSE_ROW_SHARE = 4
"""A row with fewer than vocab / SPARSE_ROW_SHARE samplable tokens (after filters and masks) hashes
noise for those tokens only: a grammar or top-k row pays for tens of hashes, not the vocabulary.
The choice is the row's own and both ways give the same bits, so no row depends on its batch."""


def _draw(logits: torch.Tensor, params: list, keys: list[int]) -> torch.Tensor:
    """The exponential race: argmax of scaled - log(E), E = -log(U), U strictly inside (0, 1).

    E is finite and positive for every U (`seeded_noise.UNIFORM_BITS`), so the noise is finite;
    a token filtered or masked to -inf never gets a score, and a score that is not finite is
    -inf, so no excluded token can win the argmax.
    """
    scaled = filtered_logits(
        logits,
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
    )
    n, vocab = scaled.shape
    allowed = scaled > float("-inf")
    counts = allowed.sum(-1, dtype=torch.int32)  # int32: a plain bool sum widens a copy to int64 first
    sparse = (counts * SPARSE_ROW_SHARE < vocab).tolist()
    chosen = torch.zeros(n, dtype=torch.long, device=scaled.device)
    sparse_rows = [i for i in range(n) if sparse[i]]
    dense_rows = [i for i in range(n) if not sparse[i]]
    if sparse_rows:
        index = torch.tensor(sparse_rows, dtype=torch.long, device=scaled.device)
        sub = allowed if len(sparse_rows) == n else allowed.index_select(0, index)
        sub_rows, tokens = sub.nonzero(as_tuple=True)
        rows = sub_rows if len(sparse_rows) == n else index.index_select(0, sub_rows)
        scores = _race(scaled[rows, tokens], uniform_noise_at(keys, rows, tokens))
        _first_max_per_row(chosen, rows, tokens, scores)
    if dense_rows:
        index = torch.tensor(dense_rows, dtype=torch.long, device=scaled.device)
        noise = uniform_noise([keys[i] for i in dense_rows], vocab, scaled.device)
        chosen.index_copy_(0, index, _race(scaled.index_select(0, index), noise).argmax(dim=-1))
    return chosen


def _first_max_per_row(chosen: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> None:
    """Write into `chosen` each listed row's highest-scoring token, the lowest token id on a tie:
    a dense row's argmax, over the row's listed (samplable) tokens only. `rows` is sorted."""
    if rows.numel() == 0:
        return
    best = torch.full(chosen.shape, float("-inf"), dtype=scores.dtype, device=scores.device)
    best.scatter_reduce_(0, rows, scores, "amax")
    hit = scores == best.index_select(0, rows)
    position = torch.arange(rows.numel(), device=rows.device)
    first = torch.full_like(chosen, rows.numel()).scatter_reduce_(0, rows[hit], position[hit], "amin")
    present = first < rows.numel()
    chosen[present] = tokens.index_select(0, first[present])


def _race(scaled: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each token's score in the race: -inf wherever it is not finite (a masked token's among them)."""
    scores = scaled - torch.log(-torch.log(uniforms))
    return scores.masked_fill(~scores.isfinite(), float("-inf"))


def _outputs(logits: torch.Tensor, chosen: torch.Tensor, seqs: list[SequenceState]) -> list[SampledToken]:
    token_ids = chosen.tolist()
    outputs = [SampledToken(seq_id=s.seq_id, token_id=t) for s, t in zip(seqs, token_ids)]
    wants = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    if not wants:
        return outputs
    rows = torch.tensor(wants, dtype=torch.long, device=logits.device)
    logprobs = log_softmax(logits.index_select(0, rows))
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
