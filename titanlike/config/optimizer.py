"""The [optimizer] section, and what the rest of the run knows of each optimizer without torch.

`optimizer.name` picks one optimizer of OPTIMIZERS; titanlike/optim/__init__.py builds it from this section
through its registry (one builder a name). OPTIMIZERS holds, one entry a name, the facts that the rules
across sections, the checkpoint and the memory plan read (plain Python: the preflight and titanlike-plan
import no torch): which state dtypes it takes, whether it can step on the host (parallel.cpu_offload), its
state's bytes and the transient memory of its step. A new optimizer is one module in optim/, one builder in
its registry and one entry here (docs/architecture.md, "How to add an optimizer")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from titanlike.config.loader import need
from titanlike.model.shape import ModelArgs, block_matrix_pieces, count_params

# AdamW's two moments: fp32 (8 bytes a parameter), bf16 (4), or torchao's 8-bit blockwise moments (1 byte each
# and an fp32 scale per block of 256 values).
MOMENT_BYTES = {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 * (1 + 4 / 256)}


@dataclass
class Optimizer:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW on every parameter. muon: Muon (momentum, then each matrix's update orthogonalised by
    Newton–Schulz iterations) on the blocks' attention and feed-forward matrices, AdamW on the rest (the
    embeddings, the output layer, the norm gains), with optimizer.lr and optimizer.weight_decay for both
    (adjust_lr = match_rms_adamw makes that work). A resume must keep the value (docs/optimizers.md)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW. With optimizer.name = muon, Muon's matrices take it too."""
    weight_decay: float = 0.1
    """Decoupled weight decay of AdamW, applied to weight matrices and embeddings, not to norm gains (and to
    Muon's matrices with optimizer.name = muon)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas, two numbers: --optimizer.betas 0.9,0.95"""
    eps: float = 1e-8
    """AdamW epsilon."""
    state_dtype: Literal["fp32", "bf16", "8bit"] = "fp32"
    """How AdamW keeps its two moments. fp32: 8 bytes per parameter, torch's fused AdamW. bf16: 4 bytes, the
    update in fp32 and the moments rounded to bf16 after it, one fused kernel a parameter on a GPU. 8bit:
    torchao's AdamW8bit, blockwise-quantized moments at about 2 bytes per parameter, each parameter updated
    by its own compiled kernel (the first step compiles them); a background save copies the 8-bit state to
    host memory before training goes on. bf16 and 8bit train close to fp32, not bit for bit (docs/memory.md);
    a resume must keep the value. With optimizer.name = muon: fp32 or bf16, for its AdamW parameters (Muon's
    momentum is fp32)."""
    momentum: float = 0.95
    """Muon's momentum (optimizer.name = muon; AdamW's are betas), in [0, 1)."""
    nesterov: bool = True
    """Muon orthogonalises the Nesterov direction (gradient + momentum × buffer) rather than the buffer."""
    ns_steps: int = 5
    """Muon's Newton–Schulz iterations a step, 1 to 99: each costs about 3 bf16 matmuls the size of its matrix."""
    ns_coefficients: Literal["quintic", "polar_express"] = "polar_express"
    """The polynomial of Muon's Newton–Schulz steps, the same matmuls either way. polar_express: a polynomial for
    each step, the best one for where the singular values can be by then (arXiv:2505.16932; optim/polar_express.py
    derives them for optimizer.ns_steps), closer to orthogonal; on 124m it ended lower than the quintic at the
    same lr (docs/optimizers.md). quintic: Keller Jordan's (3.4445, -4.7750, 2.0315) at every step,
    torch.optim.Muon's."""
    adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """How Muon scales each orthogonalised update before the learning rate. match_rms_adamw: by
    0.2·sqrt(max(rows, cols)), an update of AdamW's RMS, so that AdamW's lr and weight decay carry over.
    original: by sqrt(max(1, rows/cols)) (Keller Jordan's), which wants a learning rate of its own (about 0.02)."""

    def validate(self) -> None:
        need(self.lr > 0, f"optimizer.lr = {self.lr} must be > 0")
        need(self.weight_decay >= 0, f"optimizer.weight_decay = {self.weight_decay} must be >= 0")
        need(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optimizer.betas = {self.betas} must be two numbers in [0, 1), like 0.9,0.95",
        )
        need(self.eps > 0, f"optimizer.eps = {self.eps} must be > 0")
        need(0 <= self.momentum < 1, f"optimizer.momentum = {self.momentum} must be in [0, 1)")
        need(1 <= self.ns_steps <= 99, f"optimizer.ns_steps = {self.ns_steps} must be in 1..99")
        facts = OPTIMIZERS[self.name]
        need(self.state_dtype in facts.state_dtypes,
             f"optimizer.state_dtype = {self.state_dtype} does not go with optimizer.name = {self.name}: "
             f"{facts.state_dtype_refusal}; use {' or '.join(facts.state_dtypes)}")

    def settings(self) -> dict:
        """What a resume may change, by option name (each change is one line in its log): this optimizer's
        keys (OptimizerFacts.keys)."""
        values = {key: getattr(self, key) for key in OPTIMIZERS[self.name].keys}
        return {f"optimizer.{key}": list(v) if isinstance(v, list) else v for key, v in values.items()}


