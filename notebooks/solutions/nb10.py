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


SOLUTIONS = {"10.static_rows": my_static_rows, "10.continuous_rows": my_continuous_rows}
