"""`kvserve generate "PROMPT"`: one request, streamed to the terminal (or one JSON object).

With --chat (or --system) unset sampling flags take chat's defaults (client_options.CHAT_SAMPLING),
as in `kvserve chat`; a plain prompt leaves them to the server. `--tool FILE.json` (implies --chat)
offers a function; the calls the model makes are printed as JSON lines after its text.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.commands.client_options import (
    add_connection_options,
    add_request_options,
    add_sampling_options,
    add_structured_options,
    make_client,
    report_error,
    request_from_args,
    sampling_from_args,
    structured_from_args,
)

if TYPE_CHECKING:
    from kvserve.clients import Completion

EXIT_INTERRUPTED = 130


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "generate",
        help="send one prompt and stream the completion",
        description="Send PROMPT to a running kvserve server and print the completion as it streams.\n"
        "With --chat, PROMPT is one user message rendered with the model's chat template.\n"
        "Exits 1 with the gRPC status on stderr when the call fails.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt text ('-' reads it from stdin)")
    parser.add_argument("--chat", action="store_true", help="send PROMPT as a user chat message")
    parser.add_argument("--system", default=None, help="system message to send before PROMPT (implies --chat)")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, finish_reason, usage, ...) instead of streaming",
    )
    parser.add_argument("--verbose", action="store_true", help="print finish reason and usage to stderr")
    tools = parser.add_argument_group("tool calling (implies --chat)")
    tools.add_argument(
        "--tool",
        action="append",
        default=None,
        metavar="FILE.json",
        help='a function the model may call: {"name", "description", "parameters": JSON Schema} '
        '(or OpenAI\'s {"type": "function", "function": {...}}); repeat for several',
    )
    tools.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="auto (default with --tool), required, none, or a function's name to force that function",
    )
    tools.add_argument("--no-parallel-tool-calls", action="store_true", help="at most one call")
    add_connection_options(parser)
    add_sampling_options(parser, chat="with --chat")
    add_structured_options(parser)
    add_request_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.clients import KVServeError

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    chat = args.chat or args.system is not None or args.tool is not None
    kwargs: dict[str, Any] = {**sampling_from_args(args, chat=chat), **request_from_args(args)}
    try:
        structured = structured_from_args(args)
        kwargs.update(tool_kwargs(args))
    except (OSError, ValueError) as error:  # an unreadable @FILE or tool file
        return report_error("generate", error)
    if structured is not None:
        kwargs["structured"] = structured
    if chat:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        kwargs["messages"] = messages + [{"role": "user", "content": prompt}]
    else:
        kwargs["prompt"] = prompt
    try:
        with make_client(args) as client:
            if args.json or kwargs.get("n", 1) > 1:
                completion = client.generate(**kwargs)
                if args.json:
                    print(json.dumps(completion_json(completion, with_logprobs="logprobs" in kwargs)))
                else:
                    print_choices(completion)
            else:
                streamed = stream_to_stdout(client, kwargs)
                if streamed is None:
                    return EXIT_INTERRUPTED
                completion = streamed
                for call in completion.tool_calls:
                    print(json.dumps({"tool_call": asdict(call)}))
    except (KVServeError, OSError) as error:
        return report_error("generate", error)
    if args.verbose:
        print(usage_line(completion), file=sys.stderr)
    return 0


def tool_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--tool files and --tool-choice as the clients' keywords; ValueError names a bad file."""
    if args.tool is None:
        if args.tool_choice is not None or args.no_parallel_tool_calls:
            raise ValueError("--tool-choice and --no-parallel-tool-calls need --tool")
        return {}
    tools = []
    for path in args.tool:
        try:
            tools.append(json.loads(Path(path).read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--tool {path}: not valid JSON: {exc}") from None
        if not isinstance(tools[-1], dict) or "name" not in tools[-1].get("function", tools[-1]):
            raise ValueError(f"--tool {path}: needs an object with a function name")
    kwargs: dict[str, Any] = {"tools": tools}
    choice = args.tool_choice
    if choice is not None:
        kwargs["tool_choice"] = choice if choice in ("auto", "required", "none") else {"function": choice}
    if args.no_parallel_tool_calls:
        kwargs["parallel_tool_calls"] = False
    return kwargs


def stream_to_stdout(client: Any, kwargs: dict[str, Any]) -> Completion | None:
    """Print text deltas as they arrive; None if the user interrupted (the request is cancelled)."""
    from kvserve.clients.request_builder import CompletionAssembler

    assembler = CompletionAssembler(n=1)
    stream = client.stream(**kwargs)
    try:
        for chunk in stream:
            assembler.add(chunk)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stream.cancel()
        sys.stdout.write("\n")
        return None
    finally:
        stream.cancel()
    sys.stdout.write("\n")
    return assembler.result()


def print_choices(completion: Completion) -> None:
    for choice in completion.choices:
        print(f"--- completion {choice.index} ({choice.finish_reason}) ---")
        print(choice.text)


def usage_line(completion: Completion) -> str:
    u = completion.usage
    return (
        f"[{completion.request_id}] finish={completion.finish_reason} prompt={u.prompt_tokens} "
        f"cached={u.cached_tokens} completion={u.completion_tokens} queue={u.queue_time_s:.3f}s "
        f"ttft={u.ttft_s:.3f}s e2e={u.e2e_s:.3f}s"
    ) + (
        f" drafts={u.speculative.accepted_tokens}/{u.speculative.proposed_tokens} accepted"
        if u.speculative is not None
        else ""
    )


def completion_json(completion: Completion, *, with_logprobs: bool) -> dict[str, Any]:
    """The --json object: index 0's fields at the top level, every index under `choices` when n > 1."""

    def one(c: Completion) -> dict[str, Any]:
        item: dict[str, Any] = {
            "index": c.index,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "usage": {k: v for k, v in asdict(c.usage).items() if v is not None},  # speculative: only when on
            "token_ids": c.token_ids,
        }
        if c.tool_calls:
            item["tool_calls"] = [asdict(call) for call in c.tool_calls]
        if with_logprobs:
            item["logprobs"] = [
                {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]} for lp in c.logprobs
            ]
        return item

    result = {"request_id": completion.request_id, **one(completion)}
    del result["index"]
    if len(completion.choices) > 1:
        result["choices"] = [one(c) for c in completion.choices]
    return result