# ---- each optimizer's facts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerFacts:
    """What the config rules, the checkpoint and the memory plan know of one optimizer, without torch."""

    keys: tuple[str, ...]
    """The [optimizer] keys it reads, which a resume may change (optimizer.name and state_dtype it may not)."""
    state_dtypes: tuple[str, ...]
    """The optimizer.state_dtype values it takes."""
    state_bytes: Callable[[ModelArgs, str], float]
    """Bytes of its state for the whole model (`state_dtype`), before FSDP shards it."""
    describe: Callable[[str], str]
    """Its state in words, for the plan's row ("AdamW, fp32 moments")."""
    step_bytes: Callable[[ModelArgs, int], float] = lambda args, shard: 0.0
    """Transient bytes its step allocates on one rank, beyond the state (`shard`: FSDP's shard degree)."""
    state_dtype_refusal: str = ""
    """Why a state dtype it does not take is refused (the config's one line)."""
    host_step: str = ""
    """Why it cannot step on the CPU while the model computes on a GPU (parallel.cpu_offload); "": it can."""


ADAMW_KEYS = ("lr", "weight_decay", "betas", "eps")


def muon_params(args: ModelArgs) -> int:
    """Parameters Muon updates: the blocks' attention and feed-forward matrices (the rest are AdamW's)."""
    return args.n_layers * sum(rows * cols for rows, cols in block_matrix_pieces(args))


def muon_state_bytes(args: ModelArgs, state_dtype: str) -> float:
    """fp32 momentum (4 bytes) for Muon's matrices; AdamW's moments in `state_dtype` for the rest."""
    matrices = muon_params(args)
    return 4.0 * matrices + MOMENT_BYTES[state_dtype] * (count_params(args)[0] - matrices)


NS_TEMP_BYTES = 6.0
"""Newton–Schulz's bf16 temporaries per element of the batch it iterates: the stacked input, the normalised
and the next iterate, the small Gram matrix and its polynomial (optim/orthogonalize.py newton_schulz)."""
NS_BATCH_ELEMENTS = 2**28
"""The most elements Newton–Schulz iterates in one batched call (optim/orthogonalize.py reads it): same-shape
pieces beyond it go in several calls. 2^28 bf16 elements and their temporaries are about 3 GiB; batched whole,
8b's 64 feed-forward matrices of 14,336 × 4,096 took 22 GiB on one GPU."""


def muon_step_bytes(args: ModelArgs, shard: int) -> float:
    """One rank's transient memory in Muon's step, the largest of its three phases (optim/orthogonalize.py):
    its rows of U out and every rank's rows of the matrices it owns in (bf16, 2 + 2 bytes an element); the
    owned matrices whole, U kept while Newton–Schulz makes each O (2 + 2 bytes), with the temporaries of the
    largest batch it iterates (the pieces of one shape, about 1/shard of them); each O's rows out and its own
    rows back (2 + 2). It owns about 1/shard of the matrices, balanced by Newton–Schulz FLOPs; on one rank,
    all of them and nothing moves. Counted from the code, not yet measured on a GPU."""
    share = muon_params(args) / shard  # the rows it holds, and about the matrices it owns
    by_shape: dict[tuple[int, int], int] = {}
    for rows, cols in block_matrix_pieces(args):
        by_shape[(rows, cols)] = by_shape.get((rows, cols), 0) + args.n_layers
    batch = max(min(-(-count // shard), max(1, NS_BATCH_ELEMENTS // (rows * cols))) * rows * cols
                for (rows, cols), count in by_shape.items())
    return max(4.0 * share, 4.0 * share + NS_TEMP_BYTES * batch)


OPTIMIZERS: dict[str, OptimizerFacts] = {
    "adamw": OptimizerFacts(
        keys=ADAMW_KEYS, state_dtypes=("fp32", "bf16", "8bit"),
        state_bytes=lambda args, dtype: MOMENT_BYTES[dtype] * count_params(args)[0],
        describe=lambda dtype: f"AdamW, {dtype} moments"),
    "muon": OptimizerFacts(
        keys=(*ADAMW_KEYS, "momentum", "nesterov", "ns_steps", "ns_coefficients", "adjust_lr"),
        state_dtypes=("fp32", "bf16"),
        state_bytes=muon_state_bytes, step_bytes=muon_step_bytes,
        describe=lambda dtype: f"Muon's fp32 momentum, AdamW's {dtype} moments for the rest",
        state_dtype_refusal="its AdamW parameters take fp32 or bf16 moments (torchao's 8-bit AdamW is an optimizer "
                            "of its own; Muon's momentum stays fp32)",
        host_step="Muon's Newton–Schulz iterations (bf16 matmuls over every block matrix) would run on the host's "
                  "CPU"),
}
"""Each optimizer.name's facts; its builder is optim/__init__.py's OPTIMIZER_BUILDERS entry of the same name."""

DEFAULT = Optimizer().name
"""optimizer.name when a config does not say."""
UNRECORDED = "adamw"
"""The optimizer of a checkpoint that records none: saved before optimizer.name existed, by AdamW."""
