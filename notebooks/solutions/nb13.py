"""Solutions to the exercises of notebook 13 (tensor parallelism)."""


def my_decode_allreduces(cfg, batch: int, dtype_bytes: int) -> tuple[int, int]:
    message = batch * cfg.hidden_size * dtype_bytes  # the [B, hidden] partial sums, whatever N is
    return message, 2 * cfg.num_layers + 1  # after o_proj and after down in every block, + the embedding's


def my_valid_tp_sizes(cfg) -> list[int]:
    def splits(n: int) -> bool:
        kv_ok = cfg.num_kv_heads % n == 0 or n % cfg.num_kv_heads == 0  # split the KV heads, or replicate them
        return cfg.num_heads % n == 0 and kv_ok and cfg.intermediate_size % n == 0

    return [n for n in range(1, cfg.num_heads + 1) if splits(n)]


SOLUTIONS = {"13.decode_allreduces": my_decode_allreduces, "13.valid_tp_sizes": my_valid_tp_sizes}
