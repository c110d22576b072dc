"""`kvserve chat`: an interactive, streaming, multi-turn chat.

Unset sampling flags take chat's own defaults (client_options.CHAT_SAMPLING: temperature
0.7, top_p 0.9, 256 tokens a reply), not the server's, which suit one-off completions.

The whole conversation is resent every turn. That is deliberate: the server's
prefix cache recognises the earlier turns and computes only the new ones (see the
`cached` count with --verbose), so the client stays stateless about KV.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvserve.commands.client_options import (
    add_connection_options,
    add_request_options,
    add_sampling_options,
    make_client,
    report_error,
    request_from_args,
    sampling_from_args,
)

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "chat",
        help="interactive multi-turn chat with streaming replies",
        description="Chat with the served model. Each turn resends the conversation so the prefix cache\n"
        "serves earlier turns. Commands: /reset starts over, /exit (or EOF, Ctrl-D) quits;\n"
        "Ctrl-C during a reply cancels that reply.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--system", default=None, help="system message that starts every conversation")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="after each reply, show prompt/cached/completion tokens and time to first token",
    )
    add_connection_options(parser)
    add_sampling_options(parser, chat="")
    add_request_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvserve.clients import KVServeError

    sampling = sampling_from_args(args, chat=True)
    request = request_from_args(args)
    interactive = sys.stdin.isatty()
    conversation = _fresh(args.system)
    try:
        with make_client(args) as client:
            while True:
                try:
                    line = input("you> " if interactive else "")
                except EOFError:
                    return 0
                except KeyboardInterrupt:
                    print(file=sys.stderr)
                    return 0
                text = line.strip()
                if not text:
                    continue
                if text in EXIT_COMMANDS:
                    return 0
                if text == RESET_COMMAND:
                    conversation = _fresh(args.system)
                    print("(conversation reset)", file=sys.stderr)
                    continue
                conversation.append({"role": "user", "content": line})
                reply = _stream_reply(
                    client, conversation, sampling, request, verbose=args.verbose, interactive=interactive
                )
                if reply is None:  # interrupted: forget the unanswered turn
                    conversation.pop()
                else:
                    conversation.append({"role": "assistant", "content": reply})
    except (KVServeError, OSError) as error:
        return report_error("chat", error)


def _fresh(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system is not None else []


def _stream_reply(
    client: Any,
    conversation: list[dict[str, str]],
    sampling: dict[str, Any],
    request: dict[str, Any],
    *,
    verbose: bool,
    interactive: bool,
) -> str | None:
    """Stream one assistant reply to stdout; None if Ctrl-C cancelled it."""
    parts: list[str] = []
    usage = None
    if interactive:
        sys.stdout.write("assistant> ")
    stream = client.stream(messages=list(conversation), **sampling, **request)
    try:
        for chunk in stream:
            if chunk.index != 0:
                continue
            parts.append(chunk.text)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            usage = chunk.usage or usage
    except KeyboardInterrupt:
        stream.cancel()
        print("\n(reply cancelled)", file=sys.stderr)
        return None
    finally:
        stream.cancel()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if verbose and usage is not None:
        print(
            f"[prompt {usage.prompt_tokens} tokens, cached {usage.cached_tokens}, "
            f"completion {usage.completion_tokens}, ttft {usage.ttft_s:.3f}s, total {usage.e2e_s:.3f}s]",
            file=sys.stderr,
        )
    return "".join(parts)
