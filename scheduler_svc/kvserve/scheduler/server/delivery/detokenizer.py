"""Incremental detokenization and stop-string matching for one completion.

Decoding token by token is wrong for byte-level tokenizers: one character (a CJK
ideograph, an emoji) can span several tokens, and decoding a lone piece yields U+FFFD.
`IncrementalDetokenizer` therefore re-decodes a short window of recent tokens and only
releases text once it no longer ends in an incomplete character; the window start moves
forward each time text is released, so the work per token stays constant.

`StopStringMatcher` sits behind it. A stop string can be spread over several tokens, so
the matcher holds back the longest tail of the text that could still grow into a stop
string; when one completes, the text up to it is released and the rest is dropped.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas that concatenate to `decode(all ids)`."""

    def __init__(self, decoder: Decoder, prompt_tail: list[int] | None = None) -> None:
        self._decoder = decoder
        # A few prompt tokens give the decoder context for the first output token
        # (e.g. a leading space is kept instead of stripped); their own text is never emitted.
        self._ids: list[int] = list(prompt_tail or [])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty while a character is split)."""
        self._ids.extend(token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """Release whatever is held back, even an incomplete character (as U+FFFD)."""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decoder.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decoder.decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""  # a character is still split across tokens: wait for its remaining bytes
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


class StopStringMatcher:
    """Find stop strings across text deltas; hold back text that may still become one."""

    def __init__(self, stop: tuple[str, ...] | list[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        self.matched: str | None = None

    @property
    def has_stops(self) -> bool:
        return bool(self._stop)

    def push(self, delta: str) -> str:
        """Return the text that is safe to emit. After a match, returns the text before it, then nothing."""
        if self.matched is not None:
            return ""
        if not self._stop:
            return delta
        text = self._held + delta
        first_index, first_stop = -1, None
        for stop in self._stop:
            index = text.find(stop)
            if index != -1 and (first_index == -1 or index < first_index):
                first_index, first_stop = index, stop
        if first_stop is not None:
            self.matched = first_stop
            self._held = ""
            return text[:first_index]
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The completion ended without a stop string: release what was held back."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


class CompletionText:
    """Detokenizer plus stop-string matcher for one completion: tokens in, visible text out."""

    def __init__(self, decoder: Decoder, stop: tuple[str, ...], prompt_tail: list[int] | None = None) -> None:
        self._detokenizer = IncrementalDetokenizer(decoder, prompt_tail)
        self._matcher = StopStringMatcher(stop)

    @property
    def stopped(self) -> bool:
        """True once a stop string completed: the caller ends the completion; later tokens add no text."""
        return self._matcher.matched is not None

    def push(self, token_ids: list[int]) -> str:
        return self._matcher.push(self._detokenizer.push(token_ids))

    def push_until_stop(self, token_ids: list[int]) -> tuple[str, int]:
        """Push tokens one at a time until a stop string completes: (text, tokens taken).

        Several tokens arrive at once after verified draft tokens (speculative decoding). Plain
        decoding would have ended the completion at the token that completed a stop string, so the
        tokens after it must not reach the client; with no stop strings this is `push`.
        """
        if not self._matcher.has_stops or len(token_ids) < 2:
            return self.push(token_ids), len(token_ids)
        parts = []
        for taken, token in enumerate(token_ids, start=1):
            parts.append(self.push([token]))
            if self.stopped:
                return "".join(parts), taken
        return "".join(parts), len(token_ids)

    def finish(self) -> str:
        out = self._matcher.push(self._detokenizer.flush())
        out += self._matcher.flush()
        return out
