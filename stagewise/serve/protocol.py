"""The OpenAI API's request fields and response objects, as `stagewise serve` speaks them.

A client (the official `openai` package, `curl`, a browser) sends JSON such as

    POST /v1/completions       {"model": "tiny", "prompt": "Once upon", "max_tokens": 16,
                                "temperature": 0, "stream": true}
    POST /v1/chat/completions  {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}

and `parse_request` turns it into what the engine needs: a prompt (text, or the
chat's messages) and one frozen `SamplingParams`. Every value is checked here
or by `SamplingParams` itself; bad input raises `APIError`, which the app
answers with OpenAI's error JSON:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

A model name other than the one served is answered 404 `model_not_found`, as
OpenAI answers it; a request without "model" gets the served one.

`n` asks for n samples of the prompt, 1 <= n <= 16 (`SamplingParams.MAX_SAMPLES`): the answer
holds n choices (index 0 .. n-1), a seeded request's sample i draws with seed + i, and the usage
counts the prompt once and every sample's tokens. n x (prompt + max_tokens) must fit the KV cache.

`logprobs` (and chat's `top_logprobs`) are answered from the engine's own records
(serve/logprobs.py), per choice.

Fields that the API defines but this engine cannot honour (`best_of` > 1,
`echo`, presence / frequency penalties, `logit_bias`, `tools` / `tool_choice` /
`functions`, `response_format`, `suffix`) are refused by name rather than
silently ignored; fields nobody defined are ignored, as OpenAI does.
Extra sampling fields that vLLM accepts are accepted too: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`.
"""

import json
import time
import uuid
from dataclasses import dataclass

from stagewise.errors import StagewiseError
from stagewise.sampling_params import MAX_SAMPLES, SamplingParams
from stagewise.serve.limits import ServerLimits
from stagewise.serve.logprobs import MAX_TOP_LOGPROBS

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ROLES = ("system", "user", "assistant")  # chat roles a template knows


class APIError(Exception):
    """A request the server refuses: HTTP status, OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code=None, kind=None):
        super().__init__(message)
        self.status = status  # 400 bad input, 401 no key, 404 unknown model, 503 queue full
        self.message = message
        self.param = param  # the request field at fault, when one is
        self.code = code  # OpenAI's machine-readable code ("model_not_found", ...), or None
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ParsedRequest:
    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    prompt: str | list[dict]  # the completion prompt, or the chat's messages [{role, content}]
    params: SamplingParams  # how to sample; max_tokens is provisional when max_tokens_given is False
    max_tokens_given: bool  # False: the chat default, the rest of the context (set once tokenized)
    stream: bool  # answer with server-sent events, one chunk per text delta
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    model: str  # the model name the response reports


# ---- reading the body ----


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def loads(raw: bytes):
    """The body's JSON; anything that is not JSON as RFC 8259 writes it is refused (400): bad syntax
    or UTF-8, NaN / Infinity, a number of more digits than Python converts, nesting too deep."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 JSON ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # NaN / Infinity, or an integer longer than int() takes (4300 digits)
        raise APIError(400, f"the request body is not valid JSON ({str(exc).split(';')[0]})") from None


# ---- checking fields ----


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _get(body: dict, name: str, kind: str, default=None):
    """body[name] if present and not null, checked to be of `kind` ("number", "int", "bool", "str")."""
    value = body.get(name)
    if value is None:
        return default
    ok = {
        "number": _is_number(value),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "object": isinstance(value, dict),
    }[kind]
    if kind == "int" and isinstance(value, float) and value.is_integer():
        return int(value)  # JSON has one number type: 16.0 is 16
    if not ok:
        article = "an" if kind[0] in "aeiou" else "a"
        raise APIError(400, f"'{name}' must be {article} {kind}, got {shown(value)}", param=name)
    if kind == "str":
        _text(value, name)
    return value


