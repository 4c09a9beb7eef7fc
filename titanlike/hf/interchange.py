"""Hugging Face folders: our parameter names ↔ theirs, safetensors shards, and the tokenizer files
that make the folder load in AutoTokenizer (config.json's names are model/hf_names.py's).

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
from titanlike.hf.config import check_hf_config
from titanlike.model.hf_names import hf_config
from titanlike.model.shape import ModelArgs

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
# Every file write_hf_folder and write_tokenizer_files may write: what an earlier export left.
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json")
_WEIGHT_SHARD = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")
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


def written_by_export(name: str) -> bool:
    """Whether a file of this name in a Hugging Face folder is one an export writes."""
    return name in EXPORT_FILES or _WEIGHT_SHARD.fullmatch(name) is not None


def write_hf_folder(state: dict[str, torch.Tensor], a: ModelArgs, folder: str, dtype: torch.dtype,
                    max_shard_bytes: int = 5 * 1024**3, bos_id: int | None = None,
                    eos_id: int | None = None) -> list[str]:
    """Write model*.safetensors (+ index when sharded) and config.json; returns the files written."""
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
        _save_shard(shards[0], os.path.join(folder, files[0]))
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _save_shard(shard, os.path.join(folder, fname))
            weight_map.update({k: fname for k in shard})
            files.append(fname)
        total = sum(t.numel() * t.element_size() for t in hf.values())
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        files.append("model.safetensors.index.json")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(a, str(dtype).removeprefix("torch."), bos_id, eos_id), f, indent=1)
    return files + ["config.json"]


def _save_shard(tensors: dict[str, torch.Tensor], path: str) -> None:
    """safetensors' save_file, whose failures to write (a full disk, a read-only folder) come as its own error
    with the OS's error number in the text: raised as the OSError they are, so the caller can say which."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as e:
        number = re.search(r"os error (\d+)", str(e))
        if number is None:
            raise
        code = int(number.group(1))
        raise OSError(code, os.strerror(code), path) from None


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

    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    files = [f for f in names if f.endswith(".safetensors")]
    if not files:
        pickled = [f for f in names if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        if pickled:
            # Those are pickles (torch.save): loading one can run code. Converting is the user's call.
            raise UserError(
                f"{folder} holds {pickled[0]} but no .safetensors: titanlike reads safetensors only (a pickled "
                f"checkpoint can run code when loaded); convert it where you trust it, e.g. "
                f"AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder) in transformers")
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
        # config.json (checked above to agree with this run) says untied: the folder itself is incomplete.
        raise UserError(f"{folder} has no lm_head.weight, yet its config.json says tie_word_embeddings false: the "
                        f"folder is incomplete (an untied model stores its output layer; a tied one's config.json "
                        f"says true)")
    # Otherwise a missing tensor loads silently (that part keeps its random init) and an extra or
    # misshapen one fails deep in torch with a message per tensor: name the first difference.
    from titanlike.model.decoder import Transformer

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
