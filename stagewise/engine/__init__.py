"""The engine: requests, the scheduler, runners for each mode, metrics and the `LLM` API (KV caches: `kv/`)."""