def shown(value) -> str:
    """A value quoted in an error message: its repr (which escapes what cannot print), cut short."""
    try:
        text = repr(value)
    except RecursionError:  # JSON nested just shallower than the parser's limit
        return f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


def _text(value: str, where: str) -> str:
    """A string that is Unicode text: JSON's \\ud800 escapes can make a lone surrogate, which no
    tokenizer (nor UTF-8) can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        raise APIError(
            400, f"'{where}' is not valid Unicode text (a lone surrogate {bad!r} at character {exc.start})", where
        ) from None
    return value


UNSUPPORTED = {  # fields OpenAI defines that this server cannot honour: refused by name, never ignored
    "tools": "tool calls are not supported by this server",
    "tool_choice": "tool calls are not supported by this server",
    "functions": "function calls are not supported by this server",
    "function_call": "function calls are not supported by this server",
    "response_format": "structured output (response_format) is not supported by this server",
    "suffix": "'suffix' (text after the completion) is not supported by this server",
}


def _refuse_unsupported(body: dict) -> None:
    for name, why in UNSUPPORTED.items():
        if body.get(name) is not None:
            raise APIError(400, why, param=name)
    n = _get(body, "n", "int")  # a JSON integer: true is not 1
    if n is not None and not 1 <= n <= MAX_SAMPLES:
        raise APIError(400, f"n must be an integer in [1, {MAX_SAMPLES}], got n={shown(n)}", param="n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise APIError(400, f"only best_of=1 is supported, got {shown(best_of)}", param="best_of")
    if body.get("echo") not in (None, False):
        raise APIError(400, "'echo' is not supported by this server", param="echo")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise APIError(400, f"'{name}' is not supported (use repetition_penalty, as vLLM does)", param=name)
    if body.get("logit_bias"):
        raise APIError(400, "'logit_bias' is not supported by this server", param="logit_bias")


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one prompt
    if prompt is None:
        raise APIError(400, "'prompt' is required", param="prompt")
    if not isinstance(prompt, str):
        raise APIError(
            400,
            "'prompt' must be a string (token-id prompts and batches of several prompts are not supported)",
            param="prompt",
        )
    return _text(prompt, "prompt")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"'{where}' must be an object with 'role' and 'content'", param=where)
        role = m.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system role
        if role not in ROLES:
            raise APIError(400, f"'{where}.role' must be one of {', '.join(ROLES)}, got {shown(role)}", param=where)
        out.append({"role": role, "content": _content(m.get("content"), where)})
    return out


def _content(content, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        _text(content, f"{where}.content")
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(400, f"'{where}.content' may hold only text parts", param=where)
            texts.append(_text(part["text"], f"{where}.content"))
        return "".join(texts)
    raise APIError(400, f"'{where}.content' must be a string, got {shown(content)}", param=where)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top tokens to return per generated token, or None for no log-probabilities.

    completions: "logprobs": k (0 = the drawn token's only); chat: "logprobs": true and
    "top_logprobs": k (k only with logprobs, as OpenAI checks)."""
    if chat:
        on = _get(body, "logprobs", "bool", False)
        top = _get(body, "top_logprobs", "int")
        if top is not None and not on:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        name, k = "top_logprobs", (top or 0) if on else None
    else:
        value = body.get("logprobs")
        name, k = "logprobs", None if value in (None, False) else _get(body, "logprobs", "int")
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"'{name}' must be an int in [0, {MAX_TOP_LOGPROBS}], got {shown(k)}", param=name)
    return k


def _stop(body: dict, limits: ServerLimits) -> tuple[str, ...]:
    """Stop strings, at most `limits.max_stop_strings` of at most `limits.max_stop_length` characters:
    the engine thread looks for each one after every token, so their total is every request's cost."""
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a string or a list of non-empty strings, got {shown(stop)}", param="stop")
    if len(stop) > limits.max_stop_strings:
        raise APIError(
            400,
            f"'stop' holds {len(stop)} strings; this server takes at most {limits.max_stop_strings} "
            "(--max-stop-strings)",
            param="stop",
        )
    longest = max(stop, key=len, default="")
    if len(longest) > limits.max_stop_length:
        raise APIError(
            400,
            f"'stop' holds a string of {len(longest)} characters; this server takes at most "
            f"{limits.max_stop_length} (--max-stop-length)",
            param="stop",
        )
    return tuple(_text(s, "stop") for s in stop)


