"""The OpenAI-compatible HTTP API: FastAPI routes served by uvicorn inside the scheduler's event loop.

It shares everything with the gRPC API (the engine, tokenizer, validation, tenants and
prefix cache): an OpenAI body becomes a `GenerateRequest` and goes through the same
`parse_generate`, so both APIs accept and refuse exactly the same values.
"""
