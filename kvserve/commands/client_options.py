"""Options and plumbing shared by the client commands (`generate`, `chat`, `stats`).

Sampling flags mirror api.proto's SamplingParams. They are left unset unless given, so the
server's defaults apply (the model's generation_config.json where it sets one, else
protos/sampling.py); `--help` names those defaults. Chat (`kvserve chat`, `generate --chat`)
sends `CHAT_SAMPLING` for the flags it names that were not given, unless --server-defaults.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.config import defaults
from kvserve.protos.sampling import SamplingParams

if TYPE_CHECKING:
    from kvserve.clients import Client

# (flag, type, help) for each scalar SamplingParams field; the list ones are added separately.
_SAMPLING_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("temperature", float, "sampling temperature; 0 = greedy"),
    ("top_k", int, "keep the k most likely tokens; -1 = off"),
    ("top_p", float, "nucleus sampling mass in (0, 1]; 1 = off"),
    ("min_p", float, "drop tokens below min_p x the top probability; 0 = off"),
    ("repetition_penalty", float, "divide logits of seen tokens; 1 = off"),
    ("presence_penalty", float, "subtract from logits of generated tokens, in [-2, 2]"),
    ("frequency_penalty", float, "subtract per occurrence of generated tokens, in [-2, 2]"),
    ("seed", int, "fixed seed for reproducible samples"),
    ("n", int, f"completions per prompt, at most {defaults.MAX_N}"),
    ("max_tokens", int, "most tokens to generate"),
    ("min_tokens", int, "ignore eos and stop token ids before this many tokens"),
    ("logprobs", int, f"return the sampled token's logprob plus the top k alternatives (k <= {defaults.MAX_LOGPROBS})"),
)
SAMPLING_DESTS = tuple(name for name, _, _ in _SAMPLING_FLAGS) + ("stop", "stop_token_ids", "ignore_eos")
CHAT_SAMPLING: dict[str, float | int] = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 256}
"""Chat's own defaults: a conversational temperature and nucleus, and a reply length that ends a
turn. The server's (temperature 1.0, 16 tokens, or a model's) suit completions, not a dialogue."""


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connection")
    group.add_argument("--host", default=defaults.GRPC_HOST, help="kvserve gRPC host")
    group.add_argument("--port", type=int, default=defaults.GRPC_PORT, help="kvserve gRPC port")
    token = group.add_mutually_exclusive_group()
    token.add_argument("--token", default=None, help="bearer token sent as `authorization: Bearer TOKEN`")
    token.add_argument(
        "--token-file", type=Path, default=None, help="read the bearer token from this file (keeps it out of `ps`)"
    )
    group.add_argument(
        "--tls-ca",
        type=Path,
        default=None,
        help="PEM file of root certificates; connects with TLS when given (plaintext otherwise)",
    )
    group.add_argument(
        "--timeout", type=float, default=None, help="deadline of each call in seconds; None = no deadline"
    )


def add_sampling_options(parser: argparse.ArgumentParser, *, chat: str | None = None) -> None:
    """Sampling flags. `chat`: None = unset flags take the server's defaults; "" = the command
    always chats and unset CHAT_SAMPLING flags take those values; any other text names the
    condition under which they do (generate: "with --chat")."""
    server = SamplingParams()
    title = "sampling (unset flags take the server's defaults; a model's generation_config.json may set its own)"
    if chat == "":
        title = "sampling (unset flags take chat's defaults where shown, else the server's; see --server-defaults)"
    elif chat is not None:
        title = f"sampling ({chat}, unset flags take chat's defaults where shown; otherwise the server's)"
    group = parser.add_argument_group(title)
    for name, kind, text in _SAMPLING_FLAGS:
        server_default = getattr(server, name)
        shown = f"server's, {'off' if server_default is None else server_default}"
        if chat is not None and name in CHAT_SAMPLING:
            shown = f"{CHAT_SAMPLING[name]}" if not chat else f"{CHAT_SAMPLING[name]} {chat}, else {shown}"
        group.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=argparse.SUPPRESS, help=f"{text} (default: {shown})"
        )
    if chat is not None:
        names = ", ".join(f"--{n.replace('_', '-')} {v}" for n, v in CHAT_SAMPLING.items())
        group.add_argument(
            "--server-defaults",
            action="store_true",
            help=f"send only the sampling flags given, so the server's defaults apply to the rest "
            f"(instead of chat's {names})",
        )
    group.add_argument(
        "--stop",
        action="append",
        default=argparse.SUPPRESS,
        metavar="TEXT",
        help="stop string, trimmed from the output; repeatable (default: none)",
    )
    group.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        action="append",
        type=int,
        default=argparse.SUPPRESS,
        metavar="ID",
        help="stop token id; repeatable (default: none)",
    )
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        default=argparse.SUPPRESS,
        help="keep generating past the end-of-sequence token (default: off)",
    )


def add_request_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request")
    group.add_argument("--priority", type=int, default=0, help="lower is served first")
    group.add_argument(
        "--cache-salt", default="", help="separate prefix-cache namespace within your tenant ('' = the tenant's own)"
    )
    group.add_argument("--request-id", default=None, help="request id; None = the server assigns one")
    group.add_argument(
        "--model",
        default="",
        metavar="NAME",
        help="a LoRA adapter the server loaded (kvserve serve --lora NAME=PATH); '' = the base model",
    )


def add_structured_options(parser: argparse.ArgumentParser) -> None:
    """One structured-output constraint (api.proto StructuredOutput); the server refuses a bad spec by name."""
    group = parser.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema", default=None, metavar="SCHEMA", help="a JSON Schema: inline JSON, or @FILE to read one"
    )
    group.add_argument("--json-object", action="store_true", help="any JSON object")
    group.add_argument("--regex", default=None, help="the whole output matches this regular expression")
    group.add_argument(
        "--choice", action="append", default=None, metavar="TEXT", help="the output is one of these (repeat the flag)"
    )
    group.add_argument("--grammar", default=None, metavar="LARK", help="a Lark grammar: inline, or @FILE")


def structured_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The constraint flag given, as the clients' `structured` dict (None: free text)."""
    if args.json_schema is not None:
        return {"json_schema": _inline_or_file(args.json_schema)}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    if args.grammar is not None:
        return {"grammar": _inline_or_file(args.grammar)}
    return None


