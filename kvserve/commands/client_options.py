"""Options and plumbing shared by the client commands (`generate`, `chat`, `stats`).

Sampling flags mirror api.proto's SamplingParams. They are left unset unless given, so the
server's defaults (protos/sampling.py) apply; `--help` names those defaults.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protos import defaults
from protos.sampling import SamplingParams

if TYPE_CHECKING:
    from clients import Client

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


def add_sampling_options(parser: argparse.ArgumentParser, *, max_tokens_default: int | None = None) -> None:
    """Sampling flags; `max_tokens_default` lets `chat` send a longer limit than the server's."""
    server = SamplingParams()
    group = parser.add_argument_group("sampling (unset flags take the server's defaults)")
    for name, kind, text in _SAMPLING_FLAGS:
        server_default = getattr(server, name)
        if name == "max_tokens" and max_tokens_default is not None:
            group.add_argument("--max-tokens", type=int, default=max_tokens_default, help=text)
            continue
        shown = "off" if server_default is None else server_default
        group.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=argparse.SUPPRESS,
            help=f"{text} (default: server's, {shown})",
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


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Only the sampling flags that were given, as client keyword arguments."""
    return {name: getattr(args, name) for name in SAMPLING_DESTS if hasattr(args, name)}


def request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"priority": args.priority, "cache_salt": args.cache_salt, "request_id": args.request_id}


def make_client(args: argparse.Namespace) -> Client:
    from clients import Client
    from clients.channel import host_port

    token = args.token
    if args.token_file is not None:
        token = args.token_file.read_text().strip()
    root_certificates = args.tls_ca.read_bytes() if args.tls_ca is not None else None
    return Client(
        host_port(args.host, args.port), token=token, root_certificates=root_certificates, timeout_s=args.timeout
    )


def report_error(command: str, error: BaseException) -> int:
    """One line on stderr naming the gRPC status (or the local problem); returns the exit code."""
    from clients import KVServeError

    if isinstance(error, KVServeError):
        print(f"kvserve {command}: {error.code.name}: {error.details}", file=sys.stderr)
    else:
        print(f"kvserve {command}: {type(error).__name__}: {error}", file=sys.stderr)
    return 1
