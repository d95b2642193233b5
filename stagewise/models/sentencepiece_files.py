"""Read a SentencePiece (Llama 1/2, TinyLlama, Mistral) vocabulary from the three files it ships in.

Each reader returns the keyword arguments of `Tokenizer` for `model="llama"`:
token strings, one score and one type per token (numbered as in
`stagewise/tokenizer/sentencepiece.py`), the literal tokens, bos/eos/unk, and where
the "▁" dummy prefix goes.

- GGUF: llama.cpp's `tokenizer.ggml.tokens / scores / token_type`, `add_bos_token`,
  `add_space_prefix`.
- `tokenizer.json` (Hugging Face): a BPE model with `byte_fallback`; it has no scores,
  only a merge list, so a piece's score is minus the rank of the first merge that
  builds it (merging by score is then merging by rank).
- `tokenizer.model`: sentencepiece's own file, a protobuf. We read the few fields we
  need straight from its wire format (`read_model_proto`), so neither the
  `sentencepiece` nor the `protobuf` package is needed.
"""

import struct
from pathlib import Path

from stagewise.errors import StagewiseError
from stagewise.stages.tokenize_sentencepiece import byte_value
from stagewise.tokenizer.sentencepiece import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    literal_tokens,
)

SENTENCEPIECE_BPE = 2  # TrainerSpec.model_type: 1 unigram, 2 BPE, 3 word, 4 char


def from_gguf_fields(read, name: str) -> dict:
    """`read(key, default)` reads one GGUF metadata key."""
    tokens = read("tokenizer.ggml.tokens")
    scores = read("tokenizer.ggml.scores")
    types = read("tokenizer.ggml.token_type")
    if not tokens or scores is None or types is None:
        raise StagewiseError(
            f"{name}: a 'llama' tokenizer needs tokenizer.ggml.tokens, scores and token_type"
        )
    return {
        "tokens": tokens,
        "merges": [],
        "scores": [float(s) for s in scores],
        "token_types": [int(t) for t in types],
        "special_tokens": literal_tokens(tokens, types),
        "unk_id": read("tokenizer.ggml.unknown_token_id"),
        "add_bos": bool(
            read("tokenizer.ggml.add_bos_token", True)
        ),  # llama.cpp's default for SentencePiece
        "space_prefix": "sentencepiece"
        if read("tokenizer.ggml.add_space_prefix", True)
        else "none",
    }


def is_sentencepiece_json(spec: dict) -> bool:
    model = spec.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def from_tokenizer_json(spec: dict, where: str) -> dict:
    """A Llama 2 style tokenizer.json: BPE + byte_fallback, "▁" by normalizer or Metaspace."""
    model = spec["model"]
    by_id = {token_id: token for token, token_id in model["vocab"].items()}
    added = spec.get("added_tokens", [])
    by_id.update({entry["id"]: entry["content"] for entry in added})
    if sorted(by_id) != list(range(len(by_id))):
        raise StagewiseError(f"{where}: token ids are not contiguous from 0")
    tokens = [by_id[i] for i in range(len(by_id))]
    merges = [
        tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])
    ]
    first_rank = {}
    for rank, (left, right) in enumerate(merges):
        first_rank.setdefault(left + right, rank)
    added_kind = {
        entry["content"]: CONTROL if entry.get("special") else USER_DEFINED for entry in added
    }
    types = [
        added_kind.get(token)
        or (
            UNKNOWN
            if token == model.get("unk_token")
            else BYTE
            if byte_value(token) is not None
            else NORMAL
        )
        for token in tokens
    ]
    # A piece no merge builds can never be formed by merging: -inf keeps it out of the score table.
    scores = [
        -float(first_rank[t]) if t in first_rank else (0.0 if len(t) == 1 else float("-inf"))
        for t in tokens
    ]
    unk = model.get("unk_token")
    post = spec.get("post_processor") or {}
    bos_first = (
        post.get("type") == "TemplateProcessing"
        and "SpecialToken" in (post.get("single") or [{}])[0]
    )
    return {
        **(
            {"add_bos": bos_first} if post.get("type") == "TemplateProcessing" else {}
        ),  # the file says it
        "tokens": tokens,
        "merges": merges,
        "scores": scores,
        "token_types": types,
        "special_tokens": literal_tokens(tokens, types),
        "unk_id": tokens.index(unk) if unk in tokens else None,
        "space_prefix": _space_prefix_of(spec, where),
    }


