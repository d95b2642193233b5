"""Solutions to the exercises of notebook 11 (roofline)."""


def my_roofline_time(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> float:
    return max(flops / peak_flops, bytes_moved / bandwidth)


def my_decode_intensity(batch: int, flops_per_seq: float, weight_bytes: float, kv_bytes_per_seq: float) -> float:
    return batch * flops_per_seq / (weight_bytes + batch * kv_bytes_per_seq)  # weights shared, KV per sequence


SOLUTIONS = {"11.roofline_time": my_roofline_time, "11.decode_intensity": my_decode_intensity}