def parse_request(body, *, chat: bool, model_name: str, limits: ServerLimits | None = None) -> ParsedRequest:
    """Check an OpenAI completion (or chat completion) request; -> what the engine needs."""
    limits = limits or ServerLimits()
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = _get(body, "model", "str")
    if model is not None and model != model_name:
        raise APIError(
            404, f"the model '{model}' does not exist; this server serves '{model_name}'", "model", "model_not_found"
        )
    _refuse_unsupported(body)
    prompt = _messages(body) if chat else _prompt(body)
    max_name = "max_tokens"
    max_tokens = _get(body, "max_tokens", "int")
    if chat and body.get("max_completion_tokens") is not None:
        max_name, max_tokens = "max_completion_tokens", _get(body, "max_completion_tokens", "int")
    given = max_tokens is not None
    if not given:
        # completions: OpenAI's 16; chat: the rest of the context, set once the prompt is tokenized
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if not chat else 1
    fields = dict(
        max_tokens=max_tokens,
        temperature=_get(body, "temperature", "number", 1.0),
        top_p=_get(body, "top_p", "number", 1.0),
        top_k=_get(body, "top_k", "int", -1),
        min_p=_get(body, "min_p", "number", 0.0),
        repetition_penalty=_get(body, "repetition_penalty", "number", 1.0),
        seed=_get(body, "seed", "int"),
        stop=_stop(body, limits),
        ignore_eos=_get(body, "ignore_eos", "bool", False),
        n=_get(body, "n", "int", 1),
        logprobs=_logprobs(body, chat),
    )
    try:
        params = SamplingParams(**fields)
    except StagewiseError as exc:  # SamplingParams' own message names the field and its range
        name = str(exc).split(" ", 1)[0]
        param = max_name if name == "max_tokens" else name if name in fields else None
        message = str(exc).replace("max_tokens", max_name, 1) if param == max_name else str(exc)
        raise APIError(400, message, param=param) from None
    options = _get(body, "stream_options", "object", {})
    stream = _get(body, "stream", "bool", False)
    include_usage = _get(options, "include_usage", "bool", False) if stream else False
    return ParsedRequest(chat, prompt, params, given or not chat, stream, bool(include_usage), model_name)


# ---- response objects ----


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_object(
    rid: str, model: str, chat: bool, answers: list[tuple[str, str | None]], counts: dict, logprobs: list | None = None
) -> dict:
    """The whole answer of a non-streaming request: one choice per sample, (text, finish reason);
    `logprobs`: per sample serve/logprobs.py's object, if asked."""
    choices = []
    for index, (text, finish_reason) in enumerate(answers):
        if chat:
            choice = {"index": index, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": index, "text": text}
        lp = logprobs[index] if logprobs else None
        choices.append(choice | {"finish_reason": finish_reason, "logprobs": lp})
    obj = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices, "usage": counts}


def chunk_object(
    rid: str,
    model: str,
    chat: bool,
    text: str | None,
    finish_reason: str | None,
    first: bool = False,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    """One server-sent event of a streaming answer: a text delta of choice `index` (sample), and
    its finish reason at the end; `logprobs`: those of its tokens since its last chunk, if asked."""
    if chat:
        delta = {"role": "assistant", "content": text or ""} if first else {}
        if text and not first:
            delta["content"] = text
        choice = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text or ""}
    choice |= {"finish_reason": finish_reason, "logprobs": logprobs}
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, chat: bool, counts: dict) -> dict:
    """stream_options.include_usage: the last chunk, with no choices and the token counts."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": counts}
