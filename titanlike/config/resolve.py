"""Which model a config means: a preset (or a Hugging Face config.json), the `[model]` overrides, and
the vocabulary of the tokenizer that made the data.

One function answers it for the preflight, the trainer and the tests alike, so that the shape checked
before torchrun is the shape built after it; the resolved run (run.py) holds its answer. Plain Python:
it reads JSON, never tensors.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from titanlike import fs
from titanlike.config.dataset import BYTE_EOS_ID, DatasetInfo, schedule_dataset_info
from titanlike.config.loader import ConfigError
from titanlike.config.schema import JobConfig
from titanlike.config.sources import DataSchedule, schedule_of
from titanlike.errors import UserError
from titanlike.model.hf_names import CONFIG, args_from_hf_config
from titanlike.model.shape import PRESETS, ModelArgs, llama_ffn_dim, model_args, round_vocab

# The [model] fields a user sets to change a preset's architecture (vocab_size, tie_embeddings and
# max_seq_len adapt a preset to data and use; they do not make it another model).
ARCHITECTURE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps", "qk_norm")


@dataclass(frozen=True)
class ResolvedModel:
    args: ModelArgs
    name: str
    """How logs name the model: the preset, `custom (debug with dim 128, n_layers 2)`, or `hf (FOLDER)`."""
    notes: tuple[str, ...] = ()
    """Lines to log once: values this resolution derived for the user."""
    dataset: DatasetInfo | None = None
    """The data's dataset.json, when it has one."""
    document_end: int | None = None
    """The end-of-document id that model.attn_mask = block_causal splits windows at (None: causal)."""


def _changed(cfg: JobConfig) -> dict:
    m, preset = cfg.model, PRESETS.get(cfg.model.flavor)
    out = {}
    for key in ARCHITECTURE:
        value = getattr(m, key)
        if value is not None and (isinstance(value, bool) or value != 0) and (preset is None or
                                                                             value != getattr(preset, key)):
            out[key] = value
    return out


def read_hf_config(folder: str) -> ModelArgs:
    """The shape recorded in a Hugging Face folder's config.json (for --model.flavor hf)."""
    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise UserError(f"{folder} has no {CONFIG}: the shape of its model is unknown (a Hugging Face folder holds "
                        f"one next to its safetensors)")
    return args_from_hf_config(fs.read_json(path, "the model config"), path)


def resolve_model(cfg: JobConfig, schedule: DataSchedule | None = None) -> ResolvedModel:
    """The shape this run builds, its name and what was derived. Raises ConfigError (one line) for a
    shape that cannot be built. `schedule`: [data] as already parsed (else parsed here)."""
    m = cfg.model
    overrides = m.shape_overrides()
    notes: list[str] = []
    schedule = schedule_of(cfg.data) if schedule is None else schedule
    info = schedule_dataset_info(schedule)  # data.path's, or the one a mixture's sources share
    if m.flavor == "hf":
        folder = cfg.checkpoint.initial_load_path
        base = read_hf_config(folder)
        given = {k: v for k, v in overrides.items() if v is not None and (isinstance(v, bool) or v != 0)
                 and k != "max_seq_len" and v != getattr(base, k)}
        if given:
            key, value = next(iter(given.items()))
            raise ConfigError(f"model.{key} = {value!r}: with --model.flavor hf the shape is {folder}/config.json's "
                              f"({key} {getattr(base, key)!r}); leave model.{key} unset")
        name = f"hf ({folder})"
    else:
        base = PRESETS[m.flavor]
        changed = _changed(cfg)
        if "dim" in changed and "ffn_dim" not in changed:
            overrides["ffn_dim"] = llama_ffn_dim(m.dim)
            changed["ffn_dim"] = overrides["ffn_dim"]
            notes.append(f"model.ffn_dim = {overrides['ffn_dim']}: derived from model.dim = {m.dim} as Llama does "
                         f"(8/3 × dim, rounded up to a multiple of 256); set --model.ffn_dim to choose another")
        name = m.flavor
        if changed:
            name = f"custom ({m.flavor} with " + ", ".join(f"{k} {v}" for k, v in changed.items()) + ")"
    if info is not None:
        if m.vocab_size and m.vocab_size < info.vocab_size:
            raise ConfigError(f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's {info.vocab_size} "
                              f"ids ({info.path}); leave it unset (→ {round_vocab(info.vocab_size)}) or set "
                              f"{info.vocab_size} or more")
        if not m.vocab_size and m.flavor != "hf":
            overrides["vocab_size"] = round_vocab(info.vocab_size)
        elif m.flavor == "hf" and base.vocab_size < info.vocab_size:
            raise ConfigError(f"{cfg.checkpoint.initial_load_path}/config.json has vocab_size {base.vocab_size}, "
                              f"fewer than the {info.vocab_size} ids of the data's tokenizer ({info.path})")
    args = (model_args(base, **overrides) if m.flavor != "hf" else
            model_args(base, max_seq_len=m.max_seq_len, attn_mask=m.attn_mask))
    problems = args.problems()
    if problems:
        raise ConfigError(f"model shape ({name} with the model.* overrides): {problems[0]}")
    return ResolvedModel(args, name, tuple(notes), info, document_end(cfg, info, schedule.builtin_corpus))


def document_end(cfg: JobConfig, info: DatasetInfo | None, builtin_corpus: bool) -> int | None:
    """The id that ends a document in the run's data, for model.attn_mask = block_causal (None for causal);
    data that records none is one ConfigError line."""
    if cfg.model.attn_mask == "causal":
        return None
    if builtin_corpus:
        return BYTE_EOS_ID  # the embedded corpus: byte tokens, each file ended by the byte tokenizer's eos
    if info is None or info.eos_id is None:
        where = f"{info.path} records no eos_id" if info else f"{cfg.data.path} has no dataset.json beside it"
        raise ConfigError(f"model.attn_mask = block_causal splits windows at the end-of-document id, and {where}: "
                          f"re-make the data with titanlike-prepare, or use --model.attn_mask causal")
    return info.eos_id


def with_resolved_shape(cfg: JobConfig, model: ResolvedModel) -> JobConfig:
    """The config as the run uses it: [model] with the shape it resolved to (the preset's or the data's
    values where the config leaves them unset), for --job.print_config and config.toml."""
    shape = {f.name: getattr(model.args, f.name) for f in dataclasses.fields(model.args)}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **shape))
