"""What one request's client sees: scheduler outputs become text, chunks and usage on its stream.

Split from the engine loop along the line between *when* things run (the loop, the
scheduler, the executor link: engine.py) and *what a request receives* (this module).
Nothing here touches the scheduler: a completed stop string is only reported back, and
the engine lets the scheduler go of the sequence at the next step boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from kvserve.protos.stop_rules import FinishReason
from kvserve.scheduler.core import BlockCounts, SequenceOutput
from kvserve.scheduler.server.delivery.detokenizer import CompletionText, Decoder
from kvserve.scheduler.server.delivery.request_stream import (
    CompletionChunk,
    FailureKind,
    RequestFailed,
    RequestStream,
    Usage,
)
from kvserve.scheduler.server.intake.request_parsing import ValidatedRequest
from kvserve.scheduler.server.observability.metrics import ServerMetrics
from kvserve.scheduler.server.security.namespaces import client_request_id
from kvserve.scheduler.server.tools.tool_formats import FORMATS, ToolCallParser
from kvserve.scheduler.server.tools.tool_use import ToolCall

log = structlog.get_logger(__name__)

_TOKEN_FINISHES = (FinishReason.STOP, FinishReason.EOS)
_NO_BLOCKS = BlockCounts()


@dataclass(slots=True)
class Completion:
    """One of a request's n completions, as far as its client has been told."""

    text: CompletionText
    tools: ToolCallParser | None = None
    """Takes tool calls out of the text, when the request may call."""
    finished: bool = False
    last_token_time: float | None = None
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class ActiveRequest:
    """A request from submit until its stream closes; the engine owns the queue bookkeeping around it."""

    request_id: str
    stream: RequestStream
    completions: list[Completion]
    num_prompt_tokens: int
    arrival: float
    clock: Callable[[], float]
    metrics: ServerMetrics | None
    log: structlog.typing.FilteringBoundLogger
    started: bool = False
    usage: list[Usage | None] = field(default_factory=list)
    stop_pending: bool = False
    """A stop string ended a completion and the scheduler still runs its sequence until the next boundary."""
    executor_losses: int = 0
    """Executor losses this request lived through; past the limit it fails instead of recomputing."""
    blocks: BlockCounts | None = None
    """The scheduler's block accounting for this request (from its outputs); final by the time it closes."""
    lora_name: str = ""
    """The LoRA adapter it runs under ("": the base model)."""

    @classmethod
    def create(
        cls,
        request: ValidatedRequest,
        stream: RequestStream,
        decoder: Decoder,
        prompt_tail: list[int],
        arrival: float,
        clock: Callable[[], float],
        metrics: ServerMetrics | None,
    ) -> ActiveRequest:
        """`request` as its stream will see it: n completions, each with its stop strings and tool parser."""
        tools = request.tools
        n = request.sampling.n
        completions = [
            Completion(
                CompletionText(decoder, request.sampling.stop, prompt_tail),
                FORMATS[tools.format].parser(tools) if tools is not None else None,
            )
            for _ in range(n)
        ]
        return cls(
            request_id=request.request_id,
            stream=stream,
            completions=completions,
            num_prompt_tokens=len(request.prompt_token_ids),
            arrival=arrival,
            clock=clock,
            metrics=metrics,
            log=log.bind(request_id=request.request_id),
            usage=[None] * n,
            lora_name=request.lora_name,
        )

    @property
    def all_finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def accepts(self, index: int) -> bool:
        """False for an unknown completion or one already finished (e.g. a token sampled after its stop string)."""
        return 0 <= index < len(self.completions) and not self.completions[index].finished

    def deliver(self, output: SequenceOutput) -> bool:
        """Put one output on the stream; True if a stop string just finished its completion.

        A stop-string finish takes its usage now, so `completion_tokens` counts the tokens up
        to the match and not the token the executor may already be sampling for it. A
        completion that may make only one tool call ends the same way once it has made it.
        """
        completion = self.completions[output.index]
        if self.blocks is None:
            self.blocks = output.blocks
        if output.finish_reason is FinishReason.INTERNAL:
            self._fail_internal(completion, output.error)
            return False
        token_ids = list(output.new_token_ids)
        logprobs = list(output.logprobs or [])
        num_output_tokens = output.num_output_tokens
        finish = output.finish_reason
        # The token that finished a sequence (eos or a stop token id) is not part of the text.
        text_ids = token_ids[:-1] if finish in _TOKEN_FINISHES and token_ids else token_ids
        text, taken = completion.text.push_until_stop(text_ids)
        stopped = completion.text.stopped and (finish is None or taken < len(token_ids))
        if stopped and taken < len(token_ids):
            # Tokens after the stop string (from verified drafts) are cut, as plain decoding never made them.
            num_output_tokens -= len(token_ids) - taken
            del token_ids[taken:], logprobs[taken:]
        calls: list[ToolCall] = []
        if completion.tools is not None:
            text = self._take_calls(completion.tools, text, calls)
            stopped = stopped or (finish is None and completion.tools.done)
        if stopped:
            finish = FinishReason.STOP
        usage = None
        if finish is not None:
            tail = completion.text.finish()
            if completion.tools is not None:
                tail = self._take_calls(completion.tools, tail, calls)
                last = completion.tools.finish()
                tail += last.content
                calls.extend(last.calls)
            text += tail
            completion.finished = True
            completion.finish_reason = finish
            usage = Usage(
                prompt_tokens=output.num_prompt_tokens,
                completion_tokens=num_output_tokens,
                cached_tokens=output.num_cached_tokens,
                queue_time_s=output.queue_time_s or 0.0,
                ttft_s=output.ttft_s or 0.0,
                e2e_s=self.clock() - self.arrival,
                drafts=output.drafts,
                host_cached_tokens=output.num_host_cached_tokens,
                disk_cached_tokens=output.num_disk_cached_tokens,
            )
            self.usage[output.index] = usage
        if self.metrics is not None and token_ids:
            now = self.clock()
            if completion.last_token_time is None:
                if output.ttft_s is not None:
                    self.metrics.observe_first_token(output.ttft_s)
            else:
                self.metrics.observe_token_gap(now - completion.last_token_time)
            completion.last_token_time = now
        self.stream.put(
            CompletionChunk(
                index=output.index,
                token_ids=token_ids,
                text=text,
                logprobs=logprobs,
                finish_reason=finish,
                usage=usage,
                tool_calls=calls,
            )
        )
        return stopped

    def _fail_internal(self, completion: Completion, error: str | None) -> None:
        """A bug ended the completion (the executor broke its contract; the scheduler has logged it): the
        request fails with an internal error naming the client's request id, which the server log's lines
        carry too; the engine aborts its other completions."""
        completion.finished = True
        completion.finish_reason = FinishReason.INTERNAL
        message = f"internal error in request {client_request_id(self.request_id)}: {error or 'unknown'}"
        self.stream.fail(RequestFailed(FailureKind.INTERNAL, message))

    @staticmethod
    def _take_calls(parser: ToolCallParser, text: str, calls: list[ToolCall]) -> str:
        parsed = parser.push(text)
        calls.extend(parsed.calls)
        return parsed.content

    def close(self, reason: FinishReason | None) -> None:
        """End the stream and write the request's one canonical log line; `reason` covers unfinished completions.

        The engine closes a request only once the scheduler has ended all its sequences, so the
        block counts are final: blocks_allocated + blocks_hit - blocks_copied == blocks_freed.
        """
        self.stream.close()
        usages = [u for u in self.usage if u is not None]
        first = usages[0] if usages else None
        duration_s = self.clock() - self.arrival
        # None only if no output ever reached it (failed by fail_all before its first token).
        blocks = self.blocks if self.blocks is not None else _NO_BLOCKS
        if self.metrics is not None:
            for completion in self.completions:
                self.metrics.observe_finished(
                    completion.finish_reason or reason or FinishReason.ABORT,
                    duration_s,
                    first.queue_time_s if first else None,
                )
        self.log.info(
            "request_finished",
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=sum(u.completion_tokens for u in usages),
            cached_tokens=first.cached_tokens if first else 0,
            queue_time_s=round(first.queue_time_s, 6) if first else None,
            ttft_s=round(min(u.ttft_s for u in usages), 6) if usages else None,
            duration_s=round(duration_s, 6),
            finish_reason=",".join(
                sorted({(c.finish_reason or reason or FinishReason.ABORT).value for c in self.completions})
            ),
            n=len(self.completions),
            blocks_hit=blocks.hit,
            blocks_allocated=blocks.allocated,
            blocks_copied=blocks.copied,
            blocks_freed=blocks.freed,
        )
