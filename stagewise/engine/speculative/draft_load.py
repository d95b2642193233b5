"""Loading the draft model, and checking that it can draft for the target.

`load_draft` loads `speculative_config.model` on the target's device in its
dtype — or, when it names the target itself, shares the target's weights — and
keeps its first `draft_num_layers` layers when asked (`truncated`).

Can this model draft for that one? Both must speak the same token ids.

Speculative decoding hands the draft model's token ids straight to the target:
the target verifies draft id 1734 as *its* id 1734. That is only meaningful
when both models share the vocabulary exactly — the same number of rows in the
LM head (the q and p rows are compared index by index), the same token string
behind every id, and the same special ids (bos, eos, the extra end-of-sequence
ids, the literal special tokens), since a draft that believed another id ends
the text would propose past the end. (A pad id only matters to padded static
batches, which speculation never runs: a file that does not name one is fine.)
Two checkpoints of one family (SmolLM2-135M and -360M, Llama 3.2 1B and 3.1 8B)
pass; models with merely similar vocabularies do not.

`check_same_vocabulary` says in one line what differs, so the user knows which
file to replace.
"""

from dataclasses import replace
from pathlib import Path

from stagewise.errors import StagewiseError
from stagewise.models.registry import LoadedModel, load_model


def _shown(token: str) -> str:
    text = repr(token)
    return text if len(text) <= 30 else text[:27] + "..."


def vocabulary_difference(target: LoadedModel, draft: LoadedModel) -> str | None:
    """None when the draft can propose ids to the target, else what differs (a short phrase)."""
    t_cfg, d_cfg = target.config, draft.config
    if t_cfg.vocab_size != d_cfg.vocab_size:
        return f"vocab size {d_cfg.vocab_size}, the target's is {t_cfg.vocab_size}"
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    if t_tok.model != d_tok.model:
        return f"tokenizer kind '{d_tok.model}', the target's is '{t_tok.model}'"
    if len(t_tok.tokens) != len(d_tok.tokens):
        return f"{len(d_tok.tokens)} tokens, the target's tokenizer has {len(t_tok.tokens)}"
    if t_tok.tokens != d_tok.tokens:  # one C-level comparison; find the first difference only then
        i = next(i for i, (a, b) in enumerate(zip(t_tok.tokens, d_tok.tokens)) if a != b)
        return f"token {i} is {_shown(d_tok.tokens[i])}, the target's is {_shown(t_tok.tokens[i])}"
    for name in ("bos_id", "eos_id"):
        mine, theirs = getattr(d_tok, name), getattr(t_tok, name)
        if mine != theirs:
            return f"{name} {mine}, the target's is {theirs}"
    if d_tok.stop_ids != t_tok.stop_ids:
        mine, theirs = sorted(d_tok.stop_ids), sorted(t_tok.stop_ids)
        return f"end-of-sequence ids {mine}, the target's are {theirs}"
    if d_tok.special_tokens != t_tok.special_tokens:
        differ = sorted(set(d_tok.special_tokens.items()) ^ set(t_tok.special_tokens.items()))
        return f"special tokens differ ({', '.join(f'{_shown(s)}={i}' for s, i in differ[:3])})"
    return None


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse, in one line naming the difference, a draft whose token ids mean something else."""
    difference = vocabulary_difference(target, draft)
    if difference is not None:
        raise StagewiseError(
            f"draft model {draft.source} cannot draft for {target.source}: its vocabulary differs "
            f"({difference}); speculative decoding needs the same tokenizer"
        )


def names_target(model: str, target: LoadedModel) -> bool:
    """Does `model` (a preset name or a path) name the target's own weights?"""
    if model == target.config.name:
        return True
    try:
        return Path(model).expanduser().resolve() == Path(target.source).resolve()
    except (OSError, ValueError):
        return False


def truncated(model: LoadedModel, num_layers: int) -> LoadedModel:
    """The first `num_layers` blocks of `model`, then its final norm and LM head (no copy).

    Early layers already point the residual stream roughly where the last ones take it, so
    a model cut short is a draft that agrees with its full self more often than chance."""
    total = model.config.num_layers
    if num_layers > total:
        raise StagewiseError(
            f"speculative_config.draft_num_layers={num_layers}, but the draft model "
            f"{model.source} has {total} layers"
        )
    return replace(
        model,
        config=replace(model.config, num_layers=num_layers),
        weights=replace(model.weights, layers=model.weights.layers[:num_layers]),
        source=f"{model.source} (first {num_layers} of {total} layers)",
    )


def load_draft(config, target: LoadedModel) -> LoadedModel:
    """`config.model` on the target's device in its dtype; cut to `config.draft_num_layers`.

    A draft that names the target itself shares the target's weights (and their format) instead
    of loading a second copy: with draft_num_layers it is the target's own first layers."""
    if names_target(config.model, target):
        draft = target
    else:
        quantization = getattr(config, "draft_quantization", "none")
        draft = load_model(config.model, target.device, target.dtype, quantization)
    num_layers = getattr(config, "draft_num_layers", None)
    return draft if num_layers is None else truncated(draft, num_layers)
