"""The forward pass and what it reads: the Llama-family model, its config, the paged KV cache
and the flat input batch."""
