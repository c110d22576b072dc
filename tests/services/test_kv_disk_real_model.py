"""The tiers' promise on the default model at the default configuration: a prefix read back from
disk or from host memory gives the very tokens computing it gives, greedy and seeded.

The same requests run three times: computed on a cold server (an empty `--kv-disk-dir`), loaded
from disk by a second server on the same directory (a full restart), and loaded again by that
server's next executor after a kill -9. Each run's tokens must equal the first's, and the second
and third must have read their prefix from disk (cached tokens, disk loads counted). On a server
with `--kv-host-gb` and a pool too small to keep the prefix, each request after a long unrelated
one loads the prefix back from host memory.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from kvserve.testing.replica_launcher import metric_total
from kvserve.testing.server_launcher import ServeProcess, serving
from kvserve.testing.waiting import wait_until
from tests.shared_servers import REAL_MODEL_ARGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SYSTEM = (
    "You are the assistant of a small bakery. Answer in two sentences, name prices in euros, and never "
    "promise a delivery time. The bakery opens at seven and closes at six; bread is baked twice a day. "
) * 4
QUESTIONS = ("Do you have rye bread today?", "What does a croissant cost?", "Can I order a cake for Sunday?")
SAMPLINGS = ({"temperature": 0.0}, {"temperature": 0.9, "seed": 11, "top_p": 0.95})


def run_all(server: ServeProcess, evict_first: bool = False) -> tuple[list[list[str]], int]:
    """Each question under each sampling: its tokens; and the prompt tokens served from the cache.
    `evict_first`: before each, a long unrelated prompt pushes the prefix out of a small pool."""
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    tokens, cached = [], 0
    for sampling in SAMPLINGS:
        for index, question in enumerate(QUESTIONS):
            if evict_first:
                unrelated = f"Story {index}{sampling}: " + "the river ran past the mill and the old bridge. " * 85
                client.completions.create(model=model, prompt=unrelated, max_tokens=1)
            reply = client.completions.create(
                model=model, prompt=SYSTEM + question, max_tokens=16, logprobs=0, **sampling
            )
            tokens.append(list(reply.choices[0].logprobs.tokens or []))
            details = reply.usage.prompt_tokens_details if reply.usage else None
            cached += (details.cached_tokens or 0) if details else 0
    return tokens, cached


def test_a_prefix_from_disk_gives_the_tokens_of_computing_it(tmp_path: Path) -> None:
    disk = tmp_path / "kv-disk"
    args = [*REAL_MODEL_ARGS, "--kv-disk-dir", str(disk), "--executor-restart-timeout", "300"]
    with serving(args, tmp_path, name="cold", http=True) as cold:
        computed, _ = run_all(cold)
        stored = cold.stats().kv_disk_stored_blocks
        assert stored >= 1
        wait_until(lambda: sum(1 for _ in disk.rglob("*.kvb")) >= stored, 60, "every stored block on disk")
    with serving(args, tmp_path, name="warm", http=True) as warm:
        from_disk, cached = run_all(warm)
        assert from_disk == computed
        assert cached > 0 and warm.stats().kv_disk_loaded_blocks >= 1, "the prefix came from disk"
        warm.kill_executor(300)
        loaded_before = warm.stats().kv_disk_loaded_blocks
        after_kill, cached = run_all(warm)
        assert after_kill == computed
        assert cached > 0 and warm.stats().kv_disk_loaded_blocks > loaded_before
        assert "Traceback" not in warm.log_text()


def test_a_prefix_from_host_memory_gives_the_tokens_of_computing_it(tmp_path: Path) -> None:
    # A pool of about 64 blocks: the unrelated prompt (about 950 tokens) evicts the system prompt (about 180).
    args = [*REAL_MODEL_ARGS, "--kv-cache-gb", "0.022", "--kv-host-gb", "0.5"]
    with serving(args, tmp_path, name="host", http=True) as server:
        computed, _ = run_all(server)
        loaded, cached = run_all(server, evict_first=True)
        assert loaded == computed
        metrics = httpx.get(f"{server.http_url}/metrics", timeout=30).text
        host_loads = metric_total(server.http_url, "kvserve:kv_host_loaded_blocks_total")
        assert cached > 0 and host_loads >= len(QUESTIONS) * len(SAMPLINGS), metrics[-2000:]
        assert server.stats().kv_host_loaded_blocks == host_loads, "`kvserve stats` counts them too"
        assert "Traceback" not in server.log_text()
