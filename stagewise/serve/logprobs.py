"""Per-token log-probabilities in OpenAI's two shapes, from the engine's records.

A request that asks (`/v1/completions` with `"logprobs": k`, `/v1/chat/completions` with
`"logprobs": true` and `"top_logprobs": k`) runs with `SamplingParams(logprobs=k)`, so the engine
keeps, per generated token, the k most likely tokens of that step, their log-probabilities and the
drawn token's (`engine/logprobs.py`: the raw float32 log-softmax of the step's logits). Here they
become JSON, one entry per token:

    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                  "bytes"}, ...]}, ...]}
    completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...],
                  "text_offset": [...]}

A float32 value is written as the double it converts to exactly, so two answers whose logits were
the same bits carry the same numbers: the server shows batch invariance too (a request's numbers
do not depend on what else it was batched with). A token's text is its bytes decoded alone, so a
character split across tokens shows as U+FFFD in each; "bytes" carries the exact bytes.
"""

from stagewise.engine.logprobs import StepLogprobs

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs (vLLM's default max_logprobs)


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.bytes_of([token_id])
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_entries(tokenizer, token_ids: list[int], records: list[StepLogprobs]) -> list[dict]:
    """The chat shape's "content" entries of these tokens."""
    out = []
    for token_id, rec in zip(token_ids, records):
        text, raw = _token(tokenizer, token_id)
        top = []
        for tid, value in zip(rec.token_ids.tolist(), rec.values.tolist()):
            t_text, t_raw = _token(tokenizer, tid)
            top.append({"token": t_text, "logprob": value, "bytes": t_raw})
        out.append({"token": text, "logprob": rec.sampled.item(), "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(tokenizer, token_ids: list[int], records: list[StepLogprobs], offset: int = 0) -> dict:
    """The completions shape of these tokens; `offset`: where their text starts in the answer."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, rec in zip(token_ids, records):
        text, _ = _token(tokenizer, token_id)
        tokens.append(text)
        values.append(rec.sampled.item())
        top = {}
        for tid, value in zip(rec.token_ids.tolist(), rec.values.tolist()):
            top.setdefault(_token(tokenizer, tid)[0], value)  # two ids may print alike: the likelier kept
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def as_json(chat: bool, tokenizer, token_ids: list[int], records: list[StepLogprobs], offset: int = 0) -> dict:
    """A choice's "logprobs" object for these tokens (all of an answer, or a stream chunk's)."""
    if chat:
        return {"content": chat_entries(tokenizer, token_ids, records)}
    return completion_logprobs(tokenizer, token_ids, records, offset)


def of_request(tokenizer, req, chat: bool, start: int, end: int, offset: int = 0) -> dict:
    """The logprobs object of a request's output tokens start..end (the engine thread appends a
    token's record before that token's event, and never changes either after)."""
    ids, records = req.output_token_ids[start:end], req.logprobs[start:end]
    return as_json(chat, tokenizer, ids, records, offset)
