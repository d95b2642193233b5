"""The engine: requests, runners for each mode, KV caches, metrics and the `LLM` API."""
