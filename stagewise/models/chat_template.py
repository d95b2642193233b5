"""Chat templates: the jinja2 program that turns a list of messages into one prompt string.

Instruction-tuned models are trained on conversations written in a fixed
layout (SmolLM2 uses ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n`). The
model ships that layout as a jinja2 template; rendering it the way Hugging
Face transformers does (sandboxed, `trim_blocks`, `lstrip_blocks`) gives the
exact prompt the model was trained on.

`apply_chat_template` renders a tokenizer's template for a chat; `chat_segments`
cuts the rendered prompt into the template's own text (which may hold control
tokens) and the messages' content (which is read as plain text).
"""

import functools
import json

from jinja2 import TemplateError
from jinja2.ext import loopcontrols

from stagewise.errors import StagewiseError
from stagewise.models.template_budget import Limits, TemplateLimitError, weight
from stagewise.models.template_sandbox import LimitedSandbox, refuse_other_templates, render
from stagewise.tokenizer.vocabulary import CHATML_TEMPLATE, Tokenizer

__all__ = ["CHATML_TEMPLATE", "apply_chat_template", "chat_segments", "render_chat_template"]

TEMPLATE_CHARS = 1_000_000  # what a template may build and write beyond the messages' own text
TEMPLATE_STEPS = 100_000  # loop iterations per render, plus STEPS_PER_MESSAGE per message
STEPS_PER_MESSAGE = 100
TEMPLATE_CALLS = 5_000  # calls (macros, methods) per render, plus CALLS_PER_MESSAGE per message
CALLS_PER_MESSAGE = 20


def render_chat_template(
    source: str,
    messages: list[dict],
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    origin: str = "the model's chat template",
) -> str:
    """Render `source` for `messages`; `special_tokens` are extra variables such as `bos_token`.

    The template comes from a model file (`origin` names it in every error), so it renders in
    a sandbox with limits (`template_sandbox.py`): its own text, and whatever it builds, may
    exceed the messages' text by TEMPLATE_CHARS; it may take TEMPLATE_STEPS loop iterations
    and TEMPLATE_CALLS calls (more for more messages). Anything that goes wrong inside it is
    one line.
    """
    if not isinstance(source, str):
        raise StagewiseError(f"{origin}: the chat template is a {type(source).__name__}, not text")
    given = weight(messages, 1 << 62) + weight(special_tokens, 1 << 62)
    limits = Limits(
        steps=TEMPLATE_STEPS + STEPS_PER_MESSAGE * len(messages),
        calls=TEMPLATE_CALLS + CALLS_PER_MESSAGE * len(messages),
        chars=TEMPLATE_CHARS + given,
    )
    try:
        template = _compile(source)
        return render(
            template,
            limits,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except TemplateLimitError as err:
        raise StagewiseError(f"{origin}: chat template refused: {err}") from None
    except TemplateError as err:  # a syntax error, an undefined name, raise_exception(...)
        raise StagewiseError(f"{origin}: chat template failed: {err}") from None
    except RecursionError:
        raise StagewiseError(
            f"{origin}: chat template refused: it calls itself (or nests) too deeply"
        ) from None
    except Exception as err:  # the template's own Python errors: 'x' + 1, 1 / 0, ...
        raise StagewiseError(
            f"{origin}: chat template failed: {type(err).__name__}: {err}"
        ) from None


@functools.cache
def _compile(source: str):
    """Compile once per template, with the helpers transformers provides to templates."""
    if len(source) > TEMPLATE_CHARS:
        raise TemplateLimitError(f"the template is {len(source):,} characters long")

    def raise_exception(message: str):
        raise TemplateError(message)

    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.set_filter(  # as transformers: plain JSON, non-ASCII kept
        "tojson", lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    )
    env.globals["raise_exception"] = raise_exception
    ast = env.parse(source)
    refuse_other_templates(ast)
    return env.from_string(ast)


def apply_chat_template(
    tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True
) -> str:
    """Render a chat ([{"role": ..., "content": ...}]) into one prompt string with the model's
    template, as transformers' `apply_chat_template(..., tokenize=False)` does."""
    if not tokenizer.chat_template:
        raise StagewiseError("this model has no chat template; pass a plain prompt instead")
    named = (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id), ("pad", tokenizer.pad_id))
    special = {
        f"{name}_token": tokenizer.tokens[token_id]
        for name, token_id in named
        if token_id is not None
    }
    origin = tokenizer.chat_template_file or "the model's chat template"
    return render_chat_template(
        tokenizer.chat_template, messages, add_generation_prompt, special, origin
    )


def chat_segments(
    tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True
) -> list[tuple[str, bool]]:
    """The rendered chat as (text, is_template) pieces: the template's own text, and each
    message's content.

    Only the template's pieces may hold control tokens (`<|im_start|>`, Llama 3's headers);
    content is tokenized as plain text, so a user cannot forge a system turn by typing
    the markers. The template is rendered with a placeholder in place of each content
    and cut there; a template that trims content (Llama 3's `| trim`) is followed.
    A template whose markers are plain text (Llama 2's `[INST]`) cannot be protected
    this way: the model sees the same tokens either way.
    """
    # private-use code points: no template edits them
    holders = [f"\ue000{i}\ue001" for i in range(len(messages))]
    held = [{**m, "content": h} for m, h in zip(messages, holders)]
    rendered = apply_chat_template(tokenizer, held, add_generation_prompt)
    real = apply_chat_template(tokenizer, messages, add_generation_prompt)
    pieces, order, rest = [], [], rendered
    for _ in messages:
        cut = min(((rest.find(h), i) for i, h in enumerate(holders) if h in rest), default=None)
        if cut is None:
            break
        at, i = cut
        pieces.append(rest[:at])
        order.append(i)
        rest = rest[at + len(holders[i]) :]
    pieces.append(rest)
    for shape in (lambda c: c, str.strip):  # content as given, or trimmed by the template
        contents = [shape(messages[i]["content"]) for i in order]
        segments = [(pieces[0], True)]
        for content, piece in zip(contents, pieces[1:]):
            segments += [(content, False), (piece, True)]
        if "".join(text for text, _ in segments) == real:
            return [(text, is_template) for text, is_template in segments if text]
    raise StagewiseError(
        "this chat template rewrites message content, so user text cannot be kept apart from its "
        "control tokens; pass special_tokens=True to trust the prompt"
    )
