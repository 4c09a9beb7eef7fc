"""A model's shape: ModelArgs, the presets, parameter and FLOP counts. Plain Python (no torch), so
that the preflight checks a shape before any worker imports torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 131072
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (as Qwen3, OLMo 2)
    # causal, or block_causal: a token attends only to its own document within the window (not a
    # shape: the same weights run either way, and at inference one prompt is one document).
    attn_mask: str = "causal"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def problems(self) -> list[str]:
        """What makes this shape unbuildable, one phrase each (empty when it is fine)."""
        out = []
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                out.append(f"{name} = {getattr(self, name)} must be >= 1")
        if out:
            return out
        if self.dim % self.n_heads:
            out.append(f"dim = {self.dim} is not divisible by n_heads = {self.n_heads}")
        elif self.head_dim % 2:
            out.append(f"head_dim = dim / n_heads = {self.head_dim} must be even (RoPE rotates pairs)")
        if self.n_heads % self.n_kv_heads:
            out.append(f"n_heads = {self.n_heads} is not divisible by n_kv_heads = {self.n_kv_heads}")
        if not 0 < self.rope_theta < float("inf"):
            out.append(f"rope_theta = {self.rope_theta} must be a finite number > 0")
        if not 0 < self.norm_eps < 1:
            out.append(f"norm_eps = {self.norm_eps} must be in (0, 1)")
        if self.attn_mask not in ATTN_MASKS:
            out.append(f"attn_mask = {self.attn_mask!r} must be one of {', '.join(ATTN_MASKS)}")
        for name, limit in SHAPE_LIMITS.items():
            if getattr(self, name) > limit:
                out.append(f"{name} = {getattr(self, name)} is more than any model titanlike builds: at most {limit:,}")
        if not out and count_params(self)[0] > MAX_PARAMS:
            out.append(f"{count_params(self)[0]:,} parameters is more than any model titanlike builds: at most "
                       f"{MAX_PARAMS:,} (2^45)")
        return out

    @property
    def qkv_widths(self) -> list[int]:
        """Rows of the stacked wqkv projection that are q, k and v, in that order (the model splits
        its output so; Hugging Face export and import split and stack the weight so)."""
        return [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim]


ATTN_MASKS = ("causal", "block_causal")
# Far past every published Llama-style model (405B: 126 layers, dim 16,384, ffn 53,248, 128 heads), and
# short of what makes a shape's arithmetic itself the problem: n_layers = 10**18 had titanlike-plan grow
# its memory by a gigabyte a second and the trainer hang after the preflight.
SHAPE_LIMITS = {"n_layers": 4096, "dim": 131072, "ffn_dim": 524288, "n_heads": 4096, "n_kv_heads": 4096,
                "max_seq_len": 2**24}
MAX_PARAMS = 2**45  # 35 trillion

# A block's Linears in the order its forward runs them (model/decoder.py): attention's stacked q/k/v
# and output projections, then the feed-forward's gate, up and down. Selective activation
# checkpointing names the ones whose outputs it keeps by these names and finds them by this order.
BLOCK_MATMULS = ("wqkv", "wo", "w1", "w3", "w2")


def block_matrix_pieces(args: ModelArgs) -> list[tuple[int, int]]:
    """(rows, cols) of one block's matrices as Muon orthogonalises them (titanlike/optim/muon.py): wqkv as its
    q, k and v rows, then wo, w1, w3 and w2 (nn.Linear's weights: out_features × in_features)."""
    attn = args.n_heads * args.head_dim
    return [(width, args.dim) for width in args.qkv_widths] + [
        (args.dim, attn), (args.ffn_dim, args.dim), (args.ffn_dim, args.dim), (args.dim, args.ffn_dim)]


PRESETS: dict[str, ModelArgs] = {
    # A few million parameters: trains visibly in a minute on a laptop CPU. Its vocabulary
    # covers the built-in byte tokenizer (258 ids) rounded up to a multiple of 64.
    "debug": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=320, rope_theta=10000.0),
    # GPT-2 small's scale in today's architecture (the RTX 5090 guide's model): 12 layers, dim 768,
    # GQA 12:3, QK-norm, SwiGLU at 8/3 × dim, 32768-token vocabulary; 124.8M parameters untied.
    "124m": ModelArgs(dim=768, n_layers=12, n_heads=12, n_kv_heads=3, ffn_dim=2048, vocab_size=32768,
                      rope_theta=10000.0, qk_norm=True),
    "1b": ModelArgs(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=8192, vocab_size=128256),
    "3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, vocab_size=128256),
    "8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256),
    "70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256),
}

# The shape fields a config may override (0 / None keeps the preset's value).
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta", "norm_eps",
                "qk_norm", "max_seq_len", "tie_embeddings", "attn_mask")

