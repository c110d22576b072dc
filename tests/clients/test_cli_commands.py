"""`kvserve generate`, `chat` and `stats` run as subprocesses against the scripted server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from kvserve.config import defaults

CLI_TIMEOUT_S = 60


def kvserve_argv() -> list[str]:
    """The installed console script when present (what users run), else `python -m kvserve`."""
    script = Path(sys.executable).with_name("kvserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvserve"]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "300"}  # no help wrapping mid-phrase
    return subprocess.run(
        [*kvserve_argv(), *args], input=stdin, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env
    )


def port_args(server) -> list[str]:
    return ["--host", "127.0.0.1", "--port", str(server.port)]


def test_generate_streams_text(scripted_server) -> None:
    result = run_cli(
        "generate",
        "hello there",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
        "--stop",
        "END",
        "--stop",
        "\n\n",
        "--stop-token-id",
        "7",
        "--seed",
        "5",
        "--priority",
        "2",
        "--cache-salt",
        "salt",
        "--request-id",
        "cli-1",
        *port_args(scripted_server),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == " w0 w1 w2\n"
    request = scripted_server.servicer.recorded.requests[0]
    assert request.text == "hello there" and request.WhichOneof("prompt") == "text"
    assert request.sampling.temperature == 0 and request.sampling.HasField("temperature")
    assert list(request.sampling.stop) == ["END", "\n\n"] and list(request.sampling.stop_token_ids) == [7]
    assert request.sampling.seed == 5 and not request.sampling.HasField("top_p")
    assert (request.priority, request.cache_salt, request.request_id) == (2, "salt", "cli-1")


def test_generate_reads_prompt_from_stdin(scripted_server) -> None:
    result = run_cli("generate", "-", "--max-tokens", "1", *port_args(scripted_server), stdin="from stdin")
    assert result.returncode == 0, result.stderr
    assert scripted_server.servicer.recorded.requests[0].text == "from stdin"


def test_generate_chat_sends_one_user_message(scripted_server) -> None:
    result = run_cli(
        "generate", "--chat", "What is the capital of France?", "--max-tokens", "1", *port_args(scripted_server)
    )
    assert result.returncode == 0, result.stderr
    request = scripted_server.servicer.recorded.requests[0]
    assert [(m.role, m.content) for m in request.chat.messages] == [("user", "What is the capital of France?")]
    # chat's own defaults fill what was not given; --max-tokens was
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.max_tokens) == (0.7, 0.9, 1)


def test_generate_plain_prompt_leaves_sampling_to_the_server(scripted_server) -> None:
    result = run_cli("generate", "hello", *port_args(scripted_server))
    assert result.returncode == 0, result.stderr
    sampling = scripted_server.servicer.recorded.requests[0].sampling
    assert not any(sampling.HasField(name) for name in ("temperature", "top_p", "max_tokens"))


def test_generate_json_shape(scripted_server) -> None:
    result = run_cli(
        "generate", "a b c d", "--json", "--max-tokens", "2", "--logprobs", "1", *port_args(scripted_server)
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["text"] == " w0 w1" and body["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 2
    assert set(body["usage"]) == {
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "queue_time_s",
        "ttft_s",
        "e2e_s",
    }
    assert body["token_ids"] == [1000, 1001]
    assert body["logprobs"][0] == {"token_id": 1000, "logprob": -0.5, "top": [[1000, -1.0]]}
    assert "choices" not in body


def test_generate_json_n_choices(scripted_server) -> None:
    result = run_cli("generate", "p", "--json", "--n", "2", "--max-tokens", "1", *port_args(scripted_server))
    body = json.loads(result.stdout)
    assert [c["token_ids"] for c in body["choices"]] == [[1000], [1100]]
    assert [c["index"] for c in body["choices"]] == [0, 1]


def test_generate_error_exit_code_and_one_line(scripted_server) -> None:
    result = run_cli(
        "generate", "error:INVALID_ARGUMENT:sampling.top_p: must be in (0, 1], got 1.5", *port_args(scripted_server)
    )
    assert result.returncode == 1
    assert result.stderr.strip() == "kvserve generate: INVALID_ARGUMENT: sampling.top_p: must be in (0, 1], got 1.5"
    assert result.stdout.strip() == ""


def test_generate_unreachable_server_fails_cleanly() -> None:
    result = run_cli("generate", "x", "--port", "1", "--timeout", "3")
    assert result.returncode == 1
    assert result.stderr.startswith("kvserve generate: UNAVAILABLE") and "Traceback" not in result.stderr


def test_generate_token_file_is_sent_as_bearer(scripted_server, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    result = run_cli("generate", "x", "--max-tokens", "1", "--token-file", str(token_file), *port_args(scripted_server))
    assert result.returncode == 0, result.stderr
    assert scripted_server.servicer.recorded.metadata[0]["authorization"] == "Bearer from-file"


def test_chat_resends_conversation_and_resets(scripted_server) -> None:
    result = run_cli(
        "chat",
        "--max-tokens",
        "2",
        "--system",
        "be brief",
        "--verbose",
        *port_args(scripted_server),
        stdin="hello\nsecond\n/reset\nthird\n",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [" w0 w1"] * 3
    assert "(conversation reset)" in result.stderr and "cached" in result.stderr
    turns = [[(m.role, m.content) for m in r.chat.messages] for r in scripted_server.servicer.recorded.requests]
    assert turns == [
        [("system", "be brief"), ("user", "hello")],
        [("system", "be brief"), ("user", "hello"), ("assistant", " w0 w1"), ("user", "second")],
        [("system", "be brief"), ("user", "third")],
    ]


def test_chat_sends_its_own_sampling_defaults(scripted_server) -> None:
    result = run_cli("chat", *port_args(scripted_server), stdin="hello\n")
    assert result.returncode == 0, result.stderr
    sampling = scripted_server.servicer.recorded.requests[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (0.7, 0.9, 256)
    assert not sampling.HasField("top_k") and not sampling.HasField("min_p")  # the rest: the server's


def test_chat_flags_override_its_defaults_and_server_defaults_sends_none(scripted_server) -> None:
    given = run_cli("chat", "--temperature", "0", "--max-tokens", "9", *port_args(scripted_server), stdin="hi\n")
    server_side = run_cli("chat", "--server-defaults", "--top-p", "0.5", *port_args(scripted_server), stdin="hi\n")
    assert given.returncode == 0 and server_side.returncode == 0, (given.stderr, server_side.stderr)
    first, second = (r.sampling for r in scripted_server.servicer.recorded.requests)
    assert (first.temperature, first.top_p, first.max_tokens) == (0.0, 0.9, 9) and first.HasField("temperature")
    assert second.top_p == 0.5
    assert not any(second.HasField(name) for name in ("temperature", "max_tokens"))


def test_chat_exit_command_stops_reading(scripted_server) -> None:
    result = run_cli("chat", *port_args(scripted_server), stdin="/exit\nnever sent\n")
    assert result.returncode == 0 and scripted_server.servicer.recorded.requests == []


def test_stats_text_and_json(scripted_server) -> None:
    text = run_cli("stats", *port_args(scripted_server))
    assert text.returncode == 0, text.stderr
    assert "health: SERVING" in text.stdout and "scripted-model" in text.stdout and "blocks_free=60" in text.stdout
    body = json.loads(run_cli("stats", "--json", *port_args(scripted_server)).stdout)
    assert body["health"] == "SERVING"
    assert body["model"]["block_size"] == 16 and body["stats"]["executor_state"] == "READY"
    assert "block_size=16" in text.stdout


def test_stats_health_probes(scripted_server) -> None:
    assert run_cli("stats", "--health-only", *port_args(scripted_server)).returncode == 0
    scripted_server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    not_serving = run_cli("stats", "--health-only", *port_args(scripted_server))
    assert not_serving.returncode == 3 and not_serving.stdout.strip() == "NOT_SERVING"
    assert run_cli("stats", "--alive", *port_args(scripted_server)).returncode == 0
    assert run_cli("stats", "--alive", "--port", "1", "--timeout", "2").returncode == 1


@pytest.mark.parametrize("command", ["generate", "chat", "stats"])
def test_help_shows_defaults(command: str) -> None:
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"(default: {defaults.GRPC_HOST})" in result.stdout
    assert f"(default: {defaults.GRPC_PORT})" in result.stdout
    if command != "stats":
        assert "--temperature" in result.stdout and "(default: server's, 1.0)" in result.stdout
    if command == "chat":
        assert "greedy (default: 0.7)" in result.stdout and "to generate (default: 256)" in result.stdout
        assert "(default: 0.9)" in result.stdout and "--server-defaults" in result.stdout
    if command == "generate":
        assert "greedy (default: 0.7 with --chat, else server's, 1.0)" in result.stdout
        assert "to generate (default: 256 with --chat, else server's, 16)" in result.stdout


@pytest.mark.parametrize("block_size", defaults.BLOCK_SIZES)
def test_serve_passes_its_block_size_to_the_executor(block_size: int) -> None:
    from kvserve.cli import build_parser
    from kvserve.commands.serve import child_executor_from_args, executor_args
    from kvserve.config.flags import config_from_args
    from kvserve.executor.entry import build_parser as executor_parser
    from kvserve.executor.entry import fake_config_from_args, runner_config_from_args
    from kvserve.scheduler.server.server_config import ServerConfig

    argv = ["serve", "--executor", "fake", "--block-size", str(block_size), "--tokenizer-path", "."]
    args = build_parser().parse_args(argv)  # (a tokenizer path: no default model needed to build the fake config)
    child = executor_args(child_executor_from_args(args), config_from_args(ServerConfig, args), "ipc:///tmp/x")
    child_args = executor_parser().parse_args(child)
    assert runner_config_from_args(child_args).block_size == block_size
    assert fake_config_from_args(child_args).block_size == block_size


@pytest.mark.parametrize("command", ["serve", "executor"])
def test_block_size_outside_the_tested_set_is_refused(command: str) -> None:
    result = run_cli(command, "--block-size", "12")
    assert result.returncode == 2
    assert "--block-size: invalid choice: 12 (choose from 8, 16, 32, 64)" in result.stderr


def test_generate_structured_flags_fill_the_request(scripted_server, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    cases = [
        (["--json-schema", f"@{schema}"], "json_schema", '{"type": "object"}'),
        (["--choice", "yes", "--choice", "no"], "choice", ["yes", "no"]),
        (["--regex", "[0-9]+"], "regex", "[0-9]+"),
        (["--json-object"], "json_object", True),
    ]
    for i, (flags, kind, value) in enumerate(cases):
        result = run_cli("generate", "hi", "--max-tokens", "1", *flags, *port_args(scripted_server))
        assert result.returncode == 0, result.stderr
        structured = scripted_server.servicer.recorded.requests[i].structured
        assert structured.WhichOneof("kind") == kind
        got = list(structured.choice.choices) if kind == "choice" else getattr(structured, kind)
        assert got == value
    both = run_cli("generate", "hi", "--regex", "a", "--json-object", *port_args(scripted_server))
    assert both.returncode == 2 and "not allowed with" in both.stderr
    missing = run_cli("generate", "hi", "--grammar", f"@{tmp_path / 'nope.lark'}", *port_args(scripted_server))
    assert missing.returncode == 1 and "nope.lark" in missing.stderr
