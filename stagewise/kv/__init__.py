"""The KV caches, and how one engine step stores and reads K/V through them.

    access.py        `KVAccess`: what the forward pass calls, `rope_and_attend` (-> `attend`)
    none.py          `NoKVCache`: mode "naive" keeps no K/V, attention runs over the batch itself
    contiguous.py    mode "kv": one fixed-size region per request of a static batch
    paged.py         mode "paged": a pool of fixed-size blocks and the block table that maps into it
    block_manager.py which blocks each request owns, with prefix caching

Both the engine (its runners) and tensor parallelism (`parallel/`, whose workers build their own
copies of rank 0's caches) import the caches from here.
"""
