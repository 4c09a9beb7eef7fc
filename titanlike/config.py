"""The job configuration: a tree of dataclasses, loaded from TOML and overridden on the command line.

Precedence is dataclass default < TOML file < `--section.key value` on the command line.
Every field carries a docstring (the string literal under it); `field_docs()` reads them back,
so `--help`, error messages and docs/configuration.md all come from one place.

Everything the user can get wrong is checked here, before a process group or a GPU is touched,
and reported as one `ConfigError` line that names the key, the value and what would be valid.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


from titanlike.errors import UserError


class ConfigError(UserError):
    """A mistake in the job configuration; its message is one line meant for the user."""

    same_on_all_ranks = True


@dataclass
class Job:
    config_file: str = ""
    """TOML file to read before the command-line overrides ("" = defaults only)."""
    dump_folder: str = "./outputs"
    """Run folder: resolved config, metrics.jsonl, TensorBoard events, checkpoints."""
    seed: int = 0
    """Seed for weight init, data order and dropout-free RNG state; same seed, same run."""
    print_config: bool = False
    """Print the resolved config as TOML and exit without training."""


@dataclass
class Model:
    flavor: str = "debug"
    """Model preset: debug, 124m, 1b, 3b, 8b, 70b (titanlike/model.py), or hf: the whole shape from
    checkpoint.initial_load_path's config.json (a Hugging Face Llama or Qwen3 folder). The fields below
    override the preset's shape; 0 or unset keeps the preset's value."""
    vocab_size: int = 0
    """Vocabulary size; 0 = the tokenizer's (dataset.json next to the shards) rounded up to a multiple of
    64, else the preset's. Smaller than the tokenizer's is an error."""
    tie_embeddings: bool | None = None
    """Share the input embedding with the output layer; unset = the preset's choice."""
    dim: int = 0
    """Model width (hidden size); a multiple of n_heads with an even head_dim = dim / n_heads."""
    n_layers: int = 0
    """Transformer blocks."""
    n_heads: int = 0
    """Query heads per attention layer."""
    n_kv_heads: int = 0
    """Key/value heads (grouped-query attention); n_heads must be a multiple of it."""
    ffn_dim: int = 0
    """Hidden width of each SwiGLU feed-forward layer."""
    rope_theta: float = 0.0
    """Base of the rotary position embedding's frequencies."""
    norm_eps: float = 0.0
    """Epsilon of every RMSNorm."""
    qk_norm: bool | None = None
    """RMSNorm over each head's queries and keys before RoPE (QK-norm, exported as Qwen3); unset = the preset's."""
    max_seq_len: int = 0
    """Longest sequence the model is meant for (config.json's max_position_embeddings); data.seq_len must not
    exceed it."""


@dataclass
class Data:
    path: str = ""
    """Token shards: a .bin file or a folder of them ("" = the embedded Python-stdlib corpus, built once per
    machine into ~/.cache/titanlike or $TITANLIKE_CACHE)."""
    val_path: str = ""
    """Validation shards ("" = none, except for the embedded corpus, which holds out its own)."""
    seq_len: int = 256
    """Tokens per sample (each sample reads seq_len + 1 tokens: inputs and shifted targets)."""
    num_workers: int = 0
    """Data-loader worker processes per rank (0 = load in the training process)."""


