"""`kvserve bench serve --api openai` and `--target` end to end, against fake-executor servers over HTTP."""

import json
import shlex

from kvserve.testing.server_launcher import serving

FAKE_SERVERS_OVER_HTTP = shlex.split(
    "bench serve --num-requests 6 --concurrency 3 --max-tokens-cap 6 --no-progress "
    "--start-server --executor fake --server-arg=--step-latency-ms=5 --api openai"
)


def _bench(kvserve_cli, out, *extra):
    proc = kvserve_cli([*FAKE_SERVERS_OVER_HTTP, "--json", str(out), *extra], timeout_s=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    by = {(r["configuration"], r["workload"]): r for r in data["results"]}
    for r in data["results"]:
        assert r["num_failed"] == 0, r["errors"]
    return data, by, proc


def test_openai_api_drives_kvserve_over_http(tmp_path, kvserve_cli):
    data, by, _ = _bench(kvserve_cli, tmp_path / "bench.json", "--workload", "all", "--baselines", "no-cache")
    assert data["meta"]["api"] == "openai"
    kv = {
        ("kvserve", w)
        for w in ("mixed", "shared-prefix", "multi-turn", "multi-prefix", "copy", "cold-warm/cold", "cold-warm/warm")
    }
    nc = {("kvserve-no-cache", w) for w in ("mixed", "shared-prefix", "multi-turn", "multi-prefix", "copy")}
    assert set(by) == kv | nc
    mixed = by[("kvserve", "mixed")]
    assert mixed["num_requests"] == 6
    assert mixed["total_output_tokens"] == 6 * 6  # ignore_eos + max_tokens over HTTP too
    assert mixed["ttft"]["count"] == 6 and mixed["ttft"]["mean"] > 0
    assert mixed["itl"]["count"] > 0 and mixed["tpot"]["mean"] > 0
    assert 1 <= mixed["peak_running"] <= 3  # server counters still come from gRPC server_stats
    # usage.prompt_tokens_details.cached_tokens is read: the shared prefix hits with caching on only
    assert by[("kvserve", "shared-prefix")]["prefix_cache_hit_rate"] > 0.6
    assert by[("kvserve-no-cache", "shared-prefix")]["prefix_cache_hit_rate"] == 0.0
    # cache_salt goes through: the cold half reuses nothing, the primed warm half does
    assert by[("kvserve", "cold-warm/cold")]["cached_tokens"] == 0
    assert by[("kvserve", "cold-warm/warm")]["prefix_cache_hit_rate"] > 0.8
    assert by[("kvserve", "multi-turn")]["cached_tokens"] > 0  # the re-encoded replies resend the history
    assert data["target_ratios"] == {}


def test_target_is_measured_with_the_same_requests(tmp_path, kvserve_cli):
    with serving(["--executor", "fake", "--step-latency-ms=5"], name="target", http=True) as other:
        data, by, proc = _bench(
            kvserve_cli,
            tmp_path / "bench.json",
            "--workload",
            "mixed",
            "--baselines",
            "--target",
            f"other={other.http_url}",
        )
    assert set(by) == {("kvserve", "mixed"), ("other", "mixed")}
    ours, theirs = by[("kvserve", "mixed")], by[("other", "mixed")]
    assert ours["num_requests"] == theirs["num_requests"] == 6
    assert ours["total_prompt_tokens"] == theirs["total_prompt_tokens"]  # token-id prompts on both sides
    assert ours["total_output_tokens"] == theirs["total_output_tokens"] == 36
    assert theirs["peak_running"] == 0  # a foreign target has no kvserve stats
    assert data["meta"]["targets"]["other"]["prompt_mode"] == "tokens"  # probed: kvserve takes token ids
    ratios = data["target_ratios"]["other"]["mixed"]
    assert ratios["num_requests"] == {"kvserve": 6, "other": 6}
    assert ratios["output_throughput_ratio"] > 0 and ratios["mean_ttft_ratio"] > 0
    assert ratios["met"] in (True, False)
    assert "vs other (mixed)" in proc.stdout
