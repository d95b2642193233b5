"""Chat templates: the jinja2 program that turns a list of messages into one prompt string.

Instruction-tuned models are trained on conversations written in a fixed
layout (SmolLM2 uses ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n`). The
model ships that layout as a jinja2 template; rendering it the way Hugging
Face transformers does (sandboxed, `trim_blocks`, `lstrip_blocks`) gives the
exact prompt the model was trained on.
"""

import functools
import json

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stagewise.errors import StagewiseError

# SmolLM2-Instruct's ChatML template, as its GGUF stores it (`tokenizer.chat_template`).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def render_chat_template(
    source: str, messages: list[dict], add_generation_prompt: bool, special_tokens: dict[str, str]
) -> str:
    """Render `source` for `messages`; `special_tokens` are extra variables such as `bos_token`."""
    try:
        return _compile(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except TemplateError as err:
        raise StagewiseError(f"chat template failed: {err}") from err


@functools.cache
def _compile(source: str):
    """Compile once per template, with the helpers transformers provides to templates."""

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, indent=indent, ensure_ascii=False
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
