"""A model's tokenizer, read from the files it ships in (and written back as Hugging Face files).

- A GGUF file: llama.cpp's `tokenizer.ggml.*` metadata (`tokenizer_from_gguf`).
- A Hugging Face directory (`tokenizer_from_hf_dir`): `tokenizer.json` (byte-level BPE, or a
  SentencePiece BPE with `byte_fallback`) or only a SentencePiece `tokenizer.model`, plus
  `tokenizer_config.json` (bos/eos names, add_bos, the chat template) and
  `generation_config.json` (more end-of-sequence ids).

Every reader returns a `stagewise.tokenizer.Tokenizer`; a file it cannot read is one
`StagewiseError` line that names the file. The SentencePiece fields are read in
`sentencepiece_files.py`.
"""

import json
from dataclasses import replace
from pathlib import Path

import gguf

from stagewise.errors import StagewiseError
from stagewise.models import sentencepiece_files
from stagewise.models.files import model_file, read_json_object, read_text
from stagewise.stages.pre_tokenizers import (
    DIGITS_PATTERN,
    GPT2_PATTERN,
    IGNORE_MERGES,
    PRE_TOKENIZERS,
)
from stagewise.tokenizer.vocabulary import TOKENIZER_MODELS, Tokenizer, checked_eos_ids

GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4  # llama.cpp token types matched literally, before BPE


def tokenizer_from_gguf(path: str | Path) -> Tokenizer:
    """Read llama.cpp's `tokenizer.ggml.*` fields of a GGUF file (parsing it takes ~2 s)."""
    from stagewise.models.gguf_loader import open_gguf

    return tokenizer_from_gguf_reader(open_gguf(path), name=Path(path).name)


