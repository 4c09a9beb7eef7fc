"""The job configuration's schema: every option, its type, default and docstring, and what a valid value is.

Each `[section]` is a dataclass; the string literal under a field is its documentation, which
`--help`, error lines and docs/configuration.md all read back (loader.field_docs). Each section's
`validate()` holds the rules that section alone decides; rules.py's `validate_across_sections` holds
the few that tie two sections together. All of them run before a process group or a GPU is touched (the
preflight imports no torch) and fail as one `ConfigError` line that names the key, the value and
what would be valid. The sections of how a step runs fast (sharding, compile, recompute) are in
speed.py, float8's in fp8.py, the optimizer's in optimizer.py. Reading TOML and the command line is loader.py's job;
parsing [data]'s mixture strings, sources.py's; which model shape a config means, resolve.py's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from titanlike.config import sources
from titanlike.config.fp8 import Fp8
from titanlike.config.host import available_cores
from titanlike.config.loader import need
from titanlike.config.optimizer import Optimizer
from titanlike.config.speed import ActivationCheckpoint, Compile, Parallel
from titanlike.model.shape import PRESETS

# data.num_workers: loader processes beyond a few per core only cost memory (each holds the dataset).
MAX_WORKERS_PER_CORE = 4


@dataclass
class Job:
    config_file: str = ""
    """TOML file to read before the command-line overrides ("" = the defaults: debug_model.toml's job)."""
    dump_folder: str = "./outputs/debug"
    """Run folder: resolved config, metrics.jsonl, TensorBoard events, checkpoints."""
    seed: int = 0
    """Seed for weight init, data order and dropout-free RNG state; same seed, same run."""
    print_config: bool = False
    """Print the resolved config as TOML and exit without training. The printed file says `print_config =
    false`: saved, it trains as `--job.config_file`."""

    def validate(self) -> None:
        need(0 <= self.seed < 2**63, f"job.seed = {self.seed} must be in [0, 2^63)")
        need(bool(self.dump_folder.strip()), "job.dump_folder must not be empty (default ./outputs/debug)")


@dataclass
class Model:
    flavor: str = "debug"
    """Model preset: debug, 124m, 1b, 3b, 8b, 70b (titanlike/model/shape.py), or hf: the whole shape from
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
    """Longest sequence the model is meant for: no stage's data.seq_len exceeds it. An export's config.json gives
    the longest window the saved weights trained on (max_position_embeddings), at most this."""
    attn_mask: Literal["causal", "block_causal"] = "causal"
    """causal: every token attends to all earlier tokens of its window. block_causal: only to those of its
    own document, split at the data's end-of-document id (dataset.json's eos_id; the byte tokenizer's for
    the embedded corpus), with flex attention on a GPU; causal runs keep SDPA. At inference each prompt is
    one document. A resume may change it (one log line)."""

    def shape_overrides(self) -> dict:
        """The fields that override a preset's shape (0 / None = keep the preset's)."""
        keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps", "qk_norm",
                "max_seq_len", "vocab_size", "tie_embeddings", "attn_mask")
        return {k: getattr(self, k) for k in keys}

    def validate(self) -> None:
        need(self.flavor in PRESETS or self.flavor == "hf",
             f"model.flavor = {self.flavor!r} is not a preset; valid: {', '.join(PRESETS)}, hf")
        need(self.vocab_size >= 0,
             f"model.vocab_size = {self.vocab_size} must be >= 0 (0 = the tokenizer's or the preset's)")
        # Real vocabularies stay below 2^20; past 2^24 the embedding alone takes tens of GB.
        need(self.vocab_size <= 2**24, f"model.vocab_size = {self.vocab_size} is too large: at most 2^24 = {2**24}")
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "norm_eps", "max_seq_len"):
            need(getattr(self, key) >= 0, f"model.{key} = {getattr(self, key)} must be >= 0 (0 = the preset's)")
        # The shape the overrides make is built and checked once, with the rules across sections.


@dataclass
class Data:
    path: str = ""
    """Token shards: a .bin file or a folder of them ("" = the embedded Python-stdlib corpus, built once per
    machine into ~/.cache/titanlike or $TITANLIKE_CACHE)."""
    val_path: str = ""
    """Validation shards ("" = none, except for the embedded corpus, which holds out its own)."""
    mix: str = ""
    """A weighted mixture of prepared datasets instead of data.path: "web=data/web:0.7,code=data/code:0.3",
    each NAME=FOLDER:WEIGHT with FOLDER what titanlike-prepare wrote (dataset.json, train/, val/); in TOML
    the same string or [[data.mix]] tables with name, path and weight. Weights are positive and
    normalised; all sources share one tokenizer. Each sample's source is a function of (job.seed, its
    position), so a mixture resumes exactly at any world size; a small source repeats (a new order each
    epoch) while a large one goes on. Validation reads each source's val/ (docs/data.md)."""
    anneal_mix: str = ""
    """A second mixture (spelled as data.mix) that replaces the first from step data.anneal_from_step on,
    e.g. to anneal on higher-quality data; a source named in both goes on where it stopped."""
    anneal_from_step: int = 0
    """The first step that reads data.anneal_mix (0 = no second mixture); in [2, training.steps]."""
    phase: str = ""
    """Any number of later mixtures or stages, each from a step on: in TOML [[data.phase]] tables with
    from_step and mix (a mix string, or [[data.phase.mix]] tables); on the command line
    "STEP:MIX;STEP:MIX". The first mixture (data.mix or data.path) applies from step 1. A table may also
    (or only) set seq_len, rope_theta, local_batch_size and global_batch_size, which start a stage: from
    that step on the run reads samples of that length, rotates with that RoPE base and steps with that
    batch (on the command line "STEP:MIX,seq_len=32768,rope_theta=2e6" or "STEP:seq_len=32768"); what a
    stage leaves unset carries over (docs/data.md, "Long-context stage"). A resume may change the
    schedule: one log line says so, and the configured one applies at the saved position."""
    seq_len: int = 256
    """Tokens per sample (each sample reads seq_len + 1 tokens: inputs and shifted targets)."""
    num_workers: int = 0
    """Data-loader worker processes per rank (0 = load in the training process)."""

    # TOML's other spellings of some fields, turned into the field's value as they are read (config/loader.py).
    toml_forms = MappingProxyType({"mix": sources.mix_from_tables, "anneal_mix": sources.mix_from_tables,
                                   "phase": sources.phases_from_tables})

    def validate(self) -> None:
        need(self.seq_len >= 8, f"data.seq_len = {self.seq_len} must be at least 8")
        need(self.num_workers >= 0, f"data.num_workers = {self.num_workers} must be >= 0")
        # Each worker is a process holding a copy of the dataset: more than a few per core only costs memory.
        cores = available_cores()
        need(self.num_workers <= MAX_WORKERS_PER_CORE * cores,
             f"data.num_workers = {self.num_workers} is more than {MAX_WORKERS_PER_CORE} per CPU core "
             f"({cores} cores here): use at most {MAX_WORKERS_PER_CORE * cores}")
        for key, path in (("data.path", self.path), ("data.val_path", self.val_path)):
            need(not path or os.path.exists(path), f"{key} = {path!r}: no such file or folder")
        need(not (self.mix and (self.path or self.val_path)),
             "data.mix names the training data and each source's val/ its validation data: leave data.path and "
             "data.val_path unset (a mixture of one source is data.path)")
        for key, text in (("data.mix", self.mix), ("data.anneal_mix", self.anneal_mix)):
            problem = sources.problem(sources.parse_mix, text) if text else None
            need(problem is None, f"{key} = {text!r}: {problem}")
        problem = sources.problem(sources.parse_phases, self.phase) if self.phase else None
        need(problem is None, f"data.phase = {self.phase!r}: {problem}")
        need(self.anneal_from_step >= 0 and bool(self.anneal_mix) == bool(self.anneal_from_step),
             f"data.anneal_mix and data.anneal_from_step go together: the second mixture and its first step "
             f"(got {self.anneal_mix!r} from step {self.anneal_from_step})")
        need(not (self.anneal_mix and self.phase),
             "data.anneal_mix is one later mixture and data.phase a list of them: give one of the two")
        schedule = sources.schedule_of(self)
        need(len(schedule.phases) == 1 or not schedule.builtin_corpus,
             "a schedule mixes prepared datasets: name the first mixture with data.mix (or data.path), not the "
             "embedded corpus")
        conflict = schedule.name_conflict()
        need(conflict is None, str(conflict))
        for source in schedule.sources if schedule.mixed else ():
            need(os.path.exists(source.path), f"data source {source.name} = {source.path!r}: no such folder")


