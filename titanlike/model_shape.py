"""The model shape a run trains: a preset (or a Hugging Face config.json), the `[model]` overrides,
and the vocabulary of the tokenizer that made the data.

One function answers "which ModelArgs does this config mean", for the preflight, the trainer and
the tests alike, so that the shape checked before torchrun is the shape built after it.
"""

from __future__ import annotations

import dataclasses

from titanlike.config import ConfigError, JobConfig, Model
from titanlike.model import PRESETS, ModelArgs, model_args

# Vocabulary rows are padded to a multiple of this: matmul tiles like it, and a tokenizer's odd
# size (50257, 32001) would otherwise give the output layer a ragged last tile.
VOCAB_MULTIPLE = 64


def round_vocab(n: int) -> int:
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def shape_overrides(m: Model) -> dict:
    """The `[model]` fields that override a preset's shape (0 / None = keep the preset's)."""
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps", "qk_norm",
            "max_seq_len", "vocab_size", "tie_embeddings")
    return {k: getattr(m, k) for k in keys}


def resolve_model_args(cfg: JobConfig) -> ModelArgs:
    """The shape this run builds. Raises ConfigError (one line) for a shape that cannot be built."""
    from titanlike.tokenizer import read_dataset_info

    m = cfg.model
    if m.flavor == "hf":
        from titanlike.interchange import read_hf_config

        base = read_hf_config(cfg.checkpoint.initial_load_path)
    else:
        base = PRESETS[m.flavor]
    overrides = shape_overrides(m)
    info = read_dataset_info(cfg.data.path) if cfg.data.path else None
    if info is not None:
        tokens = int(info["vocab_size"])
        if m.vocab_size and m.vocab_size < tokens:
            raise ConfigError(f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's {tokens} ids "
                              f"({info['_path']}); leave it unset (→ {round_vocab(tokens)}) or set {tokens} or more")
        if not m.vocab_size and m.flavor != "hf":
            overrides["vocab_size"] = round_vocab(tokens)
        elif m.flavor == "hf" and not m.vocab_size and base.vocab_size < tokens:
            raise ConfigError(f"{cfg.checkpoint.initial_load_path}/config.json has vocab_size {base.vocab_size}, "
                              f"fewer than the {tokens} ids of the data's tokenizer ({info['_path']})")
    args = model_args(base, **overrides)
    problems = args.problems()
    if problems:
        raise ConfigError(f"model shape ({m.flavor} with the model.* overrides): {problems[0]}")
    if cfg.data.seq_len > args.max_seq_len:
        raise ConfigError(f"data.seq_len = {cfg.data.seq_len} exceeds the model's max_seq_len = {args.max_seq_len}")
    return args


def shape_difference(saved: dict, ours: ModelArgs) -> str | None:
    """The first field where a saved model_args.json differs from this run's shape, as
    "field: saved there, ours here"; None when they agree. Fields a checkpoint predates are
    compared with their defaults (a checkpoint from before qk_norm existed had none)."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelArgs) if f.default is not dataclasses.MISSING}
    for f in dataclasses.fields(ModelArgs):
        theirs = saved.get(f.name, defaults.get(f.name))
        mine = getattr(ours, f.name)
        if f.name == "max_seq_len":
            continue  # a limit, not a weight: a longer or shorter context trains the same tensors
        if theirs != mine and not (isinstance(mine, float) and theirs is not None and float(theirs) == mine):
            return f"{f.name} is {theirs!r} there, {mine!r} here"
    return None


def describe(args: ModelArgs) -> str:
    """One phrase for logs: 12 layers, dim 768, 12 heads (3 kv) × 64, ffn 2048, vocab 32768, qk-norm."""
    extra = ", qk-norm" if args.qk_norm else ""
    extra += ", tied embeddings" if args.tie_embeddings else ""
    return (f"{args.n_layers} layers, dim {args.dim}, {args.n_heads} heads ({args.n_kv_heads} kv) × {args.head_dim}, "
            f"ffn {args.ffn_dim}, vocab {args.vocab_size}{extra}")
