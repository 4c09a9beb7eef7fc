"""Hugging Face folders: our parameter names ↔ theirs, config.json both ways, safetensors shards,
and the tokenizer files that make the folder load in AutoTokenizer.

A model without QK-norm is a `LlamaForCausalLM`; with QK-norm (an RMSNorm over each head's q and k
before RoPE) a `Qwen3ForCausalLM`, which is the same decoder plus exactly those two norms. Our rotary
embedding pairs dimension i with i + head_dim/2 ("rotate half"), as both do, so q and k
projections map across unchanged: no permutation either way.
"""

from __future__ import annotations

import json
import os
import re

import torch

from titanlike.errors import UserError
from titanlike.model import ModelArgs

_LAYER_NAMES = {
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attention.q_norm": "self_attn.q_norm",  # QK-norm (Qwen3 layout)
    "attention.k_norm": "self_attn.k_norm",
}
# Our stacked q/k/v projection is three tensors there: its rows split in this order.
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.weight$")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight$")


def to_hf_name(name: str) -> str:
    """The Hugging Face name of one of our parameters (for wqkv, its three names in braces)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.match(name)
    if m and m.group(2) == "attention.wqkv":
        return f"model.layers.{m.group(1)}.self_attn.{{q,k,v}}_proj.weight"
    if not m or m.group(2) not in _LAYER_NAMES:
        raise KeyError(name)
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def to_hf_state(state: dict[str, torch.Tensor], a: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full tensors under Hugging Face names: wqkv splits into q, k and v projections."""
    out = {}
    for name, tensor in state.items():
        m = _LAYER.match(name)
        if m and m.group(2) == "attention.wqkv":
            for hf, part in zip(_QKV, tensor.split(a.qkv_widths, dim=0)):
                out[f"model.layers.{m.group(1)}.{hf}.weight"] = part
        else:
            out[to_hf_name(name)] = tensor
    return out


def from_hf_state(hf_state: dict[str, torch.Tensor], a: ModelArgs, where: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors under our names: each layer's q, k and v projections stack into wqkv.
    A name that is not part of a Llama model raises KeyError(name)."""
    inverse_top = {v: k for k, v in _TOP_NAMES.items()}
    inverse = {v: k for k, v in _LAYER_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in hf_state.items():
        m = _HF_LAYER.match(name)
        if name in inverse_top:
            out[inverse_top[name]] = tensor
        elif m and m.group(2) in inverse:
            out[f"layers.{m.group(1)}.{inverse[m.group(2)]}.weight"] = tensor
        elif m and m.group(2) in _QKV:
            qkv.setdefault(m.group(1), {})[m.group(2)] = tensor
        else:
            raise KeyError(name)
    for layer, parts in qkv.items():
        missing = [p for p in _QKV if p not in parts]
        if missing:
            raise UserError(f"{where} has no model.layers.{layer}.{missing[0]}.weight: it holds a different model")
        if [parts[p].shape[0] for p in _QKV] != a.qkv_widths or len({parts[p].shape[1:] for p in _QKV}) != 1:
            shapes = ", ".join(f"{p.split('.')[-1]} {tuple(parts[p].shape)}" for p in _QKV)
            raise UserError(f"{where} holds a different model shape: layer {layer} has {shapes} (check "
                            f"--model.flavor / --model.vocab_size)")
        out[f"layers.{layer}.attention.wqkv.weight"] = torch.cat([parts[p] for p in _QKV], dim=0)
    return out


def hf_config(a: ModelArgs, dtype: torch.dtype, bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """config.json for transformers: Qwen3 with QK-norm, else Llama. Both the older keys (rope_theta,
    torch_dtype) and transformers 5's (rope_parameters, dtype) are written, so either reads it."""
    dtype_name = str(dtype).removeprefix("torch.")
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
    return config


def _rope_theta(config: dict) -> float | None:
    params = config.get("rope_parameters") or {}
    return params.get("rope_theta", config.get("rope_theta"))


def args_from_hf_config(config: dict, where: str) -> ModelArgs:
    """Our shape from a transformers config.json (Llama, Mistral-style Llama, or Qwen3); anything
    this decoder cannot reproduce (biases, rope scaling, sliding windows) is one error line."""
    kind = config.get("model_type")
    if kind not in ("llama", "qwen3"):
        raise UserError(f"{where}: model_type {kind!r} is not one titanlike builds (llama, qwen3)")
    scaling = config.get("rope_scaling") or {}
    rope_type = (config.get("rope_parameters") or {}).get("rope_type", scaling.get("rope_type", "default"))
    unsupported = [(config.get("attention_bias"), "attention_bias"), (config.get("mlp_bias"), "mlp_bias"),
                   (rope_type not in ("default", None), f"rope type {rope_type!r}"),
                   (config.get("use_sliding_window"), "use_sliding_window"),
                   (config.get("hidden_act", "silu") != "silu", f"hidden_act {config.get('hidden_act')!r}")]
    for bad, what in unsupported:
        if bad:
            raise UserError(f"{where}: {what} is not supported by titanlike's decoder")
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        args = ModelArgs(dim=dim, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
                         n_kv_heads=int(config.get("num_key_value_heads") or heads),
                         ffn_dim=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                         rope_theta=float(_rope_theta(config) or 10000.0),
                         norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                         tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                         max_seq_len=int(config.get("max_position_embeddings") or 131072), qk_norm=kind == "qwen3")
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where} lacks a usable {e.args[0] if isinstance(e, KeyError) else 'value'} "
                        f"({type(e).__name__}: {e})") from None
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) != args.head_dim:
        raise UserError(f"{where}: head_dim {head_dim} is not hidden_size / num_attention_heads = {args.head_dim}, "
                        f"which titanlike's attention assumes")
    return args