@dataclass
class Training:
    local_batch_size: int = 16
    """Samples per micro-batch on each rank."""
    global_batch_size: int = 0
    """Samples per optimizer step over all ranks; 0 = local × data-parallel degree. A multiple of
    that product; the ratio is the number of gradient-accumulation micro-batches."""
    steps: int = 150
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
    fit_gib: float | Literal["auto"] = 0.0
    """Fit the run in this many GiB per GPU (0 = off; auto = the GPU it runs on, less 5 % for the estimate's
    error): before the first step, apply the fastest levers whose estimate fits every training stage
    (titanlike-plan: loss chunks, recompute, smaller micro-batches, moments, offload), log one line saying which,
    and record them in config.toml. Command-line options are kept, and TOML options that change what is
    trained (the moments' dtype); the others only trade speed for memory. docs/memory.md."""
    loss_chunk_tokens: int = 0
    """Compute the output layer and the loss this many tokens at a time, so that the whole
    (tokens × vocab) logits never exist (0 = off: whole logits). Each chunk's gradients are computed
    in forward (no extra matmul); with a float8 output layer its logits are recomputed in backward
    instead. Same loss and gradients; saves memory with large vocabularies (model/loss.py)."""
    mixed_precision: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype on GPU (params stay fp32; gradients are summed over ranks in mixed_precision_reduce's
    dtype). CPU always runs fp32."""
    mixed_precision_reduce: Literal["fp32", "bf16"] = "fp32"
    """The dtype the ranks' gradients are summed in (FSDP's reduce-scatter, HSDP's all-reduce): fp32 = exact
    sums; bf16 = half the bytes on the wire, each sum rounded to bf16 (the rounding grows with the ranks
    summed): for slow links. The gradients stay fp32, but FSDP casts them from the bf16 sums on its
    reduce-scatter stream, in memory of their own (1b, cp 2, two H200s: 1.007x for 2.9 GiB; docs/parallelism.md).
    One rank sums nothing: it stays fp32 there."""
    nonfinite: Literal["abort", "skip", "rollback"] = "abort"
    """What a non-finite loss or gradient norm does. abort: stop with one line naming the step. skip: skip
    that step's update (its batch is consumed and the LR schedule moves on; metrics.jsonl counts
    skipped_steps; 3 skipped in a row stop the run). rollback: reload the newest checkpoint and go on with the
    data after the offending batch, not replaying it (needs checkpoint.enable; after 3 rollbacks to the same
    checkpoint the next one stops the run). Values are checked at log steps and before each save
    (docs/troubleshooting.md)."""

    def validate(self) -> None:
        need(self.local_batch_size >= 1, f"training.local_batch_size = {self.local_batch_size} must be >= 1")
        need(self.global_batch_size >= 0,
             f"training.global_batch_size = {self.global_batch_size} must be >= 0 (0 = local × DP)")
        need(
            self.global_batch_size == 0 or self.global_batch_size % self.local_batch_size == 0,
            f"training.global_batch_size = {self.global_batch_size} must be a multiple of "
            f"training.local_batch_size = {self.local_batch_size} (× the data-parallel degree)",
        )
        need(self.steps >= 1, f"training.steps = {self.steps} must be >= 1")
        need(self.max_norm >= 0, f"training.max_norm = {self.max_norm} must be >= 0 (0 = no clipping)")
        need(self.loss_chunk_tokens >= 0,
             f"training.loss_chunk_tokens = {self.loss_chunk_tokens} must be >= 0 (0 = off)")
        need(self.fit_gib == "auto" or 0 <= self.fit_gib <= 2**20,
             f"training.fit_gib = {self.fit_gib} must be in [0, 1048576] GiB (0 = off) or auto")
        need(0 <= self.gpu_memory_limit_gib <= 2**20, f"training.gpu_memory_limit_gib = {self.gpu_memory_limit_gib} "
                                                      f"must be in [0, 1048576] GiB (0 = no cap)")


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    """Steps of linear warmup from near zero to the peak LR."""
    decay_ratio: float = 0.3
    """Fraction of all steps spent decaying at the end (warmup-stable-decay); 1.0 = decay right after warmup."""
    decay_type: Literal["linear", "cosine"] = "linear"
    """Shape of the decay phase."""
    min_lr_factor: float = 0.0
    """LR at the end of decay, as a fraction of the peak."""

    def validate(self) -> None:
        need(self.warmup_steps >= 0, f"lr_scheduler.warmup_steps = {self.warmup_steps} must be >= 0")
        need(0 <= self.decay_ratio <= 1, f"lr_scheduler.decay_ratio = {self.decay_ratio} must be in [0, 1]")
        need(0 <= self.min_lr_factor <= 1, f"lr_scheduler.min_lr_factor = {self.min_lr_factor} must be in [0, 1]")


@dataclass
class Checkpoint:
    enable: bool = False
    """Save distributed checkpoints and resume from the newest complete one."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder unless absolute."""
    interval: int = 50
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

    def validate(self) -> None:
        need(bool(self.folder.strip()),
             "checkpoint.folder must not be empty (default \"checkpoint\", inside job.dump_folder)")
        need(self.interval >= 1, f"checkpoint.interval = {self.interval} must be >= 1")
        need(self.keep_latest_k >= 0, f"checkpoint.keep_latest_k = {self.keep_latest_k} must be >= 0 (0 = keep all)")
        need(self.load_step >= -1, f"checkpoint.load_step = {self.load_step} must be -1 (newest) or a step")
        need(
            not self.initial_load_path or os.path.exists(self.initial_load_path),
            f"checkpoint.initial_load_path = {self.initial_load_path!r}: no such file or folder",
        )


