"""What a packed weight is, and its codecs: the room the stages' quantized tiers read from.

    packed_weight.py   `PackedWeight`: integer codes + per-group scales (q4_0, q4_1, q8_0, K-quants)
    packed_parts.py    `PackedParts`: packed weights of different kinds side by side (Q4_K_M)
    quantize.py        llama.cpp's round-to-nearest quantizers: float [K, N] -> PackedWeight
    dequantize.py      the block formula back to float32, bit for bit the reference's
    int4pack.py        PyTorch's CPU int4 layout and its exact inverse
    rows8.py           8 rows interleaved, codes and scales side by side: the integer-dot GEMM's
                       layout (`cpu/int8_dot.cpp`), and its exact inverse
    gguf_blocks.py     a GGUF tensor's Q4_0 / Q4_1 / Q8_0 blocks -> PackedWeight
    gguf_kquants.py    GGUF's K-quant super-blocks (Q4_K, Q5_K, Q6_K) -> PackedWeight

It sits below the stages: a stage's tiers take a `PackedWeight` where a tensor would go,
and each tier has one place that tells the two apart. Nothing here knows a model.
"""
