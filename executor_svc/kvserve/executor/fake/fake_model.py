"""The fake model: which token follows a context, and a fake draft model's proposals.

A draw is a function of the context's last tokens (read back from the shadow KV by the caller),
its length, the sequence's LoRA adapter and, when sampling, the seed
(`kvserve.executor.fake.tokens`); on top of it come eos (as the shared stop rules allow), copying
(`--copy-period`), a structured-output mask, `logit_bias`, and the tests' options
(`--scripted-replies`, `--fault-violate-token-masks`). It is apart from `executor.FakeExecutor`,
which checks and applies plans, so the model's choices read in one place.
"""

from __future__ import annotations

from kvserve.executor.fake.faults import forbidden_token
from kvserve.executor.fake.sequences import FakeSequence
from kvserve.executor.fake.tokens import (
    allowed_token_ids,
    biased_token,
    context_hash,
    copied_token,
    copies,
    hash_ints,
    pick_allowed,
    pick_token,
    wants_eos,
)
from kvserve.executor.fake.vocabulary import Vocabulary
from kvserve.protos.stop_rules import stop_token_ids, stop_tokens_allowed


class FakeModel:
    """Draws the next token of a sequence's context; proposes drafts as a fake draft model."""

    def __init__(
        self,
        vocab: Vocabulary,
        *,
        context_window: int,
        eos_probability: float,
        copy_period: int,
        fault_violate_token_masks: bool,
    ) -> None:
        self.vocab = vocab
        self.context_window = context_window
        self._eos_probability = eos_probability
        self._copy_period = copy_period
        self._fault_violate_token_masks = fault_violate_token_masks
        self._samplable_set = frozenset(vocab.samplable)

    def draw(self, seq: FakeSequence, context: list[int], window: list[int], mask: bytes | None) -> tuple[int, int]:
        """(the token that follows `context`, the draw's hash): a function of the context's last
        tokens (`window`), its length, the sequence's adapter and, when sampling, the seed."""
        length = len(context)
        greedy = seq.sampling.temperature == 0.0
        h = context_hash(window, length, seq.seed, greedy, seq.lora_salt)
        may_end = self.may_end_by_eos(seq, length - seq.prompt_len) and wants_eos(h, self._eos_probability)
        if seq.script is not None or (mask is not None and self._fault_violate_token_masks):
            chosen = self._test_draw(seq, length, h, mask)
            if chosen is not None:
                return chosen, h
        allowed = None
        if mask is None:
            token = self.vocab.eos_token_ids[0] if may_end else None
            if token is None and copies(h, greedy):
                token = copied_token(context, self._copy_period, self._samplable_set)
            if token is None:
                token = pick_token(h, self.vocab.samplable)
        else:
            allowed = allowed_token_ids(mask)
            eos = next((t for t in self.vocab.eos_token_ids if t in allowed), None)
            token = eos if may_end and eos is not None else pick_allowed(h, allowed, self._samplable_set)
        if seq.sampling.logit_bias:
            held_back = (
                frozenset()
                if stop_tokens_allowed(seq.sampling, length - seq.prompt_len)
                else stop_token_ids(seq.sampling, self.vocab.eos_token_ids)
            )
            within = None if allowed is None else frozenset(allowed)
            fallback = self.vocab.samplable if allowed is None else allowed
            token = biased_token(token, h, seq.sampling.logit_bias, within, fallback, held_back)
        return token, h

    def _test_draw(self, seq: FakeSequence, length: int, h: int, mask: bytes | None) -> int | None:
        """What the tests' options draw instead of the fake model, None where they leave the draw alone: a
        token the mask forbids (`--fault-violate-token-masks`), else the scripted reply's next token, or eos
        after its last, as far as the mask allows (`--scripted-replies`)."""
        allowed = None if mask is None else allowed_token_ids(mask)
        if allowed is not None and self._fault_violate_token_masks:
            forbidden = forbidden_token(h, allowed, self.vocab.samplable)
            if forbidden is not None:
                return forbidden
        if seq.script is None:
            return None
        position = length - seq.prompt_len
        if position < len(seq.script):
            token = seq.script[position]
        elif self.may_end_by_eos(seq, position):
            token = self.vocab.eos_token_ids[0]
        else:
            return None
        return token if allowed is None or token in allowed else None

    def propose(self, seq: FakeSequence, sampled: list[int], count: int) -> list[int]:
        """A fake draft model's proposals after this step's `sampled` tokens: the tokens this fake model
        would draw next, each wrong on purpose one time in four (by a hash of its context), so every
        accept length occurs."""
        context = seq.token_ids + sampled
        proposals: list[int] = []
        for _ in range(count):
            token, h = self.draw(seq, context, context[-self.context_window :], None)
            if hash_ints([h], 0xD4AF7, 0) % 4 == 0:
                token = pick_token(h >> 7, self.vocab.samplable)
            proposals.append(token)
            context = context + [token]
        return proposals

    def may_end_by_eos(self, seq: FakeSequence, num_output_before: int) -> bool:
        """eos may come only as the shared stop rules allow: not ignored, min_tokens reached."""
        return (
            bool(self.vocab.eos_token_ids)
            and not seq.sampling.ignore_eos
            and stop_tokens_allowed(seq.sampling, num_output_before)
        )