# Vocabulary rows are padded to a multiple of this: matmul tiles like it, and a tokenizer's odd
# size (50257, 32001) would otherwise give the output layer a ragged last tile.
VOCAB_MULTIPLE = 64
# A derived feed-forward width is rounded up to a multiple of this, as Llama's `multiple_of`.
FFN_MULTIPLE = 256


def round_vocab(n: int) -> int:
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def llama_ffn_dim(dim: int) -> int:
    """The SwiGLU width Llama derives from the model width: 8/3 × dim, rounded up to a multiple of
    256 (the debug and 124m presets follow it)."""
    return -(-(8 * dim // 3) // FFN_MULTIPLE) * FFN_MULTIPLE


def model_args(flavor: str | ModelArgs, vocab_size: int = 0, tie_embeddings: bool | None = None,
               **overrides) -> ModelArgs:
    """A preset (or a given shape) with every override that is set (not 0, not None) applied."""
    args = PRESETS[flavor] if isinstance(flavor, str) else flavor
    overrides.update(vocab_size=vocab_size, tie_embeddings=tie_embeddings)
    unknown = set(overrides) - set(SHAPE_FIELDS)
    if unknown:
        raise TypeError(f"not a model shape field: {', '.join(sorted(unknown))}")
    # Booleans are unset only as None (False is a choice); numbers are unset as None or 0.
    return replace(args, **{k: v for k, v in overrides.items()
                            if v is not None and (isinstance(v, bool) or v != 0)})


def count_params(args: ModelArgs) -> tuple[int, int]:
    """(all parameters, embedding parameters), computed from the shape alone."""
    d, hd = args.dim, args.head_dim
    attn = d * args.n_heads * hd * 2 + d * args.n_kv_heads * hd * 2
    ffn = 3 * d * args.ffn_dim
    block = attn + ffn + 2 * d + (2 * hd if args.qk_norm else 0)
    embed = args.vocab_size * d
    output = 0 if args.tie_embeddings else args.vocab_size * d
    return args.n_layers * block + embed + output + d, embed


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token: 6 × matmul parameters + 12 × layers × heads × head_dim × seq_len.

    The embedding lookup does no matmul, so its parameters are left out; a tied output layer
    still does its matmul, so it is counted back in.
    """
    total, embed = count_params(args)
    matmul_params = total - embed + (args.vocab_size * args.dim if args.tie_embeddings else 0)
    return 6 * matmul_params + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def shape_difference(saved: dict, ours: ModelArgs) -> str | None:
    """The first field where a saved model_args.json differs from this run's shape, as
    "field: saved there, ours here"; None when they agree. Fields a checkpoint predates are
    compared with their defaults (a checkpoint from before qk_norm existed had none)."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelArgs) if f.default is not dataclasses.MISSING}
    for f in dataclasses.fields(ModelArgs):
        theirs = saved.get(f.name, defaults.get(f.name))
        mine = getattr(ours, f.name)
        if f.name in ("max_seq_len", "attn_mask"):
            continue  # a limit and a mask, not weights: either way the same tensors train
        if theirs != mine and not (isinstance(mine, float) and isinstance(theirs, (int, float))
                                   and float(theirs) == mine):
            return f"{f.name} is {theirs!r} there, {mine!r} here"
    return None


def args_from_json(record: object, where: str) -> ModelArgs:
    """A ModelArgs from a model_args.json record; ValueError (naming `where`) for anything else."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} holds no model shape (a JSON object is expected)")
    known = {f.name: f for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(record) - set(known))
    if unknown:
        raise ValueError(f"{where} has a field that is no model shape field: {unknown[0]}")
    values = {}
    for name, value in record.items():
        want = known[name].type
        ok = (isinstance(value, bool) if want == "bool" else isinstance(value, str) if want == "str" else
              isinstance(value, int) and not isinstance(value, bool) if want == "int" else
              isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"{where}: {name} is {value!r}, not a{'n' if want == 'int' else ''} {want}")
        values[name] = value
    try:
        args = ModelArgs(**values)
    except TypeError as e:
        raise ValueError(f"{where} lacks a field of the model shape ({e})") from None
    problems = args.problems()
    if problems:
        raise ValueError(f"{where}: {problems[0]}")
    return args


def describe(args: ModelArgs) -> str:
    """One phrase for logs: 12 layers, dim 768, 12 heads (3 kv) × 64, ffn 2048, vocab 32768, qk-norm."""
    extra = ", qk-norm" if args.qk_norm else ""
    extra += ", tied embeddings" if args.tie_embeddings else ""
    extra += ", attention within each document" if args.attn_mask == "block_causal" else ""
    return (f"{args.n_layers} layers, dim {args.dim}, {args.n_heads} heads ({args.n_kv_heads} kv) × {args.head_dim}, "
            f"ffn {args.ffn_dim}, vocab {args.vocab_size}{extra}")
