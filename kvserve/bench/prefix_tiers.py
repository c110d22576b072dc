"""What the prefix cache's tiers buy: TTFT after a full restart, and an oversized working set.

    kvserve bench prefix-tiers [--prefix-tokens 1500 8000] [--runs 3] [--server-args ...]

Four measurements, each against its baseline in the same run, on real `kvserve serve` processes:

- **Warm restart.** For each prefix length, a server on an empty `--kv-disk-dir` computes a prompt
  (prefix + a short question); it is stopped, and a new server on the same directory answers the
  same prompt (warm: the prefix loads from disk) and one with a fresh prefix of the same length
  (cold, on the same warm-started process). TTFT of each, median of `--runs` prompts.
- **Oversized working set.** `--prefixes` prefixes of `--shared-tokens` tokens, four times what
  `--small-kv-cache-gb` holds, asked for round-robin `--rounds` times: the wall time without a tier,
  with the disk tier, and with the host-memory tier (`--kv-host-gb`).
- **The tier's own cost.** Decode-heavy requests (short unique prompts, `--decode-tokens` each, 8 at
  once) with and without the tier, alternated: output tokens per second. Write-through stores run,
  loads do not.
- **llama-server's slot files** (`slot-restore`, when `scripts/build_llama_server.sh` has built it):
  the same warm restart driven through `--slot-save-path` on the same GGUF: one slot computes the
  prompt and saves it (`POST /slots/0?action=save`); a new llama-server restores the file and answers
  the prompt, then a fresh prefix of the same length (cold). TTFT is the whole one-token request, the
  restore included.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvserve.config.flags import HelpFormatter, add_flags, config_from_args, flag
from kvserve.protos.kvserve.v1 import api_pb2, api_pb2_grpc
from kvserve.testing.ports import free_port
from kvserve.testing.server_launcher import ServeProcess, serving
from kvserve.testing.waiting import wait_until

PARTS = ("restart", "working-set", "cost", "slot-restore")
LLAMA_SERVER_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "llama_server.sh"
"""Starts llama-server on the same GGUF (a checkout's script: the part is skipped without it)."""
QUESTION_TOKENS = 8
"""Tokens after the shared prefix, different per request."""


@dataclass(frozen=True, slots=True)
class PrefixTiersConfig:
    """The flags of `kvserve bench prefix-tiers`."""

    prefix_tokens: tuple[int, ...] = field(default=(1500, 8000), metadata=flag("shared prefix lengths", nargs="+"))
    runs: int = field(default=3, metadata=flag("prompts timed per prefix length and case (median reported)"))
    prefixes: int = field(default=10, metadata=flag("prefixes of the oversized working set"))
    shared_tokens: int = field(default=1024, metadata=flag("tokens of each of the working set's prefixes"))
    rounds: int = field(default=3, metadata=flag("passes over the working set"))
    small_kv_cache_gb: float = field(default=0.05, metadata=flag("the KV pool of the working-set runs"))
    decode_tokens: int = field(default=96, metadata=flag("output tokens of each request of the cost runs"))
    host_gb: float = field(default=2.0, metadata=flag("--kv-host-gb of the working set's host-memory case"))
    parts: tuple[str, ...] = field(default=PARTS, metadata=flag("which measurements to run", nargs="+", choices=PARTS))
    cost_turns: int = field(default=3, metadata=flag("alternations of the cost runs (without, with)"))
    server_args: tuple[str, ...] = field(
        default=("--executor", "torch"),
        metadata=flag("arguments of every `kvserve serve` (after the bench's own)", nargs="*"),
    )


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]


