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

Fields that the API defines but this engine cannot honour (`n` > 1, `logprobs`,
`echo`, presence / frequency penalties, `logit_bias`) are refused by name
rather than silently ignored; fields nobody defined are ignored, as OpenAI does.
Extra sampling fields that vLLM accepts are accepted too: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`.
"""

import time
import uuid
from dataclasses import dataclass

from stagewise.errors import StagewiseError
from stagewise.sampling_params import SamplingParams

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
        raise APIError(400, f"'{name}' must be {article} {kind}, got {_shown(value)}", param=name)
    return value


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse_unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise APIError(400, f"only n=1 is supported, got n={_shown(n)}", param="n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise APIError(400, f"only best_of=1 is supported, got {_shown(best_of)}", param="best_of")
    for name in ("logprobs", "top_logprobs", "echo"):
        if body.get(name) not in (None, False, 0):
            raise APIError(400, f"'{name}' is not supported by this server", param=name)
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
    return prompt


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
            raise APIError(400, f"'{where}.role' must be one of {', '.join(ROLES)}, got {_shown(role)}", param=where)
        out.append({"role": role, "content": _content(m.get("content"), where)})
    return out


def _content(content, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(400, f"'{where}.content' may hold only text parts", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"'{where}.content' must be a string, got {_shown(content)}", param=where)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a string or a list of non-empty strings, got {_shown(stop)}", param="stop")
    return tuple(stop)


def parse_request(body, *, chat: bool, model_name: str) -> ParsedRequest:
    """Check an OpenAI completion (or chat completion) request; -> what the engine needs."""
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
        stop=_stop(body),
        ignore_eos=_get(body, "ignore_eos", "bool", False),
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


def completion_object(rid: str, model: str, chat: bool, text: str, finish_reason: str | None, counts: dict) -> dict:
    """The whole answer of a non-streaming request."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    choice |= {"finish_reason": finish_reason, "logprobs": None}
    obj = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice], "usage": counts}


def chunk_object(
    rid: str, model: str, chat: bool, text: str | None, finish_reason: str | None, first: bool = False
) -> dict:
    """One server-sent event of a streaming answer: a text delta, and the finish reason at the end."""
    if chat:
        delta = {"role": "assistant", "content": text or ""} if first else {}
        if text and not first:
            delta["content"] = text
        choice = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text or ""}
    choice |= {"finish_reason": finish_reason, "logprobs": None}
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, chat: bool, counts: dict) -> dict:
    """stream_options.include_usage: the last chunk, with no choices and the token counts."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": counts}
