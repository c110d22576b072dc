"""Tenancy and security: bearer tokens, TLS, which addresses may listen, and prefix-cache namespaces."""
