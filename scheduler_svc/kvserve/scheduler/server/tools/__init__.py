"""Tool calling: the validated tool use, the call formats (template, grammar, parser)."""
