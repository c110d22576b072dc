"""Triton kernels for paged attention and KV stores, each with a torch reference.
Imports neither service."""
