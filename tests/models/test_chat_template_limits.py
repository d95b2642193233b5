"""Chat templates come from model files: a hostile one is refused in well under a second, with one
line that names the file, and an ordinary one renders exactly as plain jinja2 renders it."""

import json
import time

import gguf
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stagewise.errors import StagewiseError
from stagewise.models.chat_template import apply_chat_template, render_chat_template
from stagewise.models.tokenizer_files import tokenizer_from_gguf, tokenizer_from_hf_dir, tokenizer_to_hf_dir
from stagewise.tokenizer import Tokenizer
from tests.checkpoints import write_tiny_bpe_tokenizer

CHAT = [{"role": "user", "content": "Hi"}]

HOSTILE = {  # name -> (template, what the one-line error says)
    "nested-range-loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "range of 100,000 items: more than the",
    ),
    "nested-string-loops": (
        "{% set s = 'x' * 900000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "loop iterations",
    ),
    "string-times-10-billion": ("{{ 'x' * 10000000000 }}", "'*' would hold more than"),
    "list-times-10-billion": ("{{ ['x'] * 10000000000 }}", "'*' would hold more than"),
    "power-tower": ("{{ 10 ** 100000000 }}", "'**' would build an integer of"),
    "doubling-strings": (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "'~' would hold more than",
    ),
    "doubling-lists": (
        "{% set a = 'x' * 100000 %}{% set b = [a, a, a, a, a, a, a, a] %}"
        "{% set c = [b, b, b, b, b, b, b, b] %}{{ c | length }}",
        "a list or dict literal would hold",
    ),
    "printf-width": ("{{ '%10000000000s' % 'x' }}", "'%' would hold more than"),
    "format-width": ("{{ '{:>10000000000}'.format('x') }}", "'.format()' would hold"),
    "center-filter": ("{{ 'x' | center(10000000000) }}", "filter 'center' would hold"),
    "replace-method": ("{% set a = 'x' * 100000 %}{{ a.replace('x', a) }}", "'.replace()'"),
    "join-filter": ("{% set a = 'x' * 100000 %}{{ a | join(a) }}", "filter 'join' would hold"),
    "macro-fan-out": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
        "calls",
    ),
    "output-flood": ("{% for i in range(90000) %}{{ 'x' * 1000 }}{% endfor %}", "characters"),
    "macro-buffer-flood": (
        "{% macro m() %}{% for i in range(90000) %}" + "x" * 100 + "{% endfor %}{% endmacro %}{% set y = m() %}",
        "characters",
    ),
    "allocating-loop": (
        "{% for i in range(100000) %}{% if 'x' * 1000000 %}{% endif %}{% endfor %}",
        "built more than",
    ),
    "sorting-loop": (
        "{% set l = range(90000) | list %}{% for i in range(1000) %}{% set y = l | sort %}{% endfor %}",
        "filter 'sort' walks 90,000 items",
    ),
    "recursive-macro": (
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
        "calls itself (or nests) too deeply",
    ),
    "include": ("{% include 'secrets.txt' %}", "'include' loads another template"),
    "import": ("{% import 'x.j2' as x %}", "'import' loads another template"),
    "from-import": ("{% from 'x.j2' import y %}", "'from-import' loads another template"),
    "extends": ("{% extends 'base.j2' %}", "'extends' loads another template"),
    "raw-python-error": ("{{ 'x' + 1 }}", "TypeError: can only concatenate str"),
    "syntax-error": ("{% for %}", "chat template failed"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_refused_quickly(name):
    template, message = HOSTILE[name]
    start = time.perf_counter()
    with pytest.raises(StagewiseError, match="^the-model-file: chat template") as err:
        render_chat_template(template, CHAT, True, {}, origin="the-model-file")
    assert time.perf_counter() - start < 1.0  # ~0.01-0.3 s here; without the limits: minutes or 10 GB
    assert message in str(err.value) and "\n" not in str(err.value)


def plain_jinja(source: str, messages: list[dict], **variables) -> str:
    """The same template through jinja2's own sandbox, as transformers renders it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    return env.from_string(source).render(messages=messages, **variables)


TOOL_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for m in messages | selectattr('role', 'equalto', 'system') %}{% set ns.system = m.content | trim %}{% endfor %}
{%- if tools %}{% for t in tools %}{{ t | tojson(indent=4) }}{{ '\\n' if not loop.last }}{% endfor %}{% endif %}
{{- ns.system }}
{%- for m in messages if m.role != 'system' %}
{%- if loop.index0 % 2 == 0 and m.role != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}
{{- '<|' ~ m.role ~ '|>\\n' ~ m.content.strip() ~ '<|end|>\\n' }}
{%- if loop.length > 100000 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"""


@pytest.mark.parametrize("turns", [1, 2000])
def test_ordinary_templates_render_as_plain_jinja(turns):
    """Tools as indented JSON, a namespace, loop filters, 4000 turns and a 1 MB message: the limits grow with
    the messages, so none of this comes near them."""
    tools = [{"name": f"tool{i}", "parameters": {"x": {"type": "string"}}} for i in range(20)]
    messages = [{"role": "system", "content": " be brief "}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"question {i} " * 10}, {"role": "assistant", "content": "ok"}]
    messages.append({"role": "user", "content": "long " * 200_000})
    variables = {"bos_token": "<s>", "tools": tools}
    expected = plain_jinja(TOOL_TEMPLATE, messages, add_generation_prompt=True, **variables)
    assert render_chat_template(TOOL_TEMPLATE, messages, True, variables) == expected


