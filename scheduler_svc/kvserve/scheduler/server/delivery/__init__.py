"""Request delivery: scheduler outputs become text, chunks and usage on each request's own stream."""