@dataclass
class Metrics:
    log_freq: int = 10
    """Log one console line and one metrics.jsonl record every this many steps."""
    enable_tensorboard: bool = True
    """Write TensorBoard scalars to <dump_folder>/tb."""
    enable_wandb: bool = False
    """Also send the TensorBoard scalars to Weights & Biases (pip install 'titanlike[wandb]'); W&B's files go to
    <dump_folder>/wandb, and a resumed run continues the same W&B run. WANDB_MODE=offline needs no account."""
    wandb_project: str = "titanlike"
    """The W&B project the run goes to (the entity is W&B's own setting: WANDB_ENTITY, or your default)."""
    wandb_name: str = ""
    """The W&B run's display name ("" = the dump folder's name)."""

    def validate(self) -> None:
        need(self.log_freq >= 1, f"metrics.log_freq = {self.log_freq} must be >= 1")
        bad = [c for c in "/\\#?%:" if c in self.wandb_project]
        need(bool(self.wandb_project.strip()) and len(self.wandb_project) <= 128 and not bad,
             f"metrics.wandb_project = {self.wandb_project!r}: a W&B project name is 1 to 128 characters, "
             f"none of / \\ # ? % :")


@dataclass
class Validation:
    enable: bool = True
    """Evaluate loss and perplexity on held-out data."""
    freq: int = 50
    """Validate every this many steps (and at the last step)."""
    steps: int = 4
    """Global batches of held-out data per evaluation (the same at any world size); 0 or more than it has: all, once."""

    def validate(self) -> None:
        need(self.freq >= 1 and self.steps >= 0, f"validation.freq must be >= 1 and validation.steps >= 0 "
             f"(0 = all the held-out data) (got {self.freq}, {self.steps})")


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

    def validate(self) -> None:
        need(
            self.freq >= 1 and self.warmup >= 0 and self.active >= 1 and self.warmup + self.active < self.freq + 1,
            f"profiling: need freq >= 1, active >= 1 and warmup + active <= freq "
            f"(got {self.freq}, {self.warmup}, {self.active})",
        )
        need(bool(self.folder.strip()),
             "profiling.folder must not be empty (default \"profile\", inside job.dump_folder)")


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
# Where a folder option points (the rules across sections are rules.py's).


def in_dump_folder(dump_folder: str, folder: str) -> str:
    """A folder option (checkpoint.folder, profiling.folder): relative to job.dump_folder unless absolute."""
    return folder if os.path.isabs(folder) else os.path.join(dump_folder, folder)