def test_the_error_names_the_hf_file_the_template_came_from(tmp_path):
    folder = tokenizer_to_hf_dir(Tokenizer.tiny(), tmp_path / "model")  # then a hostile template in its config
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = HOSTILE["string-times-10-billion"][0]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = tokenizer_from_hf_dir(folder)
    with pytest.raises(StagewiseError, match=rf"^{folder / 'tokenizer_config.json'}: chat template refused"):
        apply_chat_template(tokenizer, CHAT)
    (folder / "chat_template.jinja").write_text("{% include 'x' %}")  # newer transformers' file wins
    with pytest.raises(StagewiseError, match=rf"^{folder / 'chat_template.jinja'}: chat template refused"):
        apply_chat_template(tokenizer_from_hf_dir(folder), CHAT)


@pytest.mark.parametrize(
    ("template", "kind"),
    [(5, "int"), (["{{ x }}"], "list"), ([{"name": "default", "template": 7}], "int"), ({"a": 1}, "dict")],
    ids=["number", "list-of-strings", "named-number", "object"],
)
def test_a_non_string_template_in_tokenizer_config_is_refused_by_type(tmp_path, template, kind):
    folder = tokenizer_to_hf_dir(Tokenizer.tiny(), tmp_path / "model")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(StagewiseError, match=rf"tokenizer_config.json: chat_template is a {kind}, not text"):
        tokenizer_from_hf_dir(folder)


def test_a_chat_template_file_that_is_not_utf8_is_one_line(tmp_path):
    folder = tokenizer_to_hf_dir(Tokenizer.tiny(), tmp_path / "model")
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(StagewiseError, match=r"^cannot read .*chat_template.jinja: 'utf-8' codec"):
        tokenizer_from_hf_dir(folder)


def tokenizer_gguf(path, add_template) -> str:
    """A GGUF holding only the tiny tokenizer, its chat template written by `add_template(writer)`."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_chat_template = lambda _template: add_template(w)  # in place of the tiny ChatML template
    write_tiny_bpe_tokenizer(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize(("value", "kind"), [(12345, "int"), (["a", "b"], "list")], ids=["number", "array"])
def test_a_non_string_template_in_gguf_metadata_is_refused_by_type(tmp_path, value, kind):
    def add(w):
        if isinstance(value, int):
            w.add_uint32("tokenizer.chat_template", value)
        else:
            w.add_array("tokenizer.chat_template", value)

    path = tokenizer_gguf(tmp_path / "t.gguf", add)
    with pytest.raises(StagewiseError, match=rf"^t.gguf: tokenizer.chat_template is a {kind}, not text$"):
        tokenizer_from_gguf(path)


def test_a_gguf_template_error_names_the_file_and_key(tmp_path):
    template = HOSTILE["nested-range-loops"][0]
    path = tokenizer_gguf(tmp_path / "hostile.gguf", lambda w: w.add_string("tokenizer.chat_template", template))
    tokenizer = tokenizer_from_gguf(path)
    with pytest.raises(StagewiseError, match=r"^hostile.gguf \(tokenizer.chat_template\): chat template refused"):
        apply_chat_template(tokenizer, CHAT)
