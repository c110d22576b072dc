"""The fake executor: no model and no torch; deterministic tokens over a shadow KV cache, for the
tests of everything but the model."""