def read_hf_config(folder: str) -> ModelArgs:
    """The shape recorded in a Hugging Face folder's config.json (for --model.flavor hf)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror}); --model.flavor hf takes the shape from a Hugging Face "
                        f"folder's config.json") from None
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    return args_from_hf_config(config, path)


# config.json key ↔ our field and the [model] option that sets it, for disagreement messages.
_COMPARED = [("hidden_size", "dim", "model.dim"), ("num_hidden_layers", "n_layers", "model.n_layers"),
             ("num_attention_heads", "n_heads", "model.n_heads"),
             ("num_key_value_heads", "n_kv_heads", "model.n_kv_heads"),
             ("head_dim", "head_dim", "model.dim / model.n_heads"), ("intermediate_size", "ffn_dim", "model.ffn_dim"),
             ("vocab_size", "vocab_size", "model.vocab_size"), ("rope_theta", "rope_theta", "model.rope_theta"),
             ("rms_norm_eps", "norm_eps", "model.norm_eps"), ("qk_norm", "qk_norm", "model.qk_norm"),
             ("tie_word_embeddings", "tie_embeddings", "model.tie_embeddings")]


def check_hf_config(folder: str, a: ModelArgs) -> None:
    """Refuse a folder whose config.json describes another model than this run's, naming the first
    field that differs and both values (same tensor shapes can hide another head layout or rope_theta)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{folder} has no config.json: the shape of its model is unknown (a Hugging Face folder "
                        f"holds one next to its safetensors)")
    theirs = read_hf_config(folder)
    for key, field, option in _COMPARED:
        there, here = getattr(theirs, field), getattr(a, field)
        if there != here:
            raise UserError(f"{path}: {key} is {there!r} there, {here!r} in this run ({option}); "
                            f"use the same value, or --model.flavor hf to take the whole shape from it")