def tokenizer_from_gguf_reader(reader: gguf.GGUFReader, name: str = "GGUF") -> Tokenizer:
    """The same, from an already open reader (a weight loader can share its reader)."""
    fields = reader.fields

    def read(key: str, default=None):
        return fields[key].contents() if key in fields else default

    model = read("tokenizer.ggml.model")
    template = read("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise StagewiseError(
            f"{name}: tokenizer.chat_template is a {type(template).__name__}, not text"
        )
    end_ids = (read(f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom"))
    common = {
        "bos_id": read("tokenizer.ggml.bos_token_id"),
        "eos_id": read("tokenizer.ggml.eos_token_id"),
        "pad_id": read("tokenizer.ggml.padding_token_id"),
        "chat_template": template,
        "chat_template_file": f"{name} (tokenizer.chat_template)",
        # llama.cpp ends generation on these too (end of turn, end of message: Llama 3's
        # <|eot_id|>, <|eom_id|>)
        "extra_eos_ids": tuple(i for i in end_ids if i is not None),
    }
    if model == "llama":
        return Tokenizer(
            model="llama", **common, **sentencepiece_files.from_gguf_fields(read, name)
        )
    if model != "gpt2":
        known = ", ".join(TOKENIZER_MODELS)
        raise StagewiseError(f"{name}: tokenizer model '{model}' is not supported; known: {known}")
    tokens = read("tokenizer.ggml.tokens")
    token_types = read("tokenizer.ggml.token_type", [])
    literal_types = (GGUF_CONTROL, GGUF_USER_DEFINED)
    special = {tokens[i]: i for i, kind in enumerate(token_types) if kind in literal_types}
    pre = read("tokenizer.ggml.pre", "default")  # llama.cpp's fallback when the key is missing
    return Tokenizer(
        tokens=tokens,
        merges=[tuple(merge.split(" ", 1)) for merge in read("tokenizer.ggml.merges", [])],
        special_tokens=special,
        **common,
        pre=pre,
        add_bos=bool(read("tokenizer.ggml.add_bos_token", False)),
        ignore_merges=pre in IGNORE_MERGES,  # llama.cpp does the same (Llama 3, tekken, ...)
    )


def tokenizer_from_hf_dir(path: str | Path) -> Tokenizer:
    """Read `tokenizer.json` (byte-level or SentencePiece BPE; else `tokenizer.model`) and its
    configs."""
    path = Path(path)
    tokenizer_file = model_file(path, "tokenizer.json")
    if not tokenizer_file.is_file():
        if model_file(path, "tokenizer.model").is_file():
            fields = sentencepiece_files.read_model_proto(path / "tokenizer.model")
            return with_generation_config(_sentencepiece(path, fields), path)
        raise StagewiseError(f"no tokenizer.json or tokenizer.model in {path}")
    spec = read_json_object(tokenizer_file)
    try:
        tokenizer = _from_tokenizer_json(path, tokenizer_file, spec)
    except StagewiseError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:  # a wrong shape
        raise StagewiseError(
            f"{tokenizer_file}: not a tokenizer file this loader understands ({exc!r})"
        ) from None
    return with_generation_config(tokenizer, path)


def with_generation_config(tokenizer: Tokenizer, path: Path) -> Tokenizer:
    """Add `generation_config.json`'s end-of-sequence ids (an int or a list), as transformers
    and vLLM stop on every one of them: Llama 3.1 Instruct lists <|end_of_text|>, <|eom_id|>
    and <|eot_id|>."""
    config_file = model_file(path, "generation_config.json")
    if not config_file.is_file():
        return tokenizer
    listed = read_json_object(config_file).get("eos_token_id")
    listed = [listed] if isinstance(listed, int) and not isinstance(listed, bool) else listed
    if listed is None:
        return tokenizer
    ids = checked_eos_ids(listed, tokenizer.vocab_size, f"{config_file}: eos_token_id")
    others = (i for i in ids if i != tokenizer.eos_id)
    return replace(
        tokenizer, extra_eos_ids=tuple(dict.fromkeys((*tokenizer.extra_eos_ids, *others)))
    )


def _from_tokenizer_json(path: Path, tokenizer_file: Path, spec: dict) -> Tokenizer:
    if sentencepiece_files.is_sentencepiece_json(spec):
        fields = sentencepiece_files.from_tokenizer_json(spec, str(tokenizer_file))
        return _sentencepiece(path, fields)
    model = spec.get("model") or {}
    decoder = (spec.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or decoder != "ByteLevel":
        kind = f"{model.get('type')} model, {decoder} decoder"
        raise StagewiseError(
            f"{tokenizer_file}: {kind}; only GPT-2 style byte-level BPE is supported"
        )
    if spec.get("normalizer"):
        raise StagewiseError(
            f"{tokenizer_file}: a normalizer is not supported by byte-level BPE here"
        )
    pre = pre_name_from_hf(spec.get("pre_tokenizer"))

    by_id = {token_id: token for token, token_id in model["vocab"].items()}
    added = {entry["content"]: entry["id"] for entry in spec.get("added_tokens", [])}
    by_id.update({token_id: token for token, token_id in added.items()})
    if sorted(by_id) != list(range(len(by_id))):
        raise StagewiseError(f"{tokenizer_file}: token ids are not contiguous from 0")
    merges = [
        tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])
    ]

    tokens = [by_id[i] for i in range(len(by_id))]
    lookup = {token: i for i, token in enumerate(tokens)}
    config, template, template_file = _read_hf_config(path)
    # A Llama 3 style file says "add bos" through its post-processor rather than the config.
    bos_from_post = _bos_from_post_processor(spec.get("post_processor"))
    names = {key: _token_name(config.get(f"{key}_token")) for key in ("bos", "eos", "pad")}
    named = {k: names[k] for k in ("bos", "eos")}
    check_named_tokens(named, lookup, path / "tokenizer_config.json")
    return Tokenizer(
        tokens=tokens,
        merges=merges,
        special_tokens=added,
        bos_id=lookup.get(names["bos"] or bos_from_post),
        eos_id=lookup.get(names["eos"]),
        pad_id=lookup.get(names["pad"]),
        chat_template=template,
        chat_template_file=template_file,
        pre=pre,
        add_bos=bool(config.get("add_bos_token", bos_from_post is not None)),
        ignore_merges=bool(model.get("ignore_merges", False)),
    )


def _sentencepiece(path: Path, fields: dict) -> Tokenizer:
    """A SentencePiece vocabulary plus tokenizer_config.json (bos/eos names, add_bos, the chat
    template)."""
    config, template, template_file = _read_hf_config(path)
    lookup = {token: i for i, token in enumerate(fields["tokens"])}
    for key in ("bos", "eos", "pad", "unk"):
        value = _token_name(config.get(f"{key}_token"))
        if value in lookup:
            fields[f"{key}_id"] = lookup[value]
    fields.setdefault("bos_id", lookup.get("<s>"))
    fields.setdefault("eos_id", lookup.get("</s>"))
    # tokenizer.json's post-processor decides; else the config; else True, Llama 2's default.
    add_bos = fields.pop("add_bos", config.get("add_bos_token", True))
    add_bos = bool(add_bos) and fields["bos_id"] is not None
    return Tokenizer(
        model="llama",
        chat_template=template,
        chat_template_file=template_file,
        add_bos=add_bos,
        **fields,
    )


def _token_name(value) -> str | None:
    """A config's `bos_token`: a string, or transformers' {"content": ...} form."""
    return value.get("content") if isinstance(value, dict) else value


def _read_hf_config(path: Path) -> tuple[dict, str | None, str | None]:
    """`tokenizer_config.json` (or {}), the chat template, wherever transformers saved it, and
    the file it came from."""
    config_file = model_file(path, "tokenizer_config.json")
    config = read_json_object(config_file) if config_file.is_file() else {}
    template, where = config.get("chat_template"), str(config_file)
    template_file = model_file(path, "chat_template.jinja")  # newer transformers write it here
    if template_file.is_file():
        template, where = read_text(template_file), str(template_file)
    named = isinstance(template, list) and all(
        isinstance(entry, dict) and "template" in entry for entry in template
    )
    if named:  # named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {entry.get("name"): entry["template"] for entry in template}
        template = by_name.get("default", next(iter(by_name.values()), None))
    if template is not None and not isinstance(template, str):
        raise StagewiseError(
            f"{where}: chat_template is a {type(template).__name__}, not text (nor a list of "
            '{"name": ..., "template": ...} entries)'
        )
    return config, template, where if template is not None else None


def check_named_tokens(names: dict, lookup: dict, where: Path) -> None:
    """A bos/eos token named by the config must be in the vocabulary (else EOS would never stop
    a run)."""
    for key, name in names.items():
        if name is not None and name not in lookup:
            raise StagewiseError(f"{where}: {key}_token {name!r} is not in the vocabulary")


def _bos_from_post_processor(post: dict | None) -> str | None:
    """The token a `TemplateProcessing` post-processor puts first for a single sequence, if any."""
    if not post or post.get("type") != "TemplateProcessing" or not post.get("single"):
        return None
    first = post["single"][0]
    return first["SpecialToken"]["id"] if "SpecialToken" in first else None


def pre_name_from_hf(pre_json: dict | None) -> str:
    """The name of a tokenizer.json `pre_tokenizer` (the inverse of the stage's
    `rust_pre_tokenizer`), or an error."""
    if not pre_json:
        raise StagewiseError(
            "tokenizer.json has no pre-tokenizer; only byte-level BPE is supported"
        )
    steps = pre_json["pretokenizers"] if pre_json.get("type") == "Sequence" else [pre_json]
    patterns, byte_level = [], False
    for step in steps:
        kind = step.get("type")
        isolated = step.get("behavior") == "Isolated"
        if kind == "Digits" and step.get("individual_digits"):
            patterns.append(DIGITS_PATTERN)
        elif kind == "Split" and "Regex" in step.get("pattern", {}) and isolated:
            patterns.append(step["pattern"]["Regex"])
        elif kind == "ByteLevel" and not step.get("add_prefix_space", False):
            byte_level = True
            if step.get("use_regex", True):
                patterns.append(GPT2_PATTERN)
        else:
            raise StagewiseError(
                f"unsupported pre-tokenizer step {step}; need GPT-2 style byte-level BPE"
            )
    if not byte_level:
        raise StagewiseError("tokenizer.json has no ByteLevel pre-tokenizer; need byte-level BPE")
    for name, known in PRE_TOKENIZERS.items():
        if tuple(patterns) == known:
            return name
    raise StagewiseError(
        f"unsupported pre-tokenizer regexes {patterns}; known: {', '.join(PRE_TOKENIZERS)}"
    )


def tokenizer_to_hf_dir(tokenizer: Tokenizer, path: str | Path) -> Path:
    """Write `tokenizer.json` (from the Rust tokenizer) and `tokenizer_config.json` into `path`
    (and `generation_config.json` when there are more end-of-sequence ids than eos)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.rust.save(str(path / "tokenizer.json"))

    def name(token_id: int | None) -> str | None:
        return tokenizer.tokens[token_id] if token_id is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(tokenizer.bos_id),
        "eos_token": name(tokenizer.eos_id),
        "pad_token": name(tokenizer.pad_id),
        "add_bos_token": tokenizer.add_bos,
        "chat_template": tokenizer.chat_template,
    }
    config_text = json.dumps(config, indent=2, ensure_ascii=False)
    (path / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    if tokenizer.extra_eos_ids:  # where transformers keeps the other end-of-sequence ids
        first = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
        eos = [*first, *tokenizer.extra_eos_ids]
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2))
    return path
