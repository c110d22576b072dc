"""The scheduler service around the core: gRPC API, engine loop, executor link, supervisor,
security, tokenizer and metrics."""