def write_hf_folder(state: dict[str, torch.Tensor], a: ModelArgs, folder: str, dtype: torch.dtype,
                    max_shard_bytes: int = 5 * 1024**3, bos_id: int | None = None,
                    eos_id: int | None = None) -> list[str]:
    """Write model*.safetensors (+ index when sharded) and config.json; returns the files written."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    # Hugging Face re-ties a tied output layer from the embedding.
    ours = {k: v.detach().to("cpu", dtype) for k, v in state.items() if not (a.tie_embeddings and k == "output.weight")}
    hf = {k: v.contiguous() for k, v in to_hf_state(ours, a).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    files = []
    if len(shards) == 1:
        files.append("model.safetensors")
        save_file(shards[0], os.path.join(folder, files[0]), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(folder, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
            files.append(fname)
        total = sum(t.numel() * t.element_size() for t in hf.values())
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(a, dtype, bos_id, eos_id), f, indent=1)
    return files + ["config.json"]


def write_tokenizer_files(folder: str, tokenizer_json: str, bos: tuple[str | None, int | None],
                          eos: tuple[str | None, int | None], max_len: int) -> list[str]:
    """tokenizer.json (as given), tokenizer_config.json and generation_config.json, so that
    AutoTokenizer loads the folder and generate() knows where a document starts and ends."""
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos[0], "eos_token": eos[0],
              "model_max_length": max_len, "clean_up_tokenization_spaces": False}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    generation = {"bos_token_id": bos[1], "eos_token_id": eos[1], "pad_token_id": eos[1]}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=1)
    return ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def set_file_modes(folder: str, files: list[str]) -> None:
    """Every written file gets the mode a new file gets here (0644 under the usual umask): the
    safetensors writer alone would leave its files 0600, unlike config.json."""
    mask = os.umask(0)
    os.umask(mask)
    for name in files:
        os.chmod(os.path.join(folder, name), 0o666 & ~mask)


def read_hf_folder(folder: str, a: ModelArgs) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 tensors under our names, checked against the model's shape and config.json."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) if os.path.isdir(folder) else []
    if not files:
        raise UserError(f"{folder} is neither a checkpoint step folder (no .metadata) nor a safetensors folder")
    check_hf_config(folder, a)
    hf: dict[str, torch.Tensor] = {}
    file_of: dict[str, str] = {}
    for fname in files:
        try:
            tensors = load_file(os.path.join(folder, fname))
        except Exception as e:  # safetensors' SafetensorError (header too large, truncated file, ...)
            cause = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise UserError(f"{folder}/{fname} is not a readable safetensors file ({cause})") from None
        for name, tensor in tensors.items():
            hf[name], file_of[name] = tensor.float(), fname
    try:
        out = from_hf_state(hf, a, folder)
    except KeyError as e:
        name = e.args[0]
        raise UserError(f"{folder}/{file_of[name]}: parameter {name} is not part of a Llama or Qwen3 model") from None
    if a.tie_embeddings:
        head = out.pop("output.weight", None)  # some tied exports store it anyway, equal to the embedding
        if head is not None and not torch.equal(head, out.get("tok_embeddings.weight", head)):
            raise UserError(f"{folder} has an lm_head.weight of its own (untied embeddings); "
                            f"run with --model.tie_embeddings false")
    elif "output.weight" not in out and "tok_embeddings.weight" in out:
        raise UserError(f"{folder} has tied embeddings (no lm_head.weight); run with --model.tie_embeddings")
    # Otherwise a missing tensor loads silently (that part keeps its random init) and an extra or
    # misshapen one fails deep in torch with a message per tensor: name the first difference.
    from titanlike.model import Transformer

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(a).state_dict().items()
                    if not (a.tie_embeddings and k == "output.weight")}
    here = f"this run's model ({a.n_layers} layers, dim {a.dim}, vocab {a.vocab_size})"
    for name, shape in expected.items():
        if name not in out:
            raise UserError(f"{folder} has no {to_hf_name(name)}, which {here} needs: it holds a different model")
        if tuple(out[name].shape) != shape:
            raise UserError(f"{folder} holds a different model shape: {to_hf_name(name)} is {tuple(out[name].shape)} "
                            f"there, {shape} here (check --model.flavor / --model.vocab_size)")
    for name in out:
        if name not in expected:
            raise UserError(f"{folder} has {to_hf_name(name)}, which {here} does not: it holds a different model")
    return out
