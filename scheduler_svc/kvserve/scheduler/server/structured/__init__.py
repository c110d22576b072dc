"""Structured output: request specs, the grammar engine behind one interface, compiled once and cached."""
