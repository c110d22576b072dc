"""The prefix cache's disk tier through the whole server: `kvserve serve --kv-disk-dir DIR`.

The fake executor stores each block's token slots as its KV (and in strict mode would catch a
wrong one), so these tests check what is the service's: a prompt cached before a full restart, or
before a kill -9 of the executor, is a hit afterwards with the same tokens; one tenant's blocks on
disk are never another's hit; `/metrics` and `kvserve stats` count the tier.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvserve.testing.server_launcher import ServeProcess, serving
from kvserve.testing.waiting import wait_until
from tests.clients.test_cli_commands import kvserve_argv
from tests.http.http_clients import ALICE, BOB, FAKE_ARGS, sdk, token_file

pytestmark = pytest.mark.timeout(180)

PROMPT = "A shared system prompt that spans several blocks of the cache, for every request. " * 6


def complete(server: ServeProcess, prompt: str = PROMPT, api_key: str = "unused") -> tuple[str, int]:
    """A greedy completion's text and its cached prompt tokens."""
    text, cached, _ = complete_with_tiers(server, prompt, api_key)
    return text, cached


def complete_with_tiers(
    server: ServeProcess, prompt: str = PROMPT, api_key: str = "unused"
) -> tuple[str, int, dict[str, int]]:
    """A greedy completion's text, its cached prompt tokens, and kvserve's split of them by tier."""
    client = sdk(server, api_key=api_key)
    reply = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=8, temperature=0)
    details = reply.usage.prompt_tokens_details if reply.usage else None
    if details is None:
        return reply.choices[0].text, 0, {}
    return reply.choices[0].text, details.cached_tokens or 0, dict(details.model_extra or {})


def block_files(directory: Path) -> int:
    return sum(1 for _ in directory.rglob("*.kvb"))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "kv-disk"


def test_a_prefix_cached_before_a_full_restart_is_a_hit_after_it_with_the_same_tokens(
    disk: Path, tmp_path: Path
) -> None:
    args = [*FAKE_ARGS, "--kv-disk-dir", str(disk)]
    with serving(args, tmp_path, name="cold", http=True) as cold:
        cold_text, cold_cached = complete(cold)
        assert cold_cached == 0
        wait_until(lambda: block_files(disk) >= 6, 30, "the prompt's blocks on disk")
    with serving(args, tmp_path, name="warm", http=True) as warm:
        warm_text, warm_cached, by_tier = complete_with_tiers(warm)
        assert warm_text == cold_text and warm_cached >= 6 * 16
        stats = warm.stats()
        assert stats.kv_disk_loaded_blocks >= 6 and stats.kv_disk_failed_loads == 0
        assert stats.kv_disk_blocks >= stats.kv_disk_loaded_blocks
        assert by_tier == {"host_cached_tokens": 0, "disk_cached_tokens": stats.kv_disk_loaded_blocks * 16}, by_tier
        metrics = httpx.get(f"{warm.http_url}/metrics", timeout=30).text
        assert f"kvserve:kv_disk_loaded_blocks_total {float(stats.kv_disk_loaded_blocks)}" in metrics
        loaded_bytes = stats.kv_disk_loaded_blocks * 16 * 16  # the fake's block: 16 slots of two int64s
        assert f'kvserve:kv_tier_loaded_bytes_total{{medium="DISK"}} {float(loaded_bytes)}' in metrics
        with httpx.stream("GET", f"{warm.http_url}/ui/events", timeout=60) as events:
            data = next(line for line in events.iter_lines() if line.startswith("data: "))
        shown_on_page = json.loads(data[len("data: ") :])["disk"]
        assert shown_on_page["blocks"] >= 6 and shown_on_page["loaded"] == stats.kv_disk_loaded_blocks
        assert (shown_on_page["tiers"], shown_on_page["host_loaded"]) == ("DISK", 0)
        where = ["--port", str(warm.port)]
        shown = subprocess.run([*kvserve_argv(), "stats", *where], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0 and "kv_disk_loaded_blocks" in shown.stdout, shown.stdout + shown.stderr


def test_a_prefix_written_before_a_kill_9_of_the_executor_is_a_hit_on_the_next(disk: Path, tmp_path: Path) -> None:
    args = [*FAKE_ARGS, "--kv-disk-dir", str(disk), "--executor-restart-timeout", "60"]
    with serving(args, tmp_path, name="kill", http=True) as server:
        text, _ = complete(server)
        wait_until(lambda: block_files(disk) >= 6, 30, "the prompt's blocks on disk")
        server.kill_executor(90)
        again, cached = complete(server)
        assert again == text and cached >= 6 * 16, "the new executor's pool is empty: the hit came from disk"
        assert server.stats().kv_disk_loaded_blocks >= 6


def test_one_tenants_blocks_on_disk_are_never_a_hit_for_another(disk: Path, tmp_path: Path) -> None:
    args = [*FAKE_ARGS, "--kv-disk-dir", str(disk), "--auth-token-file", str(token_file(tmp_path))]
    with serving(args, tmp_path, name="alice", http=True) as server:
        complete(server, api_key=ALICE)
        wait_until(lambda: block_files(disk) >= 6, 30, "alice's blocks on disk")
    with serving(args, tmp_path, name="bob", http=True) as server:
        assert complete(server, api_key=BOB)[1] == 0, "bob's namespace has other keys: nothing on disk is his"
        assert complete(server, api_key=ALICE)[1] >= 6 * 16
        with pytest.raises(openai.AuthenticationError):
            complete(server, api_key="no-such-token-000000000")