def _generate(server: ServeProcess, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(TTFT in seconds, output tokens) of one greedy request over gRPC."""
    stub = api_pb2_grpc.KVServeStub(server.channel())
    request = api_pb2.GenerateRequest(
        token_ids=api_pb2.TokenIds(ids=prompt),
        sampling=api_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    started = time.perf_counter()
    first, count = 0.0, 0
    for response in stub.Generate(request, timeout=600):
        if not first and response.token_ids:
            first = time.perf_counter() - started
        count += len(response.token_ids)
    return first, count


@contextmanager
def _server(config: PrefixTiersConfig, log_dir: Path, name: str, extra: Sequence[str]) -> Iterator[ServeProcess]:
    with serving([*extra, *config.server_args], log_dir, name=name, timeout_s=600) as server:
        _generate(server, _prompt(random.Random(-1), 16), 2)  # load the kernels before timing anything
        yield server


def warm_restart(config: PrefixTiersConfig, log_dir: Path) -> list[dict[str, float]]:
    rows = []
    for length in config.prefix_tokens:
        rng = random.Random(length)
        prompts = [_prompt(rng, length + QUESTION_TOKENS) for _ in range(config.runs)]
        fresh = [_prompt(rng, length + QUESTION_TOKENS) for _ in range(config.runs)]
        disk = Path(tempfile.mkdtemp(prefix="kvserve-tiers-", dir=log_dir))
        tier = ["--kv-disk-dir", str(disk)]
        with _server(config, log_dir, f"cold-{length}", tier) as server:
            first = [_generate(server, p, 1)[0] for p in prompts]
        # Stopped: the executor wrote every queued block before it exited.
        with _server(config, log_dir, f"warm-{length}", tier) as server:
            warm = [_generate(server, p, 1)[0] for p in prompts]
            cold = [_generate(server, p, 1)[0] for p in fresh]
            loaded = server.stats().kv_disk_loaded_blocks
        row = {
            "prefix_tokens": length,
            "ttft_first_server_s": statistics.median(first),
            "ttft_cold_s": statistics.median(cold),
            "ttft_warm_s": statistics.median(warm),
            "loaded_blocks": loaded,
        }
        row["ratio"] = row["ttft_cold_s"] / row["ttft_warm_s"]
        rows.append(row)
        print(
            f"prefix {length:>5}: TTFT cold {row['ttft_cold_s']:.3f} s, warm from disk {row['ttft_warm_s']:.3f} s "
            f"({row['ratio']:.1f}x lower); {loaded} blocks loaded",
            flush=True,
        )
    return rows


def working_set(config: PrefixTiersConfig, log_dir: Path) -> dict[str, float]:
    rng = random.Random(7)
    prefixes = [_prompt(rng, config.shared_tokens) for _ in range(config.prefixes)]
    requests = [[*prefix, *_prompt(rng, QUESTION_TOKENS)] for _ in range(config.rounds) for prefix in prefixes]
    small = ["--kv-cache-gb", str(config.small_kv_cache_gb)]
    cases = {
        "without a tier": small,
        "with the disk tier": [*small, "--kv-disk-dir", tempfile.mkdtemp(dir=log_dir)],
        "with the host-memory tier": [*small, "--kv-host-gb", str(config.host_gb)],
    }
    times = {}
    for index, (case, extra) in enumerate(cases.items()):
        with _server(config, log_dir, f"set-{index}", extra) as server:
            started = time.perf_counter()
            for prompt in requests:
                _generate(server, prompt, 4)
            times[case] = time.perf_counter() - started
            stats = server.stats()
        hit = stats.prefix_hit_tokens / max(stats.prefix_queried_tokens, 1)
        print(f"working set {case}: {times[case]:.1f} s, prefix hit rate {hit:.2f}", flush=True)
    without = times.pop("without a tier")
    for case, seconds in times.items():
        print(f"working set: {without / seconds:.2f}x the throughput {case}", flush=True)
    return {"without_s": without, **{f"{case}_s": seconds for case, seconds in times.items()}}


def tier_cost(config: PrefixTiersConfig, log_dir: Path) -> dict[str, float]:
    rates: dict[str, list[float]] = {"without": [], "with": []}
    for turn in range(config.cost_turns):
        for case in ("without", "with") if turn % 2 == 0 else ("with", "without"):
            extra = ["--kv-disk-dir", tempfile.mkdtemp(dir=log_dir)] if case == "with" else []
            rng = random.Random(100 + turn)
            prompts = [_prompt(rng, 64) for _ in range(16)]
            with _server(config, log_dir, f"cost-{case}-{turn}", extra) as server, ThreadPoolExecutor(8) as pool:
                started = time.perf_counter()
                tokens = sum(c for _, c in pool.map(lambda p: _generate(server, p, config.decode_tokens), prompts))
                rates[case].append(tokens / (time.perf_counter() - started))
    without, with_tier = statistics.median(rates["without"]), statistics.median(rates["with"])
    print(
        f"decode throughput (median of {config.cost_turns}): {without:.1f} tok/s without the tier, "
        f"{with_tier:.1f} with it (runs: {rates})",
        flush=True,
    )
    return {"without_tok_s": without, "with_tok_s": with_tier, "cost": without / with_tier - 1}


@contextmanager
def _llama_server(log_dir: Path, name: str, slot_dir: Path, context: int) -> Iterator[str]:
    """llama-server with one slot of `context` tokens saving to `slot_dir`; its URL."""
    port = free_port("127.0.0.1")
    env = {**os.environ, "SLOTS": "1", "CTX_PER_SLOT": str(context)}
    # --cache-ram 0: no host-memory prompt cache, so the restarted server has only the slot file.
    argv = ["bash", str(LLAMA_SERVER_SCRIPT), str(port), "--slot-save-path", str(slot_dir), "--cache-ram", "0"]
    with (log_dir / f"{name}.log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: _healthy(url) or process.poll() is not None, 600, f"llama-server {name} to start")
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited: see {log_dir / name}.log")
            yield url
        finally:
            process.terminate()
            process.wait(60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _llama_ttft(url: str, prompt: list[int]) -> float:
    """Seconds of a one-token completion of `prompt` on slot 0 (its TTFT: no other token follows)."""
    started = time.perf_counter()
    body = {"prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True, "temperature": 0.0}
    httpx.post(f"{url}/completion", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - started


def slot_restore(config: PrefixTiersConfig, log_dir: Path) -> list[dict[str, float]]:
    if not LLAMA_SERVER_SCRIPT.is_file():
        print("slot-restore: skipped (scripts/llama_server.sh is in a checkout, not installed)", flush=True)
        return []
    rows = []
    for length in config.prefix_tokens:
        rng = random.Random(length)
        prompts = [_prompt(rng, length + QUESTION_TOKENS) for _ in range(config.runs)]
        fresh = [_prompt(rng, length + QUESTION_TOKENS) for _ in range(config.runs)]
        slot_dir = Path(tempfile.mkdtemp(prefix="llama-slots-", dir=log_dir))
        context = length + QUESTION_TOKENS + 16
        with _llama_server(log_dir, f"llama-first-{length}", slot_dir, context) as url:
            for index, prompt in enumerate(prompts):
                _llama_ttft(url, prompt)
                saved = httpx.post(f"{url}/slots/0?action=save", json={"filename": f"p{index}.bin"}, timeout=600)
                saved.raise_for_status()
        warm, restore = [], []
        with _llama_server(log_dir, f"llama-warm-{length}", slot_dir, context) as url:
            for index, prompt in enumerate(prompts):
                started = time.perf_counter()
                body = {"filename": f"p{index}.bin"}
                httpx.post(f"{url}/slots/0?action=restore", json=body, timeout=600).raise_for_status()
                restore.append(time.perf_counter() - started)
                warm.append(restore[-1] + _llama_ttft(url, prompt))
            cold = [_llama_ttft(url, prompt) for prompt in fresh]
        row = {
            "prefix_tokens": length,
            "ttft_cold_s": statistics.median(cold),
            "ttft_warm_s": statistics.median(warm),
            "restore_s": statistics.median(restore),
        }
        row["ratio"] = row["ttft_cold_s"] / row["ttft_warm_s"]
        rows.append(row)
        print(
            f"llama-server prefix {length:>5}: TTFT cold {row['ttft_cold_s']:.3f} s, restored from its slot file "
            f"{row['ttft_warm_s']:.3f} s ({row['ratio']:.1f}x lower; the restore {row['restore_s']:.3f} s)",
            flush=True,
        )
    return rows


def run(config: PrefixTiersConfig) -> None:
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-tiers-") as root:
        log_dir = Path(root)
        if "restart" in config.parts:
            warm_restart(config, log_dir)
        if "working-set" in config.parts:
            working_set(config, log_dir)
        if "cost" in config.parts:
            cost = tier_cost(config, log_dir)
            print(f"the tier's cost on decode throughput: {cost['cost'] * 100:+.1f}%", flush=True)
        if "slot-restore" in config.parts:
            slot_restore(config, log_dir)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prefix-tiers",
        help="TTFT after a restart with the disk tier, an oversized working set, and the tier's cost",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_flags(parser, PrefixTiersConfig)
    parser.set_defaults(func=lambda args: run(config_from_args(PrefixTiersConfig, args)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvserve.bench.prefix_tiers", formatter_class=HelpFormatter)
    add_flags(parser, PrefixTiersConfig)
    run(config_from_args(PrefixTiersConfig, parser.parse_args(argv)))


if __name__ == "__main__":
    main()
