"""Solution to the exercise of notebook 16 (the capstone): one engine step, over the engine's parts."""


def my_engine_step(engine, running, waiting):
    p = engine.parts
    # 1. schedule: which requests run, and how many tokens each (your 10, over your 09 allocator)
    step = p.schedule(running, waiting, engine.budget, engine.seats, engine.allocate, engine.free)
    seqs = [engine.seqs[rid] for rid, _ in step]
    # a request admitted with a cached prefix starts past its hits: compute only what is left
    counts = [min(n, s.num_tokens - s.num_computed_tokens) for s, (_, n) in zip(seqs, step)]
    # 2. build the batch: every request's next tokens, flattened
    starts = [s.num_computed_tokens for s in seqs]
    ids = [t for s, a, n in zip(seqs, starts, counts) for t in s.token_ids[a : a + n]]  # [T]
    positions = p.positions(counts, starts)  # [T]
    cu_seqlens = p.cu_seqlens(counts)  # [B+1]
    # 3. forward: the model on your stages and kernels, K/V into the pool -> [B, vocab]
    logits = engine.forward(seqs, counts, ids, positions, cu_seqlens)
    # 4. sample: one token per request (used only where the step reached its last token)
    next_ids = p.greedy(logits)  # [B]
    # 5. settle: count what was computed, hand out tokens, let finished requests go
    sampled = []
    for seq, n, token in zip(seqs, counts, next_ids.tolist()):
        seq.num_computed_tokens += n
        engine.name_blocks(seq)  # its full blocks, findable by the prefix cache
        if seq.num_computed_tokens < seq.num_tokens:  # a prompt chunk: no token yet
            continue
        seq.generated.append(token)
        sampled.append((seq.request_id, token))
        if len(seq.generated) == seq.max_tokens:  # done: its seat and its blocks go back
            running.remove(seq)
            engine.free(seq)
        else:
            seq.token_ids.append(token)  # the next step computes it
    return sampled


SOLUTIONS = {"16.engine": my_engine_step, "16.shared_prefix": my_engine_step}
