"""The engine: requests, the scheduler, runners for each mode, metrics and the `LLM` API.

The KV caches it runs over are the `kv/` package.
"""
