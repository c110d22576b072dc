"""Intake: an API call becomes a validated request (parsing, the model's sampling defaults, the tokenizer)."""