def _space_prefix_of(spec: dict, where: str) -> str:
    """Which SPACE_PREFIXES scheme a tokenizer.json's normalizer / pre-tokenizer spells."""
    norm, pre = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}
    steps = (
        norm.get("normalizers", [norm])
        if norm.get("type") == "Sequence"
        else [norm]
        if norm
        else []
    )
    kinds = [step.get("type") for step in steps]
    if pre.get("type") == "Metaspace" and not pre.get("split", True) and not steps:
        scheme = pre.get("prepend_scheme", "always")
        return {"always": "metaspace-always", "first": "metaspace-first", "never": "none"}[scheme]
    if not pre and kinds in (["Prepend", "Replace"], ["Replace"]):
        if kinds[0] == "Prepend" and steps[0].get("prepend") != "▁":
            raise StagewiseError(
                f"{where}: normalizer prepends {steps[0].get('prepend')!r}, expected '▁'"
            )
        return "sentencepiece" if kinds[0] == "Prepend" else "none"
    raise StagewiseError(
        f"{where}: unsupported SentencePiece normalizer {kinds} / pre-tokenizer {pre.get('type')}"
    )


# ---- tokenizer.model: protobuf wire format ---------------------------------------------------
# ModelProto { repeated SentencePiece pieces = 1; TrainerSpec trainer_spec = 2;
#              NormalizerSpec normalizer_spec = 3; }
# SentencePiece { string piece = 1; float score = 2; Type type = 3; }
# TrainerSpec { ModelType model_type = 3; int32 unk_id = 40; bos_id = 41; eos_id = 42;
#               pad_id = 43; }
# NormalizerSpec { string name = 1; bool add_dummy_prefix = 3; bool remove_extra_whitespaces = 4; }


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """One protobuf message -> [(field number, value)]: varints as ints, the rest as raw bytes."""
    out, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((number, value))
    return out


def _int32(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value  # negative int32s are 10-byte varints


def read_model_proto(path: Path) -> dict:
    """tokenizer.model -> the Tokenizer keyword arguments (BPE, identity normalization only)."""
    try:
        top = _fields(path.read_bytes())
        pieces = [dict(_fields(value)) for number, value in top if number == 1]
        trainer = dict(next((_fields(v) for n, v in top if n == 2), []))
        normalizer = dict(next((_fields(v) for n, v in top if n == 3), []))
        tokens = [p[1].decode("utf-8") for p in pieces]
        scores = [struct.unpack("<f", p[2])[0] if 2 in p else 0.0 for p in pieces]
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, struct.error) as exc:
        raise StagewiseError(f"{path} is not a valid SentencePiece model: {exc}") from None
    types = [int(p.get(3, NORMAL)) for p in pieces]
    if trainer.get(3, 1) != SENTENCEPIECE_BPE:
        kind = trainer.get(3, 1)
        raise StagewiseError(
            f"{path}: SentencePiece model type {kind} is not supported; only BPE (2) is"
        )
    name = normalizer.get(1, b"identity").decode()
    if name != "identity" or normalizer.get(4, 1):
        raise StagewiseError(
            f"{path}: normalizer '{name}' (or extra-whitespace removal) is not supported; "
            "need identity"
        )

    def token_id(number: int, default: int) -> int | None:
        value = _int32(trainer.get(number, default))
        return value if 0 <= value < len(tokens) else None

    return {
        "tokens": tokens,
        "merges": [],
        "scores": scores,
        "token_types": types,
        "special_tokens": literal_tokens(tokens, types),
        "unk_id": token_id(40, 0),
        "bos_id": token_id(41, 1),
        "eos_id": token_id(42, 2),
        "pad_id": token_id(43, -1),
        "space_prefix": "sentencepiece" if normalizer.get(3, 1) else "none",
    }