def _inline_or_file(value: str) -> str:
    return Path(value[1:]).read_text(encoding="utf-8") if value.startswith("@") else value


def sampling_from_args(args: argparse.Namespace, *, chat: bool = False) -> dict[str, Any]:
    """The sampling flags that were given, as client keyword arguments; with `chat`, the chat
    defaults fill the ones not given (unless --server-defaults)."""
    given = {name: getattr(args, name) for name in SAMPLING_DESTS if hasattr(args, name)}
    if chat and not getattr(args, "server_defaults", False):
        return {**CHAT_SAMPLING, **given}
    return given


def request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "priority": args.priority,
        "cache_salt": args.cache_salt,
        "request_id": args.request_id,
        "model": args.model,
    }


def make_client(args: argparse.Namespace) -> Client:
    from kvserve.clients import Client
    from kvserve.clients.channel import host_port

    token = args.token
    if args.token_file is not None:
        token = args.token_file.read_text().strip()
    root_certificates = args.tls_ca.read_bytes() if args.tls_ca is not None else None
    return Client(
        host_port(args.host, args.port), token=token, root_certificates=root_certificates, timeout_s=args.timeout
    )


def report_error(command: str, error: BaseException) -> int:
    """One line on stderr naming the gRPC status (or the local problem); returns the exit code."""
    from kvserve.clients import KVServeError

    if isinstance(error, KVServeError):
        print(f"kvserve {command}: {error.code.name}: {error.details}", file=sys.stderr)
    else:
        print(f"kvserve {command}: {type(error).__name__}: {error}", file=sys.stderr)
    return 1
