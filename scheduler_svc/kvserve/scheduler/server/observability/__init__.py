"""Observability: Prometheus metrics, the stats log line, the recent steps' history and vLLM-style KV events."""
