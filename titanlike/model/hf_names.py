"""The names a Hugging Face config.json gives a model's shape, and titanlike's ModelArgs: the mapping
both ways, as plain data and functions (no torch, no file I/O). Resolving a `--model.flavor hf` run
reads a folder's config.json into ModelArgs with it (config/resolve.py); the export writes one
(hf/interchange.py).

A model without QK-norm is a `LlamaForCausalLM`; with QK-norm a `Qwen3ForCausalLM`. Anything the
decoder cannot reproduce exactly (biases, rope scaling of any kind, sliding windows, another
activation) is refused with one line: a model that trained differently from what transformers
loads would be a silent error.
"""

from __future__ import annotations

from titanlike.errors import UserError
from titanlike.model.shape import ModelArgs

CONFIG = "config.json"
ATTN_MASK_KEY = "titanlike_attn_mask"


def hf_config(a: ModelArgs, dtype_name: str, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers: Qwen3 with QK-norm, else Llama. Both the older keys (rope_theta,
    torch_dtype) and transformers 5's (rope_parameters, dtype) are written, so either reads it."""
    config = {
        "architectures": ["Qwen3ForCausalLM" if a.qk_norm else "LlamaForCausalLM"],
        "model_type": "qwen3" if a.qk_norm else "llama",
        "hidden_size": a.dim,
        "intermediate_size": a.ffn_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "vocab_size": a.vocab_size,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
        "rope_scaling": None,
        "max_position_embeddings": a.max_seq_len,
        "tie_word_embeddings": a.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if a.qk_norm:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=a.n_layers)
    else:
        config["mlp_bias"] = False
    if a.attn_mask != "causal":
        # What it trained with (transformers keeps the key and ignores it): plain causal attention over one
        # prompt is the same thing, as long as the prompt is one document.
        config[ATTN_MASK_KEY] = a.attn_mask
    return config


def _whole(config: dict, key: str, where: str, default: int | None = None) -> int:
    """config[key] as a whole number (`default` where it is absent or null; none: it must be there). A bool, a
    string or a fraction is refused rather than converted: int() would read 256.7 as 256 and true as 1."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise UserError(f"{where} lacks {key}, which the model's shape needs")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where}: {key} is {value!r}, not a whole number")
    return value


def _positive(value: object, key: str, where: str) -> float:
    """A number of config.json that must be finite and > 0 (rope_theta, rms_norm_eps): anything else, one line.
    JSON's NaN and Infinity literals parse as floats, and a rope_theta of 0 once became 10000 unsaid."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise UserError(f"{where}: {key} is {value!r}; it must be a finite number > 0")
    return float(value)


def _rope_theta(config: dict, where: str) -> float:
    """The RoPE base: rope_theta (transformers 4) and rope_parameters' (transformers 5), each checked where
    given; two that disagree would load as two models, one in each version. Neither: Llama's 10000."""
    params = config.get("rope_parameters")
    given = {key: value for key, value in (("rope_theta", config.get("rope_theta")),
                                           ("rope_parameters.rope_theta",
                                            params.get("rope_theta") if isinstance(params, dict) else None))
             if value is not None}
    thetas = {key: _positive(value, key, where) for key, value in given.items()}
    if len(set(thetas.values())) > 1:
        raise UserError(f"{where}: rope_theta is {thetas['rope_theta']!r} but rope_parameters' rope_theta "
                        f"{thetas['rope_parameters.rope_theta']!r}: transformers 4 reads the first and 5 the second; "
                        f"make them the same")
    return next(iter(thetas.values()), 10000.0)


def _rope_scaling(config: dict) -> str | None:
    """What rotary scaling the config asks for, in words, or None for plain RoPE. Either key
    (rope_scaling, or transformers 5's rope_parameters) and either spelling of the kind ("rope_type",
    or the older "type") counts; so does a factor given without a kind."""
    for key in ("rope_parameters", "rope_scaling"):
        block = config.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            return f"{key} {block!r}"
        kind = block.get("rope_type", block.get("type", "default"))
        extra = sorted(set(block) - {"rope_type", "type", "rope_theta"})
        if kind not in ("default", None) or extra:
            detail = ", ".join(f"{k} {block[k]!r}" for k in sorted(block) if k != "rope_theta")
            return f"{key} ({detail})"
    return None


def args_from_hf_config(config: object, where: str) -> ModelArgs:
    """Our shape from a transformers config.json (Llama, Mistral-style Llama, or Qwen3); anything
    this decoder cannot reproduce is one error line."""
    if not isinstance(config, dict):
        raise UserError(f"{where} is not a model config (a JSON object is expected)")
    kind = config.get("model_type")
    if kind not in ("llama", "qwen3"):
        raise UserError(f"{where}: model_type {kind!r} is not one titanlike builds (llama, qwen3)")
    scaling = _rope_scaling(config)
    if scaling:
        raise UserError(f"{where}: rotary scaling {scaling} is not implemented by titanlike's decoder; trained here "
                        f"the model would differ from the one transformers loads from this folder")
    unsupported = [(config.get("attention_bias"), "attention_bias"), (config.get("mlp_bias"), "mlp_bias"),
                   (config.get("use_sliding_window"), "use_sliding_window"),
                   (config.get("hidden_act", "silu") != "silu", f"hidden_act {config.get('hidden_act')!r}")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"{where}: {what} is not supported by titanlike's decoder")
    heads = _whole(config, "num_attention_heads", where)
    tied = config.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise UserError(f"{where}: tie_word_embeddings is {tied!r}, not true or false")
    eps = config.get("rms_norm_eps")
    args = ModelArgs(dim=_whole(config, "hidden_size", where), n_layers=_whole(config, "num_hidden_layers", where),
                     n_heads=heads, n_kv_heads=_whole(config, "num_key_value_heads", where, default=heads),
                     ffn_dim=_whole(config, "intermediate_size", where), vocab_size=_whole(config, "vocab_size", where),
                     rope_theta=_rope_theta(config, where),
                     norm_eps=1e-6 if eps is None else _positive(eps, "rms_norm_eps", where), tie_embeddings=tied,
                     max_seq_len=_whole(config, "max_position_embeddings", where, default=131072),
                     qk_norm=kind == "qwen3", attn_mask=str(config.get(ATTN_MASK_KEY, "causal")))
    problems = args.problems()
    if problems:
        raise UserError(f"{where}: {problems[0]}")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != args.head_dim:
        raise UserError(f"{where}: head_dim {head_dim} is not hidden_size / num_attention_heads = {args.head_dim}, "
                        f"which titanlike's attention assumes")
    return args


# config.json key ↔ our field and the [model] option that sets it, for disagreement messages.
COMPARED = [("hidden_size", "dim", "model.dim"), ("num_hidden_layers", "n_layers", "model.n_layers"),
            ("num_attention_heads", "n_heads", "model.n_heads"),
            ("num_key_value_heads", "n_kv_heads", "model.n_kv_heads"),
            ("head_dim", "head_dim", "model.dim / model.n_heads"), ("intermediate_size", "ffn_dim", "model.ffn_dim"),
            ("vocab_size", "vocab_size", "model.vocab_size"), ("rope_theta", "rope_theta", "model.rope_theta"),
            ("rms_norm_eps", "norm_eps", "model.norm_eps"), ("qk_norm", "qk_norm", "model.qk_norm"),
            ("tie_word_embeddings", "tie_embeddings", "model.tie_embeddings")]
