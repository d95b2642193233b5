"""Tensor parallelism: one model split across N ranks (processes), on torch.distributed.

    shard.py     which slice of every matrix rank r holds (Megatron-style), with shapes
    group.py     a rank's collectives: vocab-parallel embedding, all-reduce, vocab gather (traced)
    messages.py  what rank 0 broadcasts each step (the batch metadata, as vLLM's driver worker)
    worker.py    ranks 1..N-1: the loop that runs rank 0's steps on their shards
    launch.py    starting the ranks: torch.multiprocessing on one machine, torchrun on many
    driver.py    rank 0: `TensorParallelModel`, what the runners call instead of `LlamaModel`

Layering: parallel sits above models and below the engine; the KV caches its
workers rebuild come from `kv/`, which both parallel and the engine import.
"""
