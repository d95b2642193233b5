"""How to speculate: the `speculative_config` of `LLM(...)` and of the CLI.

Speculative decoding guesses k tokens cheaply and lets the target model check
all of them in one forward pass of k + 1 rows (`engine/speculative/verify.py`).
What guesses is the *proposer*:

    "ngram"        prompt lookup: the last n tokens (n from prompt_lookup_max
                   down to prompt_lookup_min) are searched for earlier in the
                   prompt and output; the k tokens that followed are the guess
    "draft_model"  a second, smaller model with the same tokenizer ("draft" is
                   accepted as an alias); its own paged KV cache

Three spellings are accepted (`parse_speculative_config`), as in vLLM:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    '{"method": "draft_model", "model": "draft.gguf", "num_speculative_tokens": 3}'
    "ngram:4"  or  "draft:PATH:3"                                (shorthand)

With sampling, a draft model's guesses are checked by default with the
coupled rule ("acceptance": "coupled"): the text is the target's own draw at
every position, the same whatever was guessed, alone or batched. "rejection"
is the textbook min(1, p / q), which keeps more of a draft's guesses
(engine/speculative/randomness.py says why the two differ).
"""

import json
from dataclasses import dataclass, fields

from stagewise.errors import StagewiseError

METHODS = ("ngram", "draft_model")
ALIASES = {"draft": "draft_model"}
ACCEPTANCE = ("coupled", "rejection")  # how sampled guesses are checked (randomness.py)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) or "draft_model" (a smaller model)
    num_speculative_tokens: int = 4  # k: the most tokens proposed per request per step
    prompt_lookup_min: int = 2  # ngram: the shortest suffix matched against earlier tokens
    prompt_lookup_max: int = 4  # ngram: the longest suffix tried first
    model: str | None = None  # draft_model: a preset name or a path (.gguf, HF directory)
    # ngram: back off a request whose drafts keep failing (skip proposing for a while, shorter
    # guesses) so free prose, where lookups rarely hit, pays almost nothing for speculation
    adaptive: bool = True
    draft_quantization: str = "none"  # draft_model: weight format of the draft ("none" or "auto")
    # draft_model: keep only the draft's first N layers (then its final norm and LM head): a
    # truncated-layer draft, e.g. the target itself cut short; None = every layer
    draft_num_layers: int | None = None
    # draft_model, sampling: "coupled" (the draft draws with the target's noise and the text is
    # the target's own draw at every position, whatever was guessed: reproducible alone or
    # batched) or "rejection" (the textbook min(1, p / q) with the draft's q rows: more guesses
    # kept, reproducible only while nothing cuts them). n-gram guesses are point masses, for
    # which the two are one rule: always coupled (randomness.py)
    acceptance: str = "coupled"

    def __post_init__(self) -> None:
        method = ALIASES.get(self.method, self.method) if isinstance(self.method, str) else None
        if method not in METHODS:
            raise StagewiseError(
                f"speculative_config.method must be one of ngram, draft_model (or draft), "
                f"got {self.method!r}"
            )
        object.__setattr__(self, "method", method)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StagewiseError(
                    f"speculative_config.{name} must be an int >= 1, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise StagewiseError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not isinstance(self.adaptive, bool):
            raise StagewiseError(
                f"speculative_config.adaptive must be true or false, got {self.adaptive!r}"
            )
        if method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise StagewiseError(
                "speculative_config.model must name the draft model (a preset or a path) "
                "for method draft_model"
            )
        n = self.draft_num_layers
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise StagewiseError(
                f"speculative_config.draft_num_layers must be an int >= 1 or null, got {n!r}"
            )
        if self.acceptance not in ACCEPTANCE:
            raise StagewiseError(
                f"speculative_config.acceptance must be one of {', '.join(ACCEPTANCE)}, "
                f"got {self.acceptance!r}"
            )
        if self.model is not None and not isinstance(self.model, str):
            raise StagewiseError(f"speculative_config.model must be a string, got {self.model!r}")
        from stagewise.models.quantized import parse_scheme

        try:  # checked here, whatever the draft is (the target's own weights ignore it)
            parse_scheme(self.draft_quantization)
        except StagewiseError as exc:
            raise StagewiseError(f"speculative_config.draft_quantization: {exc}") from None

    @property
    def k(self) -> int:
        return self.num_speculative_tokens


def _shorthand(text: str) -> dict:
    """ "ngram:4" / "ngram" / "draft:PATH:3" / "draft_model:PATH" -> a config dict."""
    head, _, rest = text.partition(":")
    method = ALIASES.get(head, head)
    if method == "ngram":
        out = {"method": "ngram"}
        if rest:
            out["num_speculative_tokens"] = _int(rest, "num_speculative_tokens")
        return out
    if method == "draft_model":
        path, sep, k = rest.rpartition(":")
        if not sep or not k.isdigit():  # no ":k" at the end: all of rest is the path
            path, k = rest, ""
        out = {"method": "draft_model", "model": path or None}
        if k:
            out["num_speculative_tokens"] = _int(k, "num_speculative_tokens")
        return out
    raise StagewiseError(
        f"--speculative expects ngram:K or draft:PATH:K (or a JSON object), got {text!r}"
    )


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise StagewiseError(
            f"speculative_config.{name} must be an int >= 1, got {text!r}"
        ) from None


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """A dict, a JSON string, the shorthand "ngram:k" / "draft:PATH:k", a config, or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise StagewiseError(
                    f"--speculative-config is not valid JSON ({exc.msg})"
                ) from None
        else:
            value = _shorthand(text)
    if not isinstance(value, dict):
        raise StagewiseError(
            "speculative_config must be a dict, a JSON object or 'ngram:K', "
            f"got {type(value).__name__}"
        )
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise StagewiseError(
            f"speculative_config has unknown field {unknown[0]!r}; "
            f"known: {', '.join(sorted(known))}"
        )
    return SpeculativeConfig(**value)
