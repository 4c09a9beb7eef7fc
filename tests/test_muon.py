"""Muon (titanlike/optim/muon.py): torch.optim.Muon's update and torch.optim.AdamW's in one optimizer; a
stacked wqkv updated as q, k and v; under FSDP2 over gloo (uneven row shards, HSDP) the same parameters
as one process, through the checkpoint and with float8 weight wrappers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import spawn_ranks
from titanlike.model.decoder import Transformer
from titanlike.model.shape import ModelArgs
from titanlike.optim.muon import ADAMW, MUON, Muon, param_groups, transformer_param_groups
from titanlike.optim.orthogonalize import NS_COEFFICIENTS, assign_owners, row_ranges

LR, WD = 0.02, 0.1


def _params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _set_grads(model: nn.Module, step: int) -> None:
    """The same whole gradients on every rank and in the one-process model; each rank keeps its shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p, g in zip(model.parameters(), _grads(list(model.parameters()), step)):
        if isinstance(p, DTensor):
            g = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = g


def _whole(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


# ---- one process ----------------------------------------------------------------------------------------

MATRICES = [(64, 32), (32, 64), (48, 48), (40, 24)]  # tall (iterated transposed), wide, square, tall


@pytest.mark.parametrize("rule", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("momentum", [0.0, 0.95])
def test_muon_groups_are_torch_muon(rule, momentum):
    """Without momentum Newton–Schulz sees the very numbers torch.optim.Muon's does: the same update, to
    fp32 rounding. With momentum our buffer is 1/(1 - mu) times torch's mean, which the norm divides out
    but bf16 rounds otherwise: within bf16's few per cent, step after step (a wrong scale, momentum or
    Nesterov term is off by far more: 15 % for a scale from another matrix's rows)."""
    ours, theirs = _params(MATRICES), _params(MATRICES)
    opt = Muon([{"kind": MUON, "params": ours}], lr=LR, weight_decay=WD, momentum=momentum, adjust_lr=rule,
               ns_coefficients="quintic")
    ref = torch.optim.Muon(theirs, lr=LR, weight_decay=WD, momentum=momentum, nesterov=True, adjust_lr_fn=rule)
    for step in range(4):
        before = [p.detach().clone() for p in ours]
        for a, b, g in zip(ours, theirs, _grads(ours, step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for a, b, w in zip(ours, theirs, before):
            if momentum == 0.0:
                torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
            else:
                assert _relative(a.detach() - w, b.detach() - w) < 0.04, (rule, step, tuple(a.shape))
        with torch.no_grad():  # the next step from the same weights
            for a, b in zip(ours, theirs):
                b.copy_(a)


def test_adamw_groups_are_torch_adamw():
    """The AdamW groups (decay and no decay) step as torch.optim.AdamW, bit for bit, over several steps."""
    shapes = [(16, 8), (8,), (5, 3, 2)]
    ours, theirs = _params(shapes), _params(shapes)
    opt = Muon([{"kind": ADAMW, "params": ours[::2], "weight_decay": WD},
                {"kind": ADAMW, "params": ours[1:2], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW([{"params": theirs[::2], "weight_decay": WD}, {"params": theirs[1:2], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    for step in range(5):
        for a, b, g in zip(ours, theirs, _grads(ours, step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert all(torch.equal(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"]) for a, b in zip(ours, theirs))


def test_a_stacked_matrix_is_updated_as_its_parts():
    """wqkv's rows as q, k and v (row_splits): each part orthogonalised and scaled on its own, exactly the
    update of three separate matrices; beside a matrix of k's shape, which Newton–Schulz batches with k and v."""
    widths = [32, 16, 16]
    stacked, beside = _params([(64, 24), (16, 24)])
    parts = [nn.Parameter(t.clone()) for t in stacked.detach().split(widths)]
    other = nn.Parameter(beside.detach().clone())
    opt = Muon([{"kind": MUON, "params": [beside]}, {"kind": MUON, "params": [stacked], "row_splits": widths}],
               lr=LR, weight_decay=WD)
    ref = Muon([{"kind": MUON, "params": [other, *parts]}], lr=LR, weight_decay=WD)
    for step in range(3):
        g, h = _grads([stacked, beside], step)
        stacked.grad, beside.grad, other.grad = g, h, h.clone()
        for p, gp in zip(parts, g.split(widths)):
            p.grad = gp.clone()
        opt.step()
        ref.step()
        assert torch.equal(stacked, torch.cat([p.detach() for p in parts])) and torch.equal(beside, other)


def test_transformer_groups_by_name():
    """Blocks' attention and feed-forward weights are Muon's (wqkv split as ModelArgs.qkv_widths); the
    embedding and output layer AdamW's with weight decay, the norm gains AdamW's without."""
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, qk_norm=True)
    model = Transformer(args)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = transformer_param_groups(model, WD)
    seen = [(g["kind"], g["weight_decay"], g.get("row_splits"), sorted(names[id(p)] for p in g["params"]))
            for g in groups]
    blocks = [f"layers.{i}.{m}.weight" for i in range(2) for m in ("attention.wo", "feed_forward.w1",
                                                                    "feed_forward.w2", "feed_forward.w3")]
    norms = [n for n in names.values() if n.endswith("norm.weight")]
    assert seen == [(ADAMW, WD, None, ["output.weight", "tok_embeddings.weight"]),
                    (ADAMW, 0.0, None, sorted(norms)),
                    (MUON, WD, [], sorted(blocks)),
                    (MUON, WD, [32, 16, 16], [f"layers.{i}.attention.wqkv.weight" for i in range(2)])]
    with pytest.raises(ValueError, match="add up"):
        param_groups(model.named_parameters(), WD, {"attention.wqkv.weight": [32, 16]})


def test_update_rms_is_the_rms_of_the_step_per_unit_of_lr():
    """update_rms: per kind, the RMS of what the step moved the weights by (weight decay aside) over lr."""
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64))
    model.init_weights(0, 16)
    opt = Muon(transformer_param_groups(model, WD), lr=LR, weight_decay=WD)
    assert opt.update_rms() == {}
    for step in range(2):
        before = {p: p.detach().clone() for p in model.parameters()}
        _set_grads(model, step)
        opt.step()
        rms = opt.update_rms()
        for group in opt.param_groups:
            group_moves = [(before[p] * (1 - LR * group["weight_decay"]) - p.detach()) / LR for p in group["params"]]
            group["moves"] = torch.cat([m.reshape(-1) for m in group_moves])
        for kind in (MUON, ADAMW):
            moves = torch.cat([g.pop("moves") for g in opt.param_groups if g["kind"] == kind])
            torch.testing.assert_close(rms[kind], moves.square().mean().sqrt(), rtol=2e-3, atol=0)


def test_the_schedule_sets_the_lr_of_every_group():
    """LambdaLR (build_scheduler) schedules Muon's groups as AdamW's: in warmup the first update is that of
    an optimizer made with the first update's lr."""
    from titanlike.config.schema import LRScheduler
    from titanlike.optim import build_scheduler

    args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64)
    scheduled, fixed = Transformer(args), Transformer(args)
    scheduled.init_weights(0, 16)
    fixed.init_weights(0, 16)
    opt = Muon(transformer_param_groups(scheduled, WD), lr=LR, weight_decay=WD)
    build_scheduler(opt, LRScheduler(warmup_steps=4, decay_ratio=0.0, decay_type="linear", min_lr_factor=0.0),
                    total_steps=10)
    ref = Muon(transformer_param_groups(fixed, WD), lr=LR / 5, weight_decay=WD)  # warmup: 1 / (4 + 1)
    for model, optimizer in ((scheduled, opt), (fixed, ref)):
        _set_grads(model, 0)
        optimizer.step()
    for p, q in zip(scheduled.parameters(), fixed.parameters()):
        assert torch.equal(p, q)


def test_newton_schulz_in_capped_batches_gives_the_whole_batchs_result(monkeypatch):
    """Same-shape pieces go through Newton–Schulz at most NS_BATCH_ELEMENTS elements a call (the memory of
    its temporaries): a cap of one matrix a call gives what one call for all of them gives."""
    from titanlike.optim import orthogonalize

    torch.manual_seed(0)
    grads = [torch.randn(24, 16) for _ in range(5)]
    made = [orthogonalize.Matrix(g, torch.zeros_like(g), None, 24, 16, ((0, 8), (8, 24)), ((NS_COEFFICIENTS,), 5, 1e-7),
                                 "match_rms_adamw") for g in grads]
    for m, g in zip(made, grads):
        m.momentum.copy_(g)
    whole, whole_rms = orthogonalize.orthogonalize_local(made)
    monkeypatch.setattr(orthogonalize, "NS_BATCH_ELEMENTS", 16 * 16)  # one 16 x 16 piece a call
    capped, capped_rms = orthogonalize.orthogonalize_local(made)
    assert all(torch.equal(a, b) for a, b in zip(whole, capped))
    assert torch.allclose(whole_rms, capped_rms, rtol=1e-6)  # the same squares, summed in another order


def test_polar_express_is_the_closest_quintic_each_step_and_ends_closer_to_orthogonal():
    """optimizer.ns_coefficients = polar_express: each step's polynomial is the odd quintic closest to 1 over
    its interval (its error reaches its largest value, alternating in sign, at four points: Chebyshev's
    condition for the best one); composed over five steps it leaves singular values in [1e-3, 1] within
    0.14 of 1, the quintic within 0.53; longer tables end at Newton–Schulz's classic quintic; and in bf16
    on matrices whose normalised singular values span two decades, Newton–Schulz with it ends within 0.14
    of orthogonal where the quintic's is 0.3 off."""
    import numpy as np

    from titanlike.optim.orthogonalize import newton_schulz, ns_schedule
    from titanlike.optim.polar_express import closest_quintic, composed_error, polar_express

    for lo in (0.025, 0.2, 0.8):
        a, b, c = closest_quintic(lo, 1.0)
        x = np.linspace(lo, 1.0, 200001)
        error = 1 - (a * x + b * x**3 + c * x**5)
        peak = np.abs(error).max()
        turns = [lo, *np.sort(np.sqrt(np.roots([5 * c, 3 * b, a]).real)), 1.0]
        at = 1 - np.array([a * t + b * t**3 + c * t**5 for t in turns])
        assert np.allclose(np.abs(at), peak, rtol=1e-9) and np.all(np.sign(at) == [1, -1, 1, -1]), (lo, at, peak)
    table = polar_express(5)
    assert len(table) == 5 and len(set(table)) == 5
    assert composed_error(table) < 0.14 and composed_error((NS_COEFFICIENTS,) * 5) > 0.5
    assert polar_express(3) != table[:3]  # derived for the number of steps asked
    # Once the interval has closed on 1, the best quintic is the classic one that fixes 1 to fifth order,
    # (15/8, -10/8, 3/8): the derivation holds up to optimizer.ns_steps' 99.
    assert np.allclose(polar_express(99)[-1], (1.875, -1.25, 0.375), atol=1e-5)

    gen = torch.Generator().manual_seed(0)
    for shape in ((4, 64, 64), (4, 48, 96), (4, 96, 48)):
        u, _, vh = torch.linalg.svd(torch.randn(shape, generator=gen), full_matrices=False)
        spread = torch.logspace(0, -2, min(shape[1:]))
        update = u @ torch.diag_embed(spread.expand(shape[0], -1)) @ vh
        off = {name: (torch.linalg.svdvals(newton_schulz(update, ns_schedule(name, 5)).float()) - 1).abs().max()
               for name in ("quintic", "polar_express")}
        assert off["polar_express"] < 0.14 and off["quintic"] > 0.3, (shape, off)

    # Muon's step takes it by name: W(1 - lr·wd) - lr·0.2·sqrt(max(rows, cols))·O, O Polar Express's.
    ours = _params(MATRICES)
    before = [p.detach().clone() for p in ours]
    opt = Muon([{"kind": MUON, "params": ours}], lr=LR, weight_decay=WD, momentum=0.0, ns_coefficients="polar_express")
    for p, g in zip(ours, _grads(ours, 0)):
        p.grad = g
    opt.step()
    for p, w in zip(ours, before):
        o = newton_schulz(p.grad[None], polar_express(5))[0].float()
        expected = w * (1 - LR * WD) - LR * 0.2 * max(p.shape) ** 0.5 * o
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="ns_coefficients = 'cubic': must be one of quintic, polar_express"):
        Muon([{"kind": MUON, "params": ours}], lr=LR, ns_coefficients="cubic")


def test_owners_balance_and_rows_follow_fsdp():
    """Owners: the same list on every call, the costliest spread first; rows: torch.chunk's cut (the last
    ranks fewer or none), which the sharded step checks against each local shard."""
    costs = [(100, 1)] * 5 + [(10, 1)] * 10
    owners = assign_owners(costs, 4)
    assert owners == assign_owners(costs, 4)
    loads = [sum(c for (c, _), o in zip(costs, owners) if o == r) for r in range(4)]
    assert max(loads) - min(loads) <= 100 and sorted(owners[:5]) == [0, 0, 1, 2, 3]
    assert row_ranges(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [len(c) for c in torch.arange(37).chunk(2)] == [b - a for a, b in row_ranges(37, 2)]


# ---- the seam: the [optimizer] section, the registry, bf16 moments -----------------------------------------

def test_the_optimizer_section_builds_its_optimizer_through_the_registry():
    """build_optimizer(model, cfg.optimizer, ...): optimizer.name = muon gives Muon with every key of the section
    on the groups of its kind (the AdamW groups keep AdamW's); adamw gives torch's AdamW. The registry and the
    config's table of facts hold the same names, which are the ones optimizer.name takes."""
    import typing

    from titanlike.config import load_config
    from titanlike.config.optimizer import OPTIMIZERS, Optimizer
    from titanlike.optim import OPTIMIZER_BUILDERS, build_optimizer

    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64))
    cfg = load_config(["--optimizer.name", "muon", "--optimizer.lr", "0.01", "--optimizer.momentum", "0.9",
                       "--optimizer.nesterov", "false", "--optimizer.ns_steps", "3",
                       "--optimizer.ns_coefficients", "polar_express", "--optimizer.adjust_lr",
                       "original", "--optimizer.betas", "0.8,0.9", "--optimizer.eps", "1e-6",
                       "--optimizer.weight_decay", "0.05"])
    opt = build_optimizer(model, cfg.optimizer, "cpu")
    assert isinstance(opt, Muon)
    kinds = {g["kind"] for g in opt.param_groups}
    assert kinds == {MUON, ADAMW}
    for g in opt.param_groups:
        assert g["lr"] == 0.01
        if g["kind"] == MUON:
            assert (g["momentum"], g["nesterov"], g["ns_steps"], g["adjust_lr"], g["weight_decay"]) == (
                0.9, False, 3, "original", 0.05)
            assert g["ns_coefficients"] == "polar_express"
        else:
            assert g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 and g["weight_decay"] in (0.05, 0.0)
    assert type(build_optimizer(model, Optimizer(), "cpu")) is torch.optim.AdamW
    assert set(OPTIMIZER_BUILDERS) == set(OPTIMIZERS) == set(typing.get_args(typing.get_type_hints(Optimizer)["name"]))


def test_bf16_moments_take_muons_adamw_groups():
    """optimizer.state_dtype = bf16 with Muon: its AdamW groups step as AdamWBf16Moments does, bit for bit, their
    moments in bf16; Muon's momentum stays fp32. A state_dict round trip (what DCP's load calls) keeps each dtype
    and value: torch's load would make the moments fp32."""
    from titanlike.optim.adamw_bf16 import AdamWBf16Moments

    shapes = [(16, 8), (8,), (24, 16)]
    ours, theirs = _params(shapes), _params(shapes)
    opt = Muon([{"kind": ADAMW, "params": ours[:1], "weight_decay": WD},
                {"kind": ADAMW, "params": ours[1:2], "weight_decay": 0.0},
                {"kind": MUON, "params": ours[2:]}], lr=1e-2, weight_decay=WD, state_dtype="bf16")
    ref = AdamWBf16Moments([{"params": theirs[:1], "weight_decay": WD}, {"params": theirs[1:2], "weight_decay": 0.0}],
                           lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(4):
        for a, b, g in zip(ours, theirs, _grads(ours, step)):
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours[:2], theirs[:2]):
        assert torch.equal(a, b)
        assert opt.state[a]["exp_avg"].dtype == torch.bfloat16 and torch.equal(opt.state[a]["exp_avg_sq"],
                                                                                 ref.state[b]["exp_avg_sq"])
    assert opt.state[ours[2]]["momentum_buffer"].dtype == torch.float32
    again = Muon([{"kind": ADAMW, "params": ours[:1], "weight_decay": WD},
                  {"kind": ADAMW, "params": ours[1:2], "weight_decay": 0.0},
                  {"kind": MUON, "params": ours[2:]}], lr=1e-2, weight_decay=WD, state_dtype="bf16")
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in ours:
        for key, value in opt.state[p].items():
            assert again.state[p][key].dtype == value.dtype and torch.equal(again.state[p][key], value), key


# ---- FSDP2 over gloo ---------------------------------------------------------------------------------------

def _tiny(ffn_dim: int) -> ModelArgs:
    # wqkv (64 × 32) is q, k and v of 32, 16 and 16 rows; w1/w3 have ffn_dim rows: uneven over the ranks
    return ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=ffn_dim, vocab_size=48)


def _sharded_worker(rank: int, world: int, replicate: int, ffn_dim: int) -> None:
    """Muon over FSDP2 (HSDP when replicate > 1) from the same gradients as one process: the same
    parameters after each step, two all_to_all_single a step, the same update RMS."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from titanlike.parallel.fsdp import apply_fsdp

    reference = Transformer(_tiny(ffn_dim))
    reference.init_weights(0, 16)
    model = copy.deepcopy(reference)
    if replicate > 1:
        mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    apply_fsdp(model, mesh, None, "always")
    w1 = model.layers[0].feed_forward.w1.weight
    assert w1.placements[-1] == Shard(0) and len(w1.placements) == mesh.ndim
    rows = [b - a for a, b in row_ranges(ffn_dim, world // replicate)]
    assert len(set(rows)) > 1 and w1.to_local().shape[0] == rows[mesh.get_local_rank(mesh.ndim - 1)]

    opt = Muon(transformer_param_groups(model, WD), lr=LR, weight_decay=WD)
    ref = Muon(transformer_param_groups(reference, WD), lr=LR, weight_decay=WD)
    calls = []
    all_to_all = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(1)
        return all_to_all(*args, **kwargs)

    dist.all_to_all_single = counted  # type: ignore[assignment]
    try:
        for step in range(3):
            _set_grads(model, step)
            _set_grads(reference, step)
            opt.step()
            ref.step()
            assert len(calls) == 2 * (step + 1)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(_whole(p), q.detach(), rtol=1e-6, atol=1e-7, msg=name)
    finally:
        dist.all_to_all_single = all_to_all  # type: ignore[assignment]
    ours, theirs = opt.update_rms(), ref.update_rms()
    assert set(ours) == {MUON, ADAMW}
    for kind in ours:
        torch.testing.assert_close(ours[kind], theirs[kind], rtol=1e-5, atol=0)


def _checkpoint_worker(rank: int, world: int, folder: str) -> None:
    """Two steps, a DCP save through the trainer's states (checkpoint/states.py), two more; then a fresh model
    and optimizer load the save on these ranks and take the last two steps again: the same parameters. Rank
    0 keeps the uninterrupted run's parameters for a one-process resume."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from titanlike.checkpoint.states import ModelState, OptimizerState
    from titanlike.parallel.fsdp import apply_fsdp

    def build(seed: int) -> tuple[Transformer, Muon]:
        model = Transformer(_tiny(37))
        model.init_weights(seed, 16)
        apply_fsdp(model, init_device_mesh("cpu", (world,)), None, "always")
        return model, Muon(transformer_param_groups(model, WD), lr=LR, weight_decay=WD)

    model, opt = build(0)
    for step in range(4):
        if step == 2:
            dcp.save({"model": ModelState(model), "optim": OptimizerState(model, opt)}, checkpoint_id=f"{folder}/ckpt")
        _set_grads(model, step)
        opt.step()
    whole = {n: _whole(p) for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(whole, f"{folder}/uninterrupted.pt")
    resumed, resumed_opt = build(1)  # other weights: the load must replace them
    dcp.load({"model": ModelState(resumed), "optim": OptimizerState(resumed, resumed_opt)},
             checkpoint_id=f"{folder}/ckpt")
    for step in (2, 3):
        _set_grads(resumed, step)
        resumed_opt.step()
    for name, p in resumed.named_parameters():
        assert torch.equal(_whole(p), whole[name]), name


def _two_rank_worker(rank: int, world: int, folder: str) -> None:
    _sharded_worker(rank, world, 1, 37)
    _checkpoint_worker(rank, world, folder)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's, for a one-process load
def test_two_ranks_match_one_process_and_resume_from_their_checkpoint(tmp_path):
    """Two gloo ranks, w1/w3 of 37 rows (19 and 18 a rank): the parameters of one process after each step.
    Their checkpoint (momentum and AdamW's moments, sharded) resumes on two ranks and on one: the parameters
    of the uninterrupted run. One pair of processes for both, to keep the default tier short."""
    import torch.distributed.checkpoint as dcp

    from titanlike.checkpoint.states import ModelState, OptimizerState

    spawn_ranks(_two_rank_worker, 2, str(tmp_path))
    model = Transformer(_tiny(37))
    model.init_weights(1, 16)
    opt = Muon(transformer_param_groups(model, WD), lr=LR, weight_decay=WD)
    dcp.load({"model": ModelState(model), "optim": OptimizerState(model, opt)}, checkpoint_id=str(tmp_path / "ckpt"),
             no_dist=True)
    for step in (2, 3):
        _set_grads(model, step)
        opt.step()
    uninterrupted = torch.load(tmp_path / "uninterrupted.pt")
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), uninterrupted[name], rtol=1e-6, atol=1e-7, msg=name)
    momentum = opt.state[model.layers[0].feed_forward.w1.weight]["momentum_buffer"]
    assert momentum.dtype == torch.float32 and momentum.abs().sum() > 0


@pytest.mark.slow
def test_four_ranks_hsdp_with_empty_shards_match_one_process():
    """2 replicas × 2 shards (HSDP), and 4 shards of w1/w3's 5 rows (2, 2, 1 and none)."""
    spawn_ranks(_sharded_worker, 4, 2, 37)
    spawn_ranks(_sharded_worker, 4, 1, 5)


def _float8_worker(rank: int, world: int) -> None:
    """A model converted by torchao (tensorwise, emulated, float8 all-gather) under FSDP2: its weights are
    torchao's float8 wrappers inside the DTensors. From the same gradients (the first from its own float8
    backward) Muon gives the plain model's parameters, the wrappers stay, and the model still runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from titanlike.parallel.fsdp import apply_fsdp

    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=64)  # float8: 16s
    reference = Transformer(args)
    reference.init_weights(0, 16)
    model = copy.deepcopy(reference)
    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "output")
    apply_fsdp(model, init_device_mesh("cpu", (world,)), None, "always")
    wqkv = model.layers[0].attention.wqkv.weight
    assert isinstance(wqkv.to_local(), WeightWithDynamicFloat8CastTensor)
    opt = Muon(transformer_param_groups(model, WD), lr=LR, weight_decay=WD)
    ref = Muon(transformer_param_groups(reference, WD), lr=LR, weight_decay=WD)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    for step in range(3):
        if step == 0:
            model(tokens).float().pow(2).mean().backward()
            for p, q in zip(model.parameters(), reference.parameters()):
                q.grad = p.grad.full_tensor()
        else:
            _set_grads(model, step)
            _set_grads(reference, step)
        opt.step()
        ref.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(_whole(p), q.detach(), rtol=1e-6, atol=1e-7, msg=name)
    assert isinstance(wqkv.to_local(), WeightWithDynamicFloat8CastTensor)
    assert torch.isfinite(model(tokens)).all()


@pytest.mark.slow
def test_float8_wrapped_weights_take_the_plain_update():
    spawn_ranks(_float8_worker, 2)


def _converter_worker(rank: int, world: int) -> None:
    """titanlike's Float8Converter (tensorwise, emulated, float8 all-gather with precomputed scales) attached to
    Muon: after each step every converted weight's precomputed scale is float8's max over the amax of the
    weight Muon just wrote (its post-step hook ran after the update, not before it)."""
    from torch.distributed.device_mesh import init_device_mesh

    from titanlike import parallel
    from titanlike.config.fp8 import Fp8
    from titanlike.converters import ModelConverters
    from titanlike.float8 import Float8Converter
    from titanlike.model.converter import ConvertArgs
    from titanlike.run.state import TrainState

    class NoMetrics:
        def scalars(self, step, values):
            pass

        def note(self, values):
            pass

    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=64)
    with torch.device("meta"):
        model = Transformer(args)
    converter = Float8Converter.from_config(Fp8(recipe="tensorwise", emulate=True, auto_filter="false"), dp_shard=world)
    converter.convert(model, ConvertArgs(device=torch.device("cpu"), batch=2, seq_len=16))
    parallel.apply_fsdp(model, init_device_mesh("cpu", (world,)), None, "always")
    model.to_empty(device="cpu")
    model.init_weights(seed=0, seq_len=16)
    opt = Muon(transformer_param_groups(model, WD), lr=LR, weight_decay=WD)
    ModelConverters([converter]).attach(opt, counters=TrainState(), metrics=NoMetrics())
    assert converter.options.precompute_scales
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    wrapped = [m.weight for m in model.modules() if hasattr(getattr(m, "weight", None), "_local_tensor")
               and hasattr(m.weight._local_tensor, "_precomputed_scale")]
    assert len(wrapped) == 5, len(wrapped)  # wqkv, wo, w1, w3, w2: every block matrix, each Muon's
    for _ in range(2):
        before = [float(w._local_tensor._precomputed_scale) for w in wrapped]
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for w, old in zip(wrapped, before):
            amax = w._local_tensor._tensor.detach().abs().max().float()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            expected = torch.finfo(torch.float8_e4m3fn).max / amax.double()
            assert float(w._local_tensor._precomputed_scale) == pytest.approx(float(expected), rel=1e-6)
            assert float(w._local_tensor._precomputed_scale) != old  # the step moved the weight's amax


@pytest.mark.slow
def test_float8_converter_precomputes_scales_after_muons_step():
    spawn_ranks(_converter_worker, 2)
