"""Scrape `kvserve serve --executor fake --metrics-port P` while it serves."""

import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvserve.testing.ports import free_port
from kvserve.testing.server_launcher import serving


def _scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def test_prefix_hits_grow_on_a_repeated_prompt():
    from kvserve.clients import Client

    metrics_port = free_port()
    with serving(["--executor", "fake", "--metrics-port", str(metrics_port)], name="metrics") as server:
        prompt = list(range(1000, 1100))
        with Client(server.address) as client:
            client.generate(token_ids=prompt, max_tokens=4, ignore_eos=True)
            first = _scrape(metrics_port)
            client.generate(token_ids=prompt, max_tokens=4, ignore_eos=True)
            second = _scrape(metrics_port)
    assert first["kvserve:prompt_tokens_total"] >= 100
    assert second["kvserve:prefix_cache_queries_total"] > first["kvserve:prefix_cache_queries_total"]
    assert second["kvserve:prefix_cache_hits_total"] - first["kvserve:prefix_cache_hits_total"] >= 96
    assert second["kvserve:generation_tokens_total"] == first["kvserve:generation_tokens_total"] + 4
    assert second["kvserve:request_success_total{finished_reason=length}"] == 2
    assert second["kvserve:time_to_first_token_seconds_count"] == 2
    assert second["kvserve:e2e_request_latency_seconds_count"] == 2
    assert second["kvserve:step_duration_seconds_count"] > 0
    assert second["kvserve:executor_up"] == 1


def test_preemptions_appear_with_a_tiny_pool():
    from kvserve.clients import Client

    metrics_port = free_port()
    # 16 blocks x 16 tokens = 256 slots; six requests of 32 + 64 tokens need 36 blocks at their end.
    extra = ["--metrics-port", str(metrics_port), "--num-blocks", "16", "--step-latency-ms", "2"]
    with serving(["--executor", "fake", *extra], name="tiny-pool") as server:
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                with Client(server.address) as client:
                    client.generate(token_ids=[2000 + i] * 32, max_tokens=64, ignore_eos=True)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        values = _scrape(metrics_port)
    assert not errors, errors
    assert values["kvserve:num_preemptions_total"] > 0
    assert values["kvserve:request_success_total{finished_reason=length}"] == 6