@dataclass
class Training:
    local_batch_size: int = 8
    """Samples per micro-batch on each rank."""
    global_batch_size: int = 0
    """Samples per optimizer step over all ranks; 0 = local × data-parallel degree. A multiple of
    that product; the ratio is the number of gradient-accumulation micro-batches."""
    steps: int = 100
    """Optimizer steps to train in total (a resumed run continues up to this step)."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value (0 = no clipping)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to train: auto = CUDA when available, else CPU."""
    deterministic: bool = False
    """Deterministic kernels (slower); with a fixed seed, reruns give identical losses."""
    gpu_memory_limit_gib: float = 0.0
    """Cap this process's CUDA memory at this many GiB, e.g. 31 to prove a job fits an RTX 5090 while
    running on a larger GPU (0 = no cap)."""
    loss_chunk_tokens: int = 0
    """Compute the output layer and the loss this many tokens at a time, recomputing each chunk's
    logits in backward, so that the whole (tokens × vocab) logits never exist (0 = off: whole
    logits). Same loss and gradients; saves memory with large vocabularies (titanlike/loss.py)."""
    mixed_precision: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype on GPU (params stay fp32, gradients reduce in fp32). CPU always runs fp32."""
    nonfinite: Literal["abort", "skip", "rollback"] = "abort"
    """What a non-finite loss or gradient norm does. abort: stop with one line naming the step. skip: skip
    that step's update (its batch is consumed and the LR schedule moves on; metrics.jsonl counts
    skipped_steps; 3 skipped in a row stop the run). rollback: reload the newest checkpoint and go on with the
    data after the offending batch, not replaying it (needs checkpoint.enable; after 3 rollbacks to the same
    checkpoint the next one stops the run). Values are checked at log steps and before each save
    (docs/troubleshooting.md)."""


@dataclass
class Optimizer:
    lr: float = 8e-4
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.1
    """Decoupled weight decay of AdamW, applied to weight matrices and embeddings, not to norm gains."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas, two numbers: --optimizer.betas 0.9,0.95"""
    eps: float = 1e-8
    """AdamW epsilon."""


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    """Steps of linear warmup from near zero to the peak LR."""
    decay_ratio: float = 0.2
    """Fraction of all steps spent decaying at the end (warmup-stable-decay); 1.0 = decay right after warmup."""
    decay_type: Literal["linear", "cosine"] = "linear"
    """Shape of the decay phase."""
    min_lr_factor: float = 0.0
    """LR at the end of decay, as a fraction of the peak."""


@dataclass
class Parallel:
    dp_shard: int = -1
    """FSDP degree (shards within a replica); -1 = all ranks not used by dp_replicate."""
    dp_replicate: int = 1
    """Replicas of the sharded model (HSDP); ranks = dp_replicate × dp_shard; -1 = ranks / dp_shard."""
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: default = yes except for the root module and the
    output layer, and for none of them when all weights in bf16 take at most 1/16 of a GPU's memory."""
    backend_timeout_s: int = 600
    """Seconds a collective may wait for another rank before the run fails with its name."""


