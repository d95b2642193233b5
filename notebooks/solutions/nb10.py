"""Solutions to the exercises of notebook 10 (continuous batching)."""


def my_static_rows(prompt_lens: list[int], output_lens: list[int], seats: int) -> tuple[int, int]:
    rows = padding = 0
    for first in range(0, len(prompt_lens), seats):
        prompts, outputs = prompt_lens[first : first + seats], output_lens[first : first + seats]
        longest = max(prompts)
        rows += len(prompts) * longest  # the prefill: every prompt left-padded to the longest
        padding += sum(longest - p for p in prompts)
        decode_steps = max(outputs) - 1  # the first token comes from the prefill
        rows += len(prompts) * decode_steps
        padding += sum(decode_steps - (o - 1) for o in outputs)  # finished rows keep running
    return rows, padding


def my_continuous_rows(prompt_lens: list[int], output_lens: list[int]) -> int:
    return sum(p + o - 1 for p, o in zip(prompt_lens, output_lens))


def my_schedule(running, waiting, budget, max_num_seqs, allocate, free):
    scheduled, preempted = [], False
    i = 0
    while i < len(running) and budget > 0:  # 1) running requests, first come first served
        seq = running[i]
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)  # a whole prompt, a chunk or 1
        while not allocate(seq, n):  # no room: preempt the newest running request
            victim = running.pop()
            free(victim)
            victim.num_computed_tokens = 0  # recompute: its K/V are gone
            waiting.appendleft(victim)  # and it is the first to come back
            preempted = True
            if victim is seq:
                break
        if seq not in running:  # it preempted itself: nothing else fits this step
            break
        scheduled.append((seq.request_id, n))
        budget -= n
        i += 1
    while waiting and not preempted and len(running) < max_num_seqs and budget > 0:  # 2) admit
        seq = waiting[0]
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not allocate(seq, n):
            break  # the head of the queue waits, and everyone behind it
        running.append(waiting.popleft())
        scheduled.append((seq.request_id, n))
        budget -= n
    return scheduled


SOLUTIONS = {
    "10.static_rows": my_static_rows,
    "10.continuous_rows": my_continuous_rows,
    "10.schedule_step": my_schedule,
}
