"""optimizer.state_dtype = bf16: AdamW's arithmetic in fp32 with its moments stored in bf16, the same
parameter groups as fp32 AdamW, and a resume that continues the uninterrupted run exactly."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import losses, run_train, train_here
from titanlike.model.decoder import Transformer
from titanlike.model.shape import ModelArgs
from titanlike.optim import build_optimizer, clip_and_step
from titanlike.optim.adamw_bf16 import CHUNK, AdamWBf16Moments, adamw_update_all

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def optimizer(model, state_dtype):
    return build_optimizer(model, lr=3e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, device_type="cpu",
                           state_dtype=state_dtype)


def test_one_update_is_fp32_adamws_with_its_moments_rounded_to_bf16():
    """From zero moments: the weights move as torch's fp32 AdamW moves them (the update uses the unrounded
    moments), and the stored moments are torch's, rounded to bf16; the next update starts from those."""
    torch.manual_seed(0)
    weight, grads = torch.randn(300, 40), [torch.randn(300, 40) for _ in range(2)]
    ours, theirs = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(weight.clone())
    mine = AdamWBf16Moments([{"params": [ours], "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    torch_adamw = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours.grad, theirs.grad = grads[0].clone(), grads[0].clone()
    mine.step()
    torch_adamw.step()
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6)
    for name in ("exp_avg", "exp_avg_sq"):
        stored, exact = mine.state[ours][name], torch_adamw.state[theirs][name]
        assert stored.dtype == torch.bfloat16 and torch.equal(stored, exact.to(torch.bfloat16))
    assert mine.state[ours]["step"].item() == 1.0
    # The second update reads the rounded moments: close to fp32's, not the same.
    ours.grad, theirs.grad = grads[1].clone(), grads[1].clone()
    mine.step()
    torch_adamw.step()
    assert not torch.equal(ours, theirs) and torch.allclose(ours, theirs, rtol=0, atol=1e-4)


def test_bf16_moments_train_like_fp32_with_its_groups():
    def run(state_dtype):
        torch.manual_seed(0)
        model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128))
        model.init_weights(0, 16)
        opt = optimizer(model, state_dtype)
        batch = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(8):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1).float(), batch[:, 1:].flatten())
            loss.backward()
            clip_and_step(opt, list(model.parameters()), max_norm=1.0, skip_nonfinite=True)
            out.append(loss.item())
        return out, opt

    fp32, _ = run("fp32")
    half, opt = run("bf16")
    assert isinstance(opt, AdamWBf16Moments)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # norm gains take no decay
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt.state.values())
    assert half[-1] < 0.9 * half[0] and half == pytest.approx(fp32, rel=0.02) and half != fp32


def test_the_update_in_chunks_is_the_update_of_each():
    """The GPU path calls the update CHUNK parameters at a time; a list's update is each parameter's."""
    torch.manual_seed(0)
    sizes = [7, 300, 1, 64] * (CHUNK // 2)
    made = [[torch.randn(n) for n in sizes] for _ in range(2)] + [[torch.randn(n).abs().bfloat16() for n in sizes]
                                                                   for _ in range(2)]
    together = [[t.clone() for t in ts] for ts in made]
    steps_a, steps_b = [torch.tensor(3.0) for _ in sizes], [torch.tensor(3.0) for _ in sizes]
    lr = torch.tensor(1e-2)
    adamw_update_all(*together, steps_a, lr, 0.9, 0.95, 1e-8, 0.1)
    for i in range(len(sizes)):
        adamw_update_all(*[[ts[i]] for ts in made], [steps_b[i]], lr, 0.9, 0.95, 1e-8, 0.1)
    assert all(torch.equal(a, b) for xs, ys in zip(together, made) for a, b in zip(xs, ys))


def test_a_bf16_run_resumes_exactly(tmp_path, corpus):
    """Six steps straight against three, saved, then three more from the checkpoint: the same losses, bit for
    bit (the moments and step counts are in the checkpoint as they were)."""
    args = ("--training.steps", "6", "--data.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq",
            "1", "--validation.enable", "false", "--training.deterministic", "--optimizer.state_dtype", "bf16",
            "--checkpoint.enable", "--checkpoint.interval", "3")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_here(straight, *args, corpus=corpus)
    shutil.copytree(straight / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    train_here(resumed, *args, corpus=corpus)
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == [4, 5, 6] and all(a[s] == b[s] for s in (4, 5, 6)), (a, b)


@pytest.mark.slow  # two gloo ranks, twice: about 30 s
def test_two_ranks_resume_their_sharded_bf16_moments_exactly(tmp_path, corpus):
    """Under FSDP the moments are DTensors sharded like their weights: saved at step 3 on two ranks and
    loaded there again, the run continues as the uninterrupted one, bit for bit."""
    args = ("--training.steps", "6", "--data.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq",
            "1", "--validation.enable", "false", "--training.deterministic", "--optimizer.state_dtype", "bf16",
            "--checkpoint.enable", "--checkpoint.interval", "3")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_train(straight, *args, nproc=2, corpus=corpus)
    shutil.copytree(straight / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    run_train(resumed, *args, nproc=2, corpus=corpus)
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == [4, 5, 6] and all(a[s] == b[s] for s in (4, 5, 6)), (a, b)