@dataclass
class Fp8:
    recipe: Literal["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = "none"
    """torchao float8 training recipe for the Linear layers (none = bf16)."""
    enable_fsdp_float8_all_gather: bool | None = None
    """All-gather weights in float8 (tensorwise only); unset = on when tensorwise and dp_shard > 1."""
    precompute_float8_dynamic_scale_for_fsdp: bool | None = None
    """One all-reduce after each optimizer step computes every weight's scale; unset = on with float8 all-gather."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains one of these stay in high precision."""
    auto_filter: Literal["true", "false", "measure"] = "true"
    """Which Linears convert: true = those large enough to pay (by a size rule); measure = at start-up
    on this GPU, time one whole compiled block forward + backward at the run's micro-batch with no,
    the feed-forward's or every Linear in float8 and convert what was fastest (cached; the size rule
    without a GPU; the output layer stays high precision); false = all (dimensions not multiples of
    16 always stay high precision)."""
    scaling: Literal["dynamic", "delayed"] = "dynamic"
    """How tensorwise scales each Linear's input, weight and output gradient: dynamic = from the
    tensor's own amax (a read of the whole tensor before the cast); delayed = from the amaxes of the
    last amax_history measurements, taken during the casts: faster (titanlike/float8/delayed.py).
    Weights that FSDP all-gathers in float8 keep their precomputed dynamic scales either way."""
    amax_history: int = 16
    """Measurements of the largest magnitudes that delayed scaling takes the maximum of."""
    amax_every: int = 1
    """Delayed scaling measures the largest magnitudes on every this-many-th step only (1 = every
    step): the steps between skip the measuring and run faster; a value that grew since the last
    measurement saturates until the next."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision (CPU tests, GPUs without float8)."""
    health_log_freq: int = 10
    """Log float8 weight health at every this-many-th log step (every metrics.log_freq × health_log_freq steps;
    0 = off): per converted Linear, the weight amax and the shares of values that would saturate or flush to
    zero when cast to float8; per layer in TensorBoard (fp8/<layer>/...), the worst layer in metrics.jsonl."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block and the loss."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (every block), selective (see option)."""
    selective_ac_option: str = "op"
    """With mode = selective: "op" saves matmul outputs and float8 amax reductions and recomputes
    the rest; an integer k checkpoints every k-th block fully."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save distributed checkpoints and resume from the newest complete one."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder unless absolute."""
    interval: int = 500
    """Save every this many steps (and always at the last step)."""
    keep_latest_k: int = 0
    """Keep only the newest k complete checkpoints (0 = keep all)."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Save in the background so the training step barely stalls."""
    load_step: int = -1
    """Resume from this step's checkpoint (-1 = the newest complete one)."""
    initial_load_path: str = ""
    """Start a new run from these weights: a safetensors (Hugging Face) folder, or a checkpoint step folder
    that titanlike wrote on this account (else see trust_pickled_dcp)."""
    trust_pickled_dcp: bool = False
    """Load a DCP checkpoint folder from elsewhere under initial_load_path. Its .metadata is a Python pickle:
    loading it can run any code its author put there. Only for folders from someone you trust."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log one console line and one metrics.jsonl record every this many steps."""
    enable_tensorboard: bool = True
    """Write TensorBoard scalars to <dump_folder>/tb."""


@dataclass
class Validation:
    enable: bool = True
    """Evaluate loss and perplexity on held-out data."""
    freq: int = 50
    """Validate every this many steps (and at the last step)."""
    steps: int = 4
    """Global batches of held-out data per evaluation (the same samples for any number of ranks)."""


@dataclass
class Profiling:
    enable: bool = False
    """Write torch.profiler traces (chrome trace JSON, one per rank and window; see docs/profiling.md)."""
    freq: int = 100
    """Profile a window of steps every this many steps: a window ends at each multiple of freq."""
    warmup: int = 3
    """Profiler warm-up steps in each window."""
    active: int = 1
    """Recorded steps in each window."""
    memory_snapshot: bool = False
    """Record CUDA allocator history and dump a snapshot at the end of the first window (and on OOM)."""
    folder: str = "profile"
    """Where traces and memory snapshots go, relative to job.dump_folder unless absolute:
    <folder>/step-N/rank{R}_trace.json."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallel: Parallel = field(default_factory=Parallel)
    fp8: Fp8 = field(default_factory=Fp8)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)


# ---------------------------------------------------------------------------------------------
# Introspection: sections, fields, their types and docstrings.


def sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]


def field_docs(section_cls: type) -> dict[str, str]:
    """The docstring under each field of a section dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(section_cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_types(section_cls: type) -> dict[str, object]:
    return typing.get_type_hints(section_cls)


def _describe(tp: object) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        return f"a comma-separated list of {_describe(typing.get_args(tp)[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


class _BareFlag(str):
    """A command-line option given without a value: true for booleans, a mistake otherwise."""


BARE_FLAG = _BareFlag("true")


def _coerce(key: str, raw: object, tp: object) -> object:
    """Turn a TOML value or a command-line string into the field's type, or raise ConfigError."""
    if isinstance(raw, _BareFlag) and bool not in (tp, *typing.get_args(tp)) and "true" not in typing.get_args(tp):
        raise ConfigError(f"--{key} needs a value: {_describe(tp)}")
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key} = {raw!r} is not valid: expected {_describe(tp)}")
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none", "auto")):
            return None
        return _coerce(key, raw, args[0])
    if origin is Literal:
        choices = typing.get_args(tp)
        value = str(raw).lower() if isinstance(raw, bool) else str(raw)  # TOML true → "true"
        if value not in choices:
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key} = {raw!r} is not one of {', '.join(map(str, choices))}{hint}")
        return value
    if origin is list:
        (elem,) = typing.get_args(tp)
        if isinstance(raw, str):
            items = [s.strip() for s in raw.split(",") if s.strip()]
        elif isinstance(raw, (list, tuple)):
            items = list(raw)
        else:
            raise bad
        return [_coerce(key, item, elem) for item in items]
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(raw, str) and raw.lower() in ("false", "0", "no", "off"):
            return False
        raise bad
    if tp is int:
        if isinstance(raw, bool):
            raise bad
        if isinstance(raw, int):
            return raw
        try:
            return int(str(raw).replace("_", ""))
        except ValueError:
            raise bad from None
    if tp is float:
        if isinstance(raw, bool):
            raise bad
        try:
            return float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise bad from None
    if tp is str:
        if isinstance(raw, (dict, list)):
            raise bad
        return str(raw)
    raise bad


