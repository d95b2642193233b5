"""Load a Hugging Face Llama checkpoint directory into `LlamaWeights`.

The directory holds `config.json` (architecture and sizes), one or more
`*.safetensors` shards with `torch.nn.Linear` weights ([out, in]) named
`model.layers.{i}.self_attn.q_proj.weight` and so on, and `tokenizer.json`.
Hugging Face's layout already uses rotate-half RoPE, so no row permutation.
"""

from pathlib import Path

import torch

from stagewise.config import ModelConfig, RopeScaling, config_from_hf_dict, hf_rope_dict, is_number
from stagewise.errors import StagewiseError
from stagewise.models.files import model_file, read_json_object, unused_tensors
from stagewise.models.quantize_at_load import quantize_weights
from stagewise.models.weights import LayerWeights, LlamaWeights


def config_from_hf(path: Path) -> ModelConfig:
    config_file = model_file(path, "config.json")
    if not config_file.is_file():
        raise StagewiseError(
            f"{path} has no config.json; expected a Hugging Face Llama checkpoint directory"
        )
    cfg = read_json_object(config_file)
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        kind = cfg.get("model_type") or ", ".join(map(str, archs)) or "unknown"
        raise StagewiseError(
            f"{path}: model type '{kind}' is not supported; stagewise runs Llama models"
        )
    check_llama_math(cfg, config_file)
    rope_scaling = rope_scaling_from_hf(hf_rope_dict(cfg, str(config_file)), cfg, path)
    return config_from_hf_dict(cfg, str(path), str(config_file), rope_scaling=rope_scaling)


SILU_NAMES = ("silu", "swish")  # transformers' names for x * sigmoid(x)


def check_llama_math(cfg: dict, where: Path) -> None:
    """Refuse config.json options that change a Llama's arithmetic and that stagewise lacks.

    Ignoring any of them would run and print fluent text from the wrong model: biases on the
    projections (`attention_bias`, `mlp_bias`: in the weight files too), an FFN activation other
    than SiLU, or attention limited to a sliding window (Mistral's config spelled with a Llama
    architecture).
    """
    act = cfg.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise StagewiseError(
            f"{where}: hidden_act {act!r} is not supported; a Llama FFN is SwiGLU (hidden_act "
            "'silu')"
        )
    for key, what in (("attention_bias", "q/k/v/o projections"), ("mlp_bias", "FFN projections")):
        if cfg.get(key):
            raise StagewiseError(
                f"{where}: {key} is true (biases on the {what}); stagewise runs Llama without "
                "biases"
            )
    window, limit = cfg.get("sliding_window"), cfg.get("max_position_embeddings", 2048)
    if is_number(window) and is_number(limit) and window < limit:
        raise StagewiseError(
            f"{where}: sliding_window {window} limits attention to the last {window} tokens; "
            "stagewise attends to the whole context (sliding-window attention is not supported)"
        )


