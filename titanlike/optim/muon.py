"""Muon for the blocks' matrices, AdamW for the rest, as one torch optimizer that runs under FSDP2.

The API (what the trainer, the config, the checkpoint and the planner use):

    optimizer = build(model, cfg.optimizer, device_type, host_params)   # optim.build_optimizer, optimizer.name = muon
    groups = transformer_param_groups(model, weight_decay)     # or param_groups(named_params, ...)
    optimizer = Muon(groups, lr=..., weight_decay=..., betas=..., eps=..., fused=..., state_dtype=...)
    optimizer.step()                                          # after clipping, like any optimizer
    optimizer.update_rms()                                    # at log steps: {"muon": t, "adamw": t}

- `Muon` is a torch.optim.Optimizer: LambdaLR schedules every group's "lr", DCP's get/set_optimizer_state_dict
  save and reshard its state, step hooks (float8's) run after its step. Each param group has a "kind":
  "muon" (2-D matrices) or "adamw" (everything else). Keyword arguments are the defaults of the groups of
  their kind; a group may set its own (e.g. "lr" for a Muon learning rate of its own).
- Groups from `param_groups` / `transformer_param_groups`, in this order: AdamW with weight decay (the
  embeddings and the output layer: >= 2-D, as build_optimizer), AdamW without (norm gains, < 2-D), Muon
  (the blocks' attention.wqkv, attention.wo, feed_forward.w1/w2/w3 weights), then one Muon group per
  stacked layout with its "row_splits" (wqkv: ModelArgs.qkv_widths). param_groups[0] is AdamW's, as before.
- State, made in the constructor (before the first step, beside the weights: optim/adamw.py's
  allocate_state says why): Muon, state["momentum_buffer"], fp32, a DTensor sharded like its parameter
  (4 bytes a parameter); AdamW, torch.optim.AdamW's own ("step", "exp_avg", "exp_avg_sq": 8 bytes a
  parameter; with state_dtype = bf16 the moments in bf16, 4 bytes). Both reshard on load like any DTensor
  state.

The AdamW groups are torch.optim.AdamW: its functional form (torch.optim.adamw.adamw), fused on CUDA and
foreach on the CPU unless `fused` says otherwise, decoupled weight decay; with state_dtype = bf16,
adamw_bf16.py's update (fp32 arithmetic, bf16 moments), as optimizer.state_dtype = bf16 gives AdamW alone.

A Muon matrix W with gradient G (momentum mu, learning rate lr, weight decay wd):
    B <- mu·B + G;  U = G + mu·B (Nesterov, the default) or B
    O = NewtonSchulz(U): bf16, divided by its Frobenius norm, 5 odd-quintic steps (orthogonalize.py),
        each with Polar Express's own (a, b, c) for that step or the quintic's one (ns_coefficients)
    W <- W·(1 - lr·wd) - lr·scale·O
torch.optim.Muon keeps B as a mean ((1 - mu)·G added); that is (1 - mu) times this B, the same O after the
norm, to bf16 rounding. The lr rule (adjust_lr): "match_rms_adamw", scale = 0.2·sqrt(max(rows, cols)),
makes the update's RMS about AdamW's, so AdamW's lr and weight decay carry over; "original",
sqrt(max(1, rows/cols)), wants a larger lr of its own. A stacked matrix (row_splits) is orthogonalised
part by part (wqkv as q, k and v), each part scaled by its own rows: the same update as separate
matrices.

Sharded (FSDP2, orthogonalize.py): parameters, gradients and momentum are DTensors sharded on rows over
the mesh's shard dimension (HSDP: replicated over the other; each replica repeats the work in its own
shard group). Newton–Schulz needs whole matrices, so each matrix has an owner rank in its shard group
(balanced by Newton–Schulz FLOPs): one all_to_all_single sends every rank's bf16 rows of U to the owners,
the owners orthogonalise (same shapes batched), one all_to_all_single brings each rank its rows of O. The
rest of the step is elementwise on each rank's own rows. One rank, or plain tensors: no collective.
Transient memory of a step, in bf16: 2 bytes per element of the rank's shard of the matrices going out
and 2 coming back, about 4 bytes per element of the matrices it owns (about 1/N of them), and Newton–
Schulz's temporaries of its largest batch (about 6 bytes per element). No fp32 copy of U is made.

Calls: `step()` and `update_rms()` are collective when sharded (every rank, the same calls); the learning
rate is a float (what LambdaLR writes); `update_rms()` costs one all-reduce of two numbers and, for
AdamW, a pass over its moments, so call it at log steps only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.optim.adamw import adamw

if TYPE_CHECKING:
    from titanlike.config.optimizer import Optimizer as OptimizerConfig

from titanlike.optim.adamw_bf16 import load_state_keeping_dtypes, step_group
from titanlike.optim.orthogonalize import (
    ADJUST_LR,
    NS_EPS,
    NS_POLYNOMIALS,
    NS_STEPS,
    Coefficients,
    Matrix,
    ShardGroup,
    assign_owners,
    ns_schedule,
    orthogonalize_local,
    orthogonalize_sharded,
    piece_bounds,
    row_ranges,
    shard_group,
)

MUON, ADAMW = "muon", "adamw"
BLOCK_MATRICES = ("attention.wqkv.weight", "attention.wo.weight", "feed_forward.w1.weight",
                  "feed_forward.w2.weight", "feed_forward.w3.weight")
"""The matrices Muon updates, by the end of their names under `layers.<i>.` (model/decoder.py)."""


def is_block_matrix(name: str) -> bool:
    """Whether `name` is a block's attention or feed-forward weight (Muon's), not an embedding, the output
    layer or a norm gain (AdamW's)."""
    return "layers" in name.split(".") and name.endswith(BLOCK_MATRICES)


def param_groups(named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float,
                 row_splits: Mapping[str, Sequence[int]] | None = None) -> list[dict[str, Any]]:
    """Muon's and AdamW's groups of the trainable parameters, by name (`is_block_matrix`). `row_splits`:
    for a name ending in a key, the row widths of the matrices stacked in it (each orthogonalised on its
    own). Empty groups are left out."""
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    matrices: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if is_block_matrix(name):
            if p.ndim != 2:
                raise ValueError(f"{name} has shape {tuple(p.shape)}: Muon updates 2-D matrices only")
            splits = next((tuple(w) for end, w in (row_splits or {}).items() if name.endswith(end)), ())
            piece_bounds(p.shape[0], splits)  # refuses splits that do not cover the rows
            matrices.setdefault(splits, []).append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:  # norm gains: shrinking them toward zero only fights the norm
            no_decay.append(p)
    groups: list[dict[str, Any]] = [{"kind": ADAMW, "params": decay, "weight_decay": weight_decay},
                                    {"kind": ADAMW, "params": no_decay, "weight_decay": 0.0}]
    for splits, params in sorted(matrices.items()):  # () first: the unstacked matrices
        groups.append({"kind": MUON, "params": params, "weight_decay": weight_decay, "row_splits": list(splits)})
    return [g for g in groups if g["params"]]


def transformer_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """`param_groups` of a model/decoder.py Transformer: wqkv orthogonalised as q, k and v."""
    widths: list[int] = cast(Any, model).args.qkv_widths
    return param_groups(model.named_parameters(), weight_decay, {"attention.wqkv.weight": widths})


def build(model: nn.Module, section: OptimizerConfig, device_type: str, host_params: bool) -> Muon:
    """optimizer.name = muon (optim.build_optimizer's arguments): Muon for a Transformer's block matrices, AdamW
    for the rest (transformer_param_groups), every setting from the [optimizer] section."""
    if host_params:  # the config refuses it (config/optimizer.py: OPTIMIZERS["muon"].host_step)
        raise ValueError("Muon steps where the model computes: not with parallel.cpu_offload")
    return Muon(transformer_param_groups(model, section.weight_decay), lr=section.lr,
                weight_decay=section.weight_decay, momentum=section.momentum, nesterov=section.nesterov,
                ns_coefficients=section.ns_coefficients, ns_steps=section.ns_steps, adjust_lr=section.adjust_lr,
                betas=(section.betas[0], section.betas[1]),
                eps=section.eps, fused=device_type == "cuda", state_dtype=section.state_dtype)


def _schedule(group: dict[str, Any]) -> Coefficients:
    """A Muon group's Newton–Schulz coefficients, step by step: by name (NS_POLYNOMIALS) or its one (a, b, c)."""
    value = group["ns_coefficients"]
    if isinstance(value, str):
        return ns_schedule(value, group["ns_steps"])  # which refuses a name it does not know
    if len(value) != 3:
        raise ValueError(f"ns_coefficients = {value!r}: must be one of {', '.join(NS_POLYNOMIALS)} or (a, b, c)")
    a, b, c = (float(v) for v in value)
    return ((a, b, c),)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a float8 weight wrapper stays wrapped: in-place ops reach its data); a plain
    tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _fp32_zeros_like(p: torch.Tensor) -> torch.Tensor:
    """Zeros shaped and sharded as `p`, fp32 and plain (never the float8 wrapper that zeros_like keeps)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        local = p.to_local()
        zeros = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
        return DTensor.from_local(zeros, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return torch.zeros(p.shape, dtype=torch.float32, device=p.device)


class Muon(torch.optim.Optimizer):
    """Muon for the "muon" groups, AdamW for the "adamw" groups (see the module docstring)."""

    def __init__(self, params: Iterable[dict[str, Any]], lr: float, weight_decay: float = 0.1, *,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: str | tuple[float, float, float] = "polar_express", ns_steps: int = NS_STEPS,
                 ns_eps: float = NS_EPS, adjust_lr: str = "match_rms_adamw",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, fused: bool | None = None,
                 state_dtype: str = "fp32"):
        """`ns_coefficients`: "quintic" (NS_COEFFICIENTS at every step), "polar_express" (each step's own,
        polar_express.py), or one (a, b, c) for every step, as torch.optim.Muon takes it. `fused`: AdamW's
        fused kernel (None: on CUDA; foreach on the CPU). Set it for parameters that live on the host while the
        model computes on a GPU (CPU offload), as build_optimizer does. `state_dtype`: the AdamW groups'
        moments, fp32 (torch's AdamW) or bf16 (adamw_bf16.py's update)."""
        self._kind_defaults: dict[str, dict[str, Any]] = {
            MUON: {"momentum": momentum, "nesterov": nesterov,
                   "ns_coefficients": ns_coefficients if isinstance(ns_coefficients, str) else tuple(ns_coefficients),
                   "ns_steps": ns_steps, "ns_eps": ns_eps, "adjust_lr": adjust_lr, "row_splits": []},
            ADAMW: {"betas": tuple(betas), "eps": eps, "fused": fused, "state_dtype": state_dtype},
        }
        self._shards: dict[torch.Tensor, ShardGroup | None] = {}
        self._owners: dict[int, dict[torch.Tensor, int]] = {}
        # What the last step updated, for update_rms: Muon's sums of squares by shard group and their
        # elements, AdamW's (group, parameter).
        self._last_muon: list[tuple[ShardGroup | None, torch.Tensor]] = []
        self._last_muon_count = 0
        self._last_adamw: list[tuple[dict[str, Any], torch.Tensor]] = []
        super().__init__(list(params), {"lr": lr, "weight_decay": weight_decay})
        self._allocate_state()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        kind = param_group.get("kind")
        if kind not in (MUON, ADAMW):
            raise ValueError(f"a Muon param group needs 'kind': {MUON!r} or {ADAMW!r}, not {kind!r}")
        for key, value in self._kind_defaults[kind].items():
            param_group.setdefault(key, value)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if kind == ADAMW:
            if group["state_dtype"] not in ("fp32", "bf16"):
                raise ValueError(f"an AdamW group's state_dtype = {group['state_dtype']!r}: must be fp32 or bf16")
            if group["state_dtype"] == "bf16":  # adamw_bf16's own update: neither fused nor foreach
                group["fused"] = group["foreach"] = False
                return
            if group["fused"] is None:
                group["fused"] = any(p.device.type == "cuda" for p in group["params"])
            group["foreach"] = not group["fused"]
            return
        if group["adjust_lr"] not in ADJUST_LR:
            raise ValueError(f"adjust_lr = {group['adjust_lr']!r}: must be one of {', '.join(ADJUST_LR)}")
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"momentum = {group['momentum']}: must be in [0, 1)")
        if not 1 <= group["ns_steps"] < 100:
            raise ValueError(f"ns_steps = {group['ns_steps']}: must be in 1..99")
        _schedule(group)  # a polynomial it does not know is refused here, not at the first step
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(f"a Muon group holds a parameter of shape {tuple(p.shape)}: only 2-D matrices")
            piece_bounds(p.shape[0], tuple(group["row_splits"]))
            self._shards[p] = shard_group(p)
        self._owners.clear()

    def _allocate_state(self) -> None:
        """Every parameter's state as its first step would make it (zeros, AdamW's step count 0)."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if state:
                    continue
                if group["kind"] == MUON:
                    state["momentum_buffer"] = _fp32_zeros_like(p)
                    continue
                if group["state_dtype"] == "bf16":  # as AdamWBf16Moments makes them
                    state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    continue
                # AdamW's own (torch.optim.Adam._init_group): the step count on the device for the fused
                # kernel, on the host for foreach.
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if group["fused"]
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each state tensor in its saved dtype: fp32 momentum, bf16 AdamW moments (torch's would cast them all
        to the parameters' fp32)."""
        load_state_keeping_dtypes(self, state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._allocate_state()  # a group added since
        self._adamw_step()
        self._muon_step()
        return loss

    def _adamw_step(self) -> None:
        self._last_adamw = []
        for group in self.param_groups:
            if group["kind"] != ADAMW:
                continue
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            self._last_adamw += [(group, p) for p in params]
            if group["state_dtype"] == "bf16":
                step_group(group, self.state)
                continue
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adamw(
                params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [], [s["step"] for s in states], foreach=group["foreach"], fused=group["fused"], amsgrad=False,
                beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=False)

    def _muon_step(self) -> None:
        # Momentum on each rank's own rows (U is made where it is sent: Matrix.write_update).
        entries: list[tuple[dict[str, Any], torch.Tensor, Matrix]] = []
        for group in self.param_groups:
            if group["kind"] != MUON:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, buf = _local(p.grad), _local(self.state[p]["momentum_buffer"])
                torch.add(grad, buf, alpha=group["momentum"], out=buf)  # B <- mu·B + G, one kernel
                entries.append((group, p, self._matrix(group, p, grad, buf)))
        # Newton–Schulz: each shard group's matrices through their owners, the others here.
        domains: dict[int, list[int]] = {}
        for k, (_, p, _) in enumerate(entries):
            shards = self._shards[p]
            domains.setdefault(0 if shards is None else id(shards.group), []).append(k)
        self._last_muon = []
        for key, members in domains.items():
            matrices = [entries[k][2] for k in members]
            shards = self._shards[entries[members[0]][1]]
            if shards is None:
                outs, square_sum = orthogonalize_local(matrices)
                starts = [0] * len(members)
            else:
                owners = self._owner_map(key, shards)
                outs, square_sum = orthogonalize_sharded(matrices, shards, [owners[entries[k][1]] for k in members])
                starts = [row_ranges(m.rows, shards.size)[shards.rank][0] for m in matrices]
            self._last_muon.append((shards, square_sum))
            self._apply([entries[k] for k in members], outs, starts)
        self._last_muon_count = sum(m.rows * m.cols for _, _, m in entries)

    def _owner_map(self, key: int, shards: ShardGroup) -> dict[torch.Tensor, int]:
        """Owners of every Muon matrix of one shard group, from all of them (with a gradient this step or
        not), so that they stay put from step to step."""
        if key not in self._owners:
            params = [(g, p) for g in self.param_groups if g["kind"] == MUON for p in g["params"]
                      if id(getattr(self._shards[p], "group", None)) == key]
            costs = []
            for g, p in params:
                m = self._matrix(g, p, p, p)
                costs.append((m.cost(), m.rows * m.cols))
            self._owners[key] = dict(zip([p for _, p in params], assign_owners(costs, shards.size)))
        return self._owners[key]

    @staticmethod
    def _matrix(group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor) -> Matrix:
        rows, cols = p.shape
        return Matrix(grad, momentum, group["momentum"] if group["nesterov"] else None, rows, cols,
                      tuple(piece_bounds(rows, tuple(group["row_splits"]))),
                      (_schedule(group), group["ns_steps"], group["ns_eps"]), group["adjust_lr"])

    @staticmethod
    def _apply(entries: list[tuple[dict[str, Any], torch.Tensor, Matrix]], outs: list[torch.Tensor],
               starts: list[int]) -> None:
        """W <- W·(1 - lr·wd) - lr·scale·O on each rank's rows (O: this rank's rows, unscaled bf16; each piece
        of a stacked matrix takes its own scale)."""
        for (group, p, m), out, start in zip(entries, outs, starts):
            local, lr = _local(p), float(group["lr"])
            if group["weight_decay"]:
                local.mul_(1 - lr * group["weight_decay"])
            end = start + local.shape[0]
            for (a, b), scale in zip(m.pieces, m.scales()):
                a, b = max(a, start), min(b, end)
                if a < b:
                    local[a - start:b - start].add_(out[a - start:b - start], alpha=-lr * scale)

    # ---- the update's size, for the log ---------------------------------------------------------------

    def update_rms(self) -> dict[str, torch.Tensor]:
        """The RMS, over all parameters of a kind, of the last step's update per unit of learning rate
        (weight decay aside): "muon", scale·O; "adamw", its normalised moment m̂/(sqrt(v̂) + eps).
        adjust_lr = match_rms_adamw puts Muon's near 0.2 for full-rank updates (Moonshot measured AdamW's at
        0.2 to 0.4). Device tensors (no host sync); a kind that did not step is left out. Sharded, one
        all-reduce over the shard group: every rank calls it, at the same steps."""
        parts = [(shards, 0, square_sum) for shards, square_sum in self._last_muon]
        parts += [(self._shard_of(p), 1, self._adamw_square_sum(g, self.state[p])) for g, p in self._last_adamw]
        counts = [self._last_muon_count, sum(p.numel() for _, p in self._last_adamw)]
        sums: dict[int, tuple[ShardGroup | None, torch.Tensor]] = {}  # by shard group, 0: this rank's whole
        for shards, kind, value in parts:
            key = 0 if shards is None else id(shards.group)
            if key not in sums:
                sums[key] = (shards, torch.zeros(2, dtype=torch.float32, device=value.device))
            sums[key][1][kind] += value.to(sums[key][1].device)
        totals = []
        for shards, values in sums.values():
            if shards is not None:  # each rank holds its rows (AdamW) or its owned matrices (Muon)
                torch.distributed.all_reduce(values, group=shards.group)
            totals.append(values.to(parts[0][2].device))
        if not totals:
            return {}
        total = torch.stack(totals).sum(0)
        return {kind: (total[i] / counts[i]).sqrt() for i, kind in enumerate((MUON, ADAMW)) if counts[i]}

    def _shard_of(self, p: torch.Tensor) -> ShardGroup | None:
        if p not in self._shards:
            self._shards[p] = shard_group(p)
        return self._shards[p]

    @staticmethod
    def _adamw_square_sum(group: dict[str, Any], state: dict[str, Any]) -> torch.Tensor:
        """Sum over this rank's elements of AdamW's last update direction squared, from its state after the
        step (the update is lr times it), 16M elements at a time so the temporaries stay small."""
        beta1, beta2 = group["betas"]
        step = state["step"]
        correction1 = 1 - beta1 ** step
        correction2 = (1 - beta2 ** step).sqrt()
        m, v = _local(state["exp_avg"]).reshape(-1), _local(state["exp_avg_sq"]).reshape(-1)
        total = torch.zeros((), dtype=torch.float32, device=m.device)
        for mc, vc in zip(m.split(1 << 24), v.split(1 << 24)):
            direction = (mc.float() / correction1) / (vc.float().sqrt() / correction2 + group["eps"])
            total += direction.square().sum()
        return total