def _closest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else f"; valid: {', '.join(candidates)}"


def _set(cfg: JobConfig, section: str, key: str, raw: object, source: str) -> None:
    secs = sections()
    if section not in secs:
        raise ConfigError(f"unknown config section [{section}] in {source}{_closest(section, list(secs))}")
    types = _field_types(secs[section])
    if key not in types:
        full = [f"{section}.{k}" for k in types]
        everything = [f"{s}.{k}" for s, c in secs.items() for k in _field_types(c)]
        # The same key in another section (--training.lr → optimizer.lr) beats a look-alike spelling.
        same_key = [f"{s}.{key}" for s, c in secs.items() if key in _field_types(c)]
        near = same_key or difflib.get_close_matches(f"{section}.{key}", everything, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else f"; valid: {', '.join(full)}"
        raise ConfigError(f"unknown config key {section}.{key} in {source}{hint}")
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", raw, types[key]))


# ---------------------------------------------------------------------------------------------
# Loading.


def _parse_cli(argv: list[str]) -> list[tuple[str, str, object]]:
    """`--section.key value`, `--section.key=value`, or a bare `--section.key` for booleans."""
    out: list[tuple[str, str, object]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        if "." not in name:
            raise ConfigError(f"option --{name} needs a section, like --training.steps 100")
        section, _, key = name.partition(".")
        if not eq:
            # A value follows unless the next token is another option (a bare boolean flag).
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                value = BARE_FLAG
        out.append((section.replace("-", "_"), key.replace("-", "_"), value))
        i += 1
    return out


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file (job.config_file, from the CLI), then the CLI overrides; validated."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        raise SystemExit(0)
    overrides = _parse_cli(argv)
    cfg = JobConfig()
    config_file = [v for s, k, v in overrides if (s, k) == ("job", "config_file")]
    if config_file and config_file[-1]:
        path = str(config_file[-1])
        if not os.path.isfile(path):
            raise ConfigError(f"job.config_file = {path!r}: no such file")
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"job.config_file = {path!r} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"job.config_file = {path!r} is not UTF-8 text (byte {e.start}): TOML files are UTF-8") from None
        except OSError as e:
            raise ConfigError(f"job.config_file = {path!r} cannot be read: {e.strerror}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
            for key, value in table.items():
                _set(cfg, section, key, value, path)
    for section, key, value in overrides:
        _set(cfg, section, key, value, "the command line")
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Checks that need no process group and no GPU. World-size checks live in parallel.py."""
    from titanlike.model import PRESETS, model_args  # late import: config must not depend on torch at import

    t, d, o, s = cfg.training, cfg.data, cfg.optimizer, cfg.lr_scheduler

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    m = cfg.model
    need(m.flavor in PRESETS or m.flavor == "hf",
         f"model.flavor = {m.flavor!r} is not a preset; valid: {', '.join(PRESETS)}, hf")
    need(m.vocab_size >= 0, f"model.vocab_size = {m.vocab_size} must be >= 0 (0 = the tokenizer's or the preset's)")
    # Real vocabularies stay below 2^20; past 2^24 the embedding alone takes tens of GB.
    need(m.vocab_size <= 2**24, f"model.vocab_size = {m.vocab_size} is too large: at most 2^24 = {2**24}")
    need(0 <= cfg.job.seed < 2**63, f"job.seed = {cfg.job.seed} must be in [0, 2^63)")
    need(bool(cfg.job.dump_folder.strip()), "job.dump_folder must not be empty (default ./outputs)")
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps", "max_seq_len"):
        need(getattr(m, key) >= 0, f"model.{key} = {getattr(m, key)} must be >= 0 (0 = the preset's)")
    need(m.flavor != "hf" or bool(cfg.checkpoint.initial_load_path),
         "model.flavor = hf takes the shape from a Hugging Face folder's config.json: "
         "set --checkpoint.initial_load_path")
    if m.flavor != "hf":  # an hf shape is checked once its config.json is read (titanlike/model_shape.py)
        from titanlike.model_shape import shape_overrides

        shape = model_args(m.flavor, **shape_overrides(m))
        for problem in shape.problems():
            need(False, f"model shape ({m.flavor} with the model.* overrides): {problem}")
        need(d.seq_len <= shape.max_seq_len,
             f"data.seq_len = {d.seq_len} exceeds model.max_seq_len = {shape.max_seq_len}")
    need(d.seq_len >= 8, f"data.seq_len = {d.seq_len} must be at least 8")
    need(d.num_workers >= 0, f"data.num_workers = {d.num_workers} must be >= 0")
    for key, path in (("data.path", d.path), ("data.val_path", d.val_path)):
        need(not path or os.path.exists(path), f"{key} = {path!r}: no such file or folder")
    need(t.local_batch_size >= 1, f"training.local_batch_size = {t.local_batch_size} must be >= 1")
    need(t.global_batch_size >= 0, f"training.global_batch_size = {t.global_batch_size} must be >= 0 (0 = local × DP)")
    need(
        t.global_batch_size == 0 or t.global_batch_size % t.local_batch_size == 0,
        f"training.global_batch_size = {t.global_batch_size} must be a multiple of "
        f"training.local_batch_size = {t.local_batch_size} (× the data-parallel degree)",
    )
    need(t.steps >= 1, f"training.steps = {t.steps} must be >= 1")
    need(t.max_norm >= 0, f"training.max_norm = {t.max_norm} must be >= 0 (0 = no clipping)")
    need(t.loss_chunk_tokens >= 0, f"training.loss_chunk_tokens = {t.loss_chunk_tokens} must be >= 0 (0 = off)")
    need(t.gpu_memory_limit_gib >= 0, f"training.gpu_memory_limit_gib = {t.gpu_memory_limit_gib} must be >= 0 (0 = no cap)")
    need(o.lr > 0, f"optimizer.lr = {o.lr} must be > 0")
    need(o.weight_decay >= 0, f"optimizer.weight_decay = {o.weight_decay} must be >= 0")
    need(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        f"optimizer.betas = {o.betas} must be two numbers in [0, 1), like 0.9,0.95",
    )
    need(o.eps > 0, f"optimizer.eps = {o.eps} must be > 0")
    need(s.warmup_steps >= 0, f"lr_scheduler.warmup_steps = {s.warmup_steps} must be >= 0")
    need(0 <= s.decay_ratio <= 1, f"lr_scheduler.decay_ratio = {s.decay_ratio} must be in [0, 1]")
    need(0 <= s.min_lr_factor <= 1, f"lr_scheduler.min_lr_factor = {s.min_lr_factor} must be in [0, 1]")
    p = cfg.parallel
    need(p.dp_shard == -1 or p.dp_shard >= 1, f"parallel.dp_shard = {p.dp_shard} must be -1 (all ranks) or >= 1")
    need(p.dp_replicate == -1 or p.dp_replicate >= 1, f"parallel.dp_replicate = {p.dp_replicate} must be -1 (the rest) or >= 1")
    need(1 <= p.backend_timeout_s <= 10**6,
         f"parallel.backend_timeout_s = {p.backend_timeout_s} must be in [1, 1000000] (about 11 days)")
    f8 = cfg.fp8
    need(
        not (f8.enable_fsdp_float8_all_gather and f8.recipe != "tensorwise"),
        f"fp8.enable_fsdp_float8_all_gather needs fp8.recipe = tensorwise (got {f8.recipe!r}): rowwise "
        f"scales are per row of each matmul input, so a weight cannot be gathered in float8 once for all uses",
    )
    need(
        f8.scaling == "dynamic" or f8.recipe == "tensorwise",
        f"fp8.scaling = delayed needs fp8.recipe = tensorwise (got {f8.recipe!r}): rowwise scales are per row "
        f"of each tensor, which changes from step to step",
    )
    need(f8.amax_history >= 1, f"fp8.amax_history = {f8.amax_history} must be >= 1")
    need(f8.amax_every >= 1, f"fp8.amax_every = {f8.amax_every} must be >= 1")
    need(
        not (f8.precompute_float8_dynamic_scale_for_fsdp and f8.enable_fsdp_float8_all_gather is False),
        "fp8.precompute_float8_dynamic_scale_for_fsdp needs fp8.enable_fsdp_float8_all_gather",
    )
    ac = cfg.activation_checkpoint
    if ac.mode == "selective":
        need(
            ac.selective_ac_option == "op"
            or (ac.selective_ac_option.isascii() and ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) >= 1),
            f"activation_checkpoint.selective_ac_option = {ac.selective_ac_option!r} must be 'op' or a positive integer",
        )
    c = cfg.checkpoint
    need(c.interval >= 1, f"checkpoint.interval = {c.interval} must be >= 1")
    need(c.keep_latest_k >= 0, f"checkpoint.keep_latest_k = {c.keep_latest_k} must be >= 0 (0 = keep all)")
    need(c.load_step >= -1, f"checkpoint.load_step = {c.load_step} must be -1 (newest) or a step")
    need(
        not c.initial_load_path or os.path.exists(c.initial_load_path),
        f"checkpoint.initial_load_path = {c.initial_load_path!r}: no such file or folder",
    )
    need(
        t.nonfinite != "rollback" or c.enable,
        "training.nonfinite = rollback reloads the last checkpoint: it needs --checkpoint.enable",
    )
    need(f8.health_log_freq >= 0, f"fp8.health_log_freq = {f8.health_log_freq} must be >= 0 (0 = off)")
    need(cfg.metrics.log_freq >= 1, f"metrics.log_freq = {cfg.metrics.log_freq} must be >= 1")
    v = cfg.validation
    need(v.freq >= 1 and v.steps >= 1, f"validation.freq and validation.steps must be >= 1 (got {v.freq}, {v.steps})")
    pr = cfg.profiling
    need(
        pr.freq >= 1 and pr.warmup >= 0 and pr.active >= 1 and pr.warmup + pr.active < pr.freq + 1,
        f"profiling: need freq >= 1, active >= 1 and warmup + active <= freq (got {pr.freq}, {pr.warmup}, {pr.active})",
    )
    need(bool(pr.folder.strip()), "profiling.folder must not be empty (default \"profile\", inside job.dump_folder)")


# ---------------------------------------------------------------------------------------------
# Output.


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    # A TOML basic string: backslash, quote and every control character escaped (a path may hold them).
    out = []
    for ch in str(v):
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML (unset optional fields are omitted: they mean 'decide for me')."""
    lines = []
    for name in sections():
        lines.append(f"[{name}]")
        for key, value in dataclasses.asdict(getattr(cfg, name)).items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    out = ["usage: run_train.sh [--section.key value ...]   (TOML file via --job.config_file)", ""]
    for name, cls in sections().items():
        out.append(f"[{name}]")
        docs = field_docs(cls)
        defaults = cls()
        for key, tp in _field_types(cls).items():
            out.append(f"  --{name}.{key} ({_describe(tp)}; default {getattr(defaults, key)!r})")
            out.append(f"      {docs.get(key, '')}")
        out.append("")
    return "\n".join(out)
