"""Moved: decode rows over fixed-size key chunks are `stages/chunked_attention.py`, which now
serves every query row (decode, prefill, chunk, verify) with the same arithmetic.

This name stays for one release, for code that still imports `stagewise.stages.chunked_decode`.
"""

from stagewise.stages.chunked_attention import (  # noqa: F401
    CHUNK_KEYS,
    decode_rows,
    padded_length,
)