def rope_scaling_from_hf(params: dict, cfg: dict, path: Path) -> RopeScaling | None:
    """config.json's `rope_scaling` (transformers >= 5: `rope_parameters`) -> RopeScaling or None.

    `{"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}` is Llama 3.2's; older files spell the key "type".
    """
    where = path / "config.json"
    if not isinstance(params, dict):
        raise StagewiseError(f"{where}: rope_scaling must be a JSON object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return None

    def number(key: str) -> float:
        if key not in params:
            raise StagewiseError(f"{where}: RoPE scaling '{kind}' lacks '{key}'")
        value = params[key]
        if not is_number(value):
            raise StagewiseError(f"{where}: RoPE scaling {key} must be a number, got {value!r}")
        return float(value)

    try:
        if kind == "linear":
            return RopeScaling(kind="linear", factor=number("factor"))
        if kind == "llama3":
            # as transformers: a top-level original_max_position_embeddings wins, then the RoPE
            # dict's, then max_position_embeddings
            original = (
                cfg.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings")
                or cfg.get("max_position_embeddings", 2048)
            )
            return RopeScaling(
                kind="llama3",
                factor=number("factor"),
                low_freq_factor=number("low_freq_factor"),
                high_freq_factor=number("high_freq_factor"),
                original_max_position_embeddings=original,
            )
    except StagewiseError as exc:
        if str(where) in str(exc):
            raise
        raise StagewiseError(f"{where}: {exc}") from None
    raise StagewiseError(
        f"{path}: RoPE scaling '{kind}' is not supported; known: default, linear, llama3"
    )


def _open_shards(path: Path) -> dict:
    """Tensor name -> the open `*.safetensors` shard holding it (headers only: nothing read yet).

    A tensor stored in two shards is refused: one of the copies would silently win (a stale
    `model.safetensors` left beside `model-00001-of-00002.safetensors` is the usual way), and
    which one the model was saved with cannot be told from the files.
    """
    from safetensors import SafetensorError, safe_open

    shards = [model_file(path, shard.name) for shard in sorted(path.glob("*.safetensors"))]
    if not shards:
        raise StagewiseError(f"{path} has no *.safetensors weight files")
    where = {}
    for shard in shards:
        try:
            handle = safe_open(shard, framework="pt")
        except (SafetensorError, OSError, ValueError) as exc:
            raise StagewiseError(
                f"{shard} is not a valid safetensors file (truncated or corrupt?): {exc}"
            ) from None
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
            if name in where:
                raise StagewiseError(
                    f"tensor '{name}' is stored twice, in {where[name][0].name} and {shard.name} "
                    f"({path}); remove the shard that does not belong to this model"
                )
            where[name] = (shard, handle)
    return where


def load_hf_dir(
    path: str | Path, dtype: torch.dtype = torch.float32, quantization: str = "none"
) -> tuple[ModelConfig, LlamaWeights]:
    """Hugging Face Llama directory -> (config, weights in `dtype` on CPU), one tensor at a time.

    quantization "int8" / "int4" (":g64", ...): the projections and the embedding are quantized
    after loading (`models/quantize_at_load.py`); "none" / "auto": floats, as stored.
    """
    from safetensors import SafetensorError

    path = Path(path)
    config = config_from_hf(path)
    shards = _open_shards(path)

    used = set()

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        used.add(name)
        if name not in shards:
            raise StagewiseError(f"{path}: tensor '{name}' is missing")
        shard, handle = shards[name]
        try:
            stored = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise StagewiseError(
                f"{shard} is not a valid safetensors file (truncated or corrupt?): {exc}"
            ) from None
        if not stored.is_floating_point():
            raise StagewiseError(
                f"{shard}: tensor '{name}' is {stored.dtype}; quantized weights are not supported"
            )
        if tuple(stored.shape) != shape:
            raise StagewiseError(
                f"{path}: tensor '{name}' has shape {tuple(stored.shape)}, expected {shape}"
            )
        t = stored.to(dtype)
        del stored
        # NaN in the file, or a value beyond `dtype`'s range (float16: 65504)
        if not torch.isfinite(t).all():
            raise StagewiseError(
                f"{shard}: tensor '{name}' holds NaN or values infinite in {dtype}"
            )
        return t

    hidden, inter, q, kv = (
        config.hidden_size,
        config.intermediate_size,
        config.q_size,
        config.kv_size,
    )
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        wq = get(p + "self_attn.q_proj.weight", (q, hidden))
        wk = get(p + "self_attn.k_proj.weight", (kv, hidden))
        wv = get(p + "self_attn.v_proj.weight", (kv, hidden))
        gate = get(p + "mlp.gate_proj.weight", (inter, hidden))
        up = get(p + "mlp.up_proj.weight", (inter, hidden))
        layers.append(
            LayerWeights(
                attn_norm=get(p + "input_layernorm.weight", (hidden,)),
                w_qkv=torch.cat([wq, wk, wv], dim=0).t(),  # -> [hidden, (H+2Hkv)*d]
                w_o=get(p + "self_attn.o_proj.weight", (hidden, q)).t(),  # -> [H*d, hidden]
                ffn_norm=get(p + "post_attention_layernorm.weight", (hidden,)),
                w_gate_up=torch.cat([gate, up], dim=0).t(),  # -> [hidden, 2*inter]
                w_down=get(p + "mlp.down_proj.weight", (hidden, inter)).t(),  # -> [inter, hidden]
            )
        )
    embed = get("model.embed_tokens.weight", (config.vocab_size, hidden))
    head = (
        embed if config.tie_word_embeddings else get("lm_head.weight", (config.vocab_size, hidden))
    )
    # many files store the tied copy as well
    if config.tie_word_embeddings and "lm_head.weight" in shards:
        if not torch.equal(get("lm_head.weight", (config.vocab_size, hidden)), embed):
            raise StagewiseError(
                f"{path}: config.json ties the LM head to the embedding (tie_word_embeddings), but "
                "the weight "
                "files hold a different lm_head.weight; which one the model was trained with is "
                "ambiguous"
            )
    lm_head = head.t()  # [vocab, hidden] -> [hidden, vocab] view (tied: the table itself)
    final_norm = get("model.norm.weight", (hidden,))
    check_nothing_left(path, set(shards) - used)
    weights = LlamaWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
    return config, quantize_weights(weights, quantization, str(path))


def check_nothing_left(path: Path, unused: set[str]) -> None:
    """Every tensor in the files must be one the Llama forward pass uses: an extra one (a bias, a
    layer beyond num_hidden_layers, another model's head) means the model is not the one stagewise
    would run. RoPE's `inv_freq` buffers, saved by older transformers, are derived from config.json
    and skipped."""
    shown = unused_tensors(unused, derived=("rotary_emb.inv_freq",))
    if shown:
        raise StagewiseError(
            f"{path}: the weight files hold tensors a Llama of this config.json does not use: "
            f"{shown}"
        )
