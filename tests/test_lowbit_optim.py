"""optimizer.state_dtype = 8bit: torchao's AdamW8bit (blockwise-quantized moments) trains like fp32
AdamW, follows the same LR schedule with its tensor LR, resumes bit for bit, and refuses a resume
that changes the moments' type.

torchao compiles its update per parameter shape; on this CPU the first compile takes about a minute,
so the models are tiny and subprocesses share conftest's warm inductor cache.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import ROOT, losses, metrics, run_python, run_train, train_here
from titanlike.config.schema import LRScheduler
from titanlike.model.decoder import Transformer
from titanlike.model.shape import ModelArgs
from titanlike.optim import build_optimizer, build_scheduler, clip_and_step, lr_factor, resume_schedule

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled",
                                        "ignore:OptimState8bit does not implement")

STEPS = 6
SCHEDULE = ("--training.steps", str(STEPS), "--data.seq_len", "64", "--training.local_batch_size", "4",
            "--training.global_batch_size", "8", "--metrics.log_freq", "1", "--validation.enable", "false",
            "--training.deterministic", "--checkpoint.enable", "--checkpoint.interval", "3")
EIGHT_BIT = ("--optimizer.state_dtype", "8bit")
FP8 = ("--fp8.recipe", "tensorwise", "--fp8.emulate", "--fp8.auto_filter", "false")


@pytest.fixture(autouse=True)
def warm_inductor_cache(monkeypatch):
    """In-process compiles use the same warm cache as the test subprocesses (conftest._env)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "titanlike-inductor"))


def small_model() -> Transformer:
    # Embedding, output and attention matrices hold >= 4096 values: torchao quantizes their moments.
    model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128))
    model.init_weights(0, 16)
    return model


def optimizer(model, state_dtype, lr=3e-3):
    return build_optimizer(model, lr=lr, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, device_type="cpu",
                           state_dtype=state_dtype)


# ---- the optimizer ----------------------------------------------------------------------------------


def train_losses(state_dtype: str, steps: int = 8) -> tuple[list[float], torch.optim.Optimizer, Transformer]:
    torch.manual_seed(0)
    model = small_model()
    opt = optimizer(model, state_dtype)
    batch = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        clip_and_step(opt, list(model.parameters()), max_norm=1.0, skip_nonfinite=True)
        out.append(loss.item())
    return out, opt, model


def test_8bit_moments_train_like_fp32():
    fp32, _, _ = train_losses("fp32")
    low, opt, model = train_losses("8bit")
    # The same param groups as fp32 AdamW: weight decay on matrices and embeddings, none on norm gains.
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(p.ndim < 2 for p in opt.param_groups[1]["params"]) and opt.param_groups[1]["params"]
    # Really 8-bit: the large matrices' moments are uint8 codes with a scale per block of 256.
    emb = opt.state[model.tok_embeddings.weight]
    assert emb["exp_avg"].codes.dtype == torch.uint8 and emb["exp_avg"].scale.numel() == 128 * 64 // 256
    # It learns (overfitting one batch), close to fp32 but not identical to it.
    assert low[-1] < 0.9 * low[0]
    assert low == pytest.approx(fp32, rel=0.02)
    assert low != fp32


def test_skipped_update_leaves_weights_and_8bit_moments_alone():
    _, opt, model = train_losses("8bit", steps=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    emb = opt.state[model.tok_embeddings.weight]
    codes, step = emb["exp_avg"].codes.clone(), emb["step"].clone()
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    _, skipped = clip_and_step(opt, list(model.parameters()), max_norm=1.0, skip_nonfinite=True)
    assert skipped.item() == 1.0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(emb["exp_avg"].codes, codes) and torch.equal(emb["step"], step)


# ---- the LR schedule with a tensor LR ---------------------------------------------------------------


def schedule_lrs(state_dtype: str, steps: int, resume_at: int | None = None) -> list[float]:
    """The LR each update uses, from the param group (as the trainer logs it). No gradients: the
    optimizer steps are no-ops, so nothing compiles."""
    opt = optimizer(small_model(), state_dtype, lr=1e-3)
    sched = build_scheduler(opt, LRScheduler(warmup_steps=3, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1),
                            steps)
    if resume_at is not None:
        resume_schedule(sched, resume_at)
    lrs = []
    for _ in range(steps - (resume_at or 0)):
        lrs.append(float(opt.param_groups[0]["lr"]))
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) == (state_dtype == "8bit")
        opt.step()
        sched.step()
    return lrs


def test_tensor_lr_follows_the_schedule_and_resumes_exactly():
    steps = 10
    want = [1e-3 * lr_factor(s, steps, 3, 0.5, "cosine", 0.1) for s in range(1, steps + 1)]
    fp32, low = schedule_lrs("fp32", steps), schedule_lrs("8bit", steps)
    assert fp32 == pytest.approx(want, rel=1e-12)
    assert low == pytest.approx(want, rel=1e-6)  # torchao's LR is a float32 tensor
    for k in (1, 4, 7):  # warmup, stable, decay
        assert schedule_lrs("8bit", steps, resume_at=k) == low[k:]  # bit for bit
        assert schedule_lrs("fp32", steps, resume_at=k) == fp32[k:]


# ---- checkpoints ------------------------------------------------------------------------------------


def saved_tensors(step_dir: Path, out: Path) -> dict:
    """Everything a DCP step folder holds, as plain tensors: 8-bit moments come back dequantized
    (codes × block scales), so equal tensors mean equal codes and scales."""
    import torchao.optim  # noqa: F401 (lets weights_only loads rebuild its 8-bit state class)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step_dir, out)
    saved = torch.load(out, weights_only=True)
    flat = {f"model.{k}": v for k, v in saved["model"].items()}
    for key, value in saved["optimizer"]["state"].items():
        flat.update({f"optimizer.{key}.{name}": t for name, t in value.items()})
    return flat


def stored_bytes(step_dir: Path, fqn: str) -> int:
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(step_dir)).read_metadata()
    return sum(info.length for index, info in md.storage_data.items() if index.fqn == fqn)


def assert_same_checkpoint(a: Path, b: Path, tmp: Path) -> None:
    x, y = saved_tensors(a, tmp / "a.pt"), saved_tensors(b, tmp / "b.pt")
    assert sorted(x) == sorted(y) and any(".exp_avg_sq" in k for k in x)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
    # The moments are stored in 8 bits: the embedding's (320 × 256 values) takes about a byte a value.
    size = stored_bytes(a, "optimizer.state.tok_embeddings.weight.exp_avg")
    assert 320 * 256 < size < 320 * 256 * 1.2


def resume_from(src: Path, step: int, dst: Path) -> None:
    shutil.copytree(src / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus) -> Path:
    """One process, 8-bit moments, six steps straight, checkpoints at 3 and 6. Its users are all in the slow
    tier, which makes it once for them, in this process: torchao's compiled step is then compiled once for
    every one-process run of the module."""
    dump = tmp_path_factory.mktemp("straight")
    train_here(dump, *SCHEDULE, *EIGHT_BIT, corpus=corpus)
    return dump


@pytest.mark.slow  # uses `straight`
def test_8bit_differs_from_fp32(straight, tmp_path, corpus):
    """The option changes the optimizer the trainer builds (and its LR is logged as a number)."""
    fp32 = tmp_path / "fp32"
    train_here(fp32, *SCHEDULE, "--checkpoint.enable", "false", corpus=corpus)
    a, b = losses(straight), losses(fp32)
    assert a[1] == b[1] and a[STEPS] != b[STEPS] and a[STEPS] == pytest.approx(b[STEPS], rel=0.02)
    assert all(isinstance(r["lr"], float) for r in metrics(straight))


@pytest.mark.slow  # uses `straight`
def test_resume_that_changes_state_dtype_is_refused(straight, tmp_path, corpus):
    now = "fp32"
    resume_from(straight, 3, tmp_path)
    proc = run_python("-m", "titanlike.train", "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"),
                      "--job.dump_folder", str(tmp_path), "--training.device", "cpu", "--data.path", corpus[0],
                      *SCHEDULE, "--optimizer.state_dtype", now)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors == [f"error: {tmp_path}/checkpoint/step-3 was trained with optimizer.state_dtype = 8bit, this run "
                      f"has {now}: resume with --optimizer.state_dtype 8bit (the moments cannot be converted)"]
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "checkpoint" / "step-3").is_dir()  # nothing set aside or lost


@pytest.mark.slow
def test_8bit_two_rank_fsdp_resume_is_bitwise_exact(tmp_path, corpus):
    """FSDP shards the moments: torchao wraps each rank's 8-bit shard in a DTensor, which DCP saves.
    With float8 all-gather (emulated) the weights it updates are float8-cast wrappers in DTensors.
    The step-3 checkpoint is saved in the background: host_copy stages the DTensors around 8-bit
    shards."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    proc = run_train(full, *SCHEDULE, *EIGHT_BIT, *FP8, "--checkpoint.async_mode", "async", nproc=2, corpus=corpus)
    assert "checkpoint step 3: saving in the background to" in proc.stderr
    resume_from(full, 3, resumed)
    proc = run_train(resumed, *SCHEDULE, *EIGHT_BIT, *FP8, nproc=2, corpus=corpus)
    assert "dp_shard 2" in proc.stderr and "(data position and RNG restored)" in proc.stderr
    assert "float8 all-gather on" in proc.stderr
    a, b = losses(full), losses(resumed)
    assert sorted(b) == [4, 5, 6] and b == {s: a[s] for s in b}
    assert_same_checkpoint(full / "checkpoint" / "step-6", resumed / "checkpoint" / "step-6", tmp_path)
    # On one process DCP reshards the 8-bit codes and scales: the same samples, and losses within the
    # rounding of another reduction order (measured: 2e-5 relative at step 6, float8 included).
    one = tmp_path / "one"
    resume_from(full, 3, one)
    proc = train_here(one, *SCHEDULE, *EIGHT_BIT, *FP8, corpus=corpus)
    assert "saved on 2 data-parallel ranks, now 1" in proc.stderr
    assert losses(one) == pytest.approx({s: a[s] for s in (4, 5, 6)}, rel=1e-4)


def test_state_dtype_is_a_config_choice():
    from titanlike.config import load_config

    assert load_config([]).optimizer.state_dtype == "fp32"  # the default stays fused fp32 AdamW
    assert load_config(["--optimizer.state_dtype", "8bit"]).optimizer.state_dtype == "8bit"
    assert (ROOT / "docs" / "configuration.md").read_text().count("optimizer.state_dtype") == 1
    for mode in ("async", "async_with_pinned_mem"):  # saved in the background (host_copy stages them)
        cfg = load_config(["--optimizer.state_dtype", "8bit", "--checkpoint.enable", "--checkpoint.async_mode", mode])
        assert cfg.checkpoint.async_mode == mode


def test_host_copy_of_8bit_state_is_a_snapshot():
    """What a background save writes: a host copy of each 8-bit moment (codes, scales, lookup table),
    of its class, equal to the moment when copied and untouched by the steps after it."""
    from torchao.optim.subclass_8bit import OptimState8bit

    from titanlike.checkpoint.staging import host_copy

    _, opt, model = train_losses("8bit", steps=2)
    state = opt.state[model.tok_embeddings.weight]
    assert isinstance(state["exp_avg"], OptimState8bit)  # quantized, not a plain fallback
    staged = host_copy({"state": {"emb": dict(state)}, "names": ["a"], "step": 3})
    copy = staged["state"]["emb"]["exp_avg"]
    assert type(copy) is OptimState8bit and copy.signed == state["exp_avg"].signed
    before = {name: getattr(state["exp_avg"], name).clone() for name in ("codes", "scale", "qmap")}
    for name in ("codes", "scale", "qmap"):
        assert torch.equal(getattr(copy, name), before[name])
        live = getattr(state["exp_avg"], name)
        assert getattr(copy, name).untyped_storage().data_ptr() != live.untyped_storage().data_ptr()
    assert staged["names"] == ["a"] and staged["step"] == 3
    # Another optimizer step changes the live moments, not the copy.
    state["exp_avg"].codes.add_(1)
    state["exp_avg"].scale.mul_(2)
    assert torch.equal(copy.codes, before["codes"]) and torch.equal(copy.scale, before["scale"])
    assert torch.equal(copy.dequantize(), OptimState8bit(before["codes"], before["scale"], before["qmap"],
                                                          copy.signed).dequantize())


@pytest.mark.slow  # two more training runs
def test_8bit_background_save_writes_what_the_foreground_save_writes_and_resumes_exactly(straight, tmp_path, corpus):
    """checkpoint.async_mode with 8-bit moments: step 3 is saved in the background (step 6, the last,
    in the foreground as always); its files hold what the foreground save of the same run held. Resumed
    from it, steps 4-6 are the straight run's bit for bit, and so is the step-6 checkpoint. (On two ranks
    under FSDP: test_8bit_two_rank_fsdp_resume_is_bitwise_exact.)"""
    background = tmp_path / "background"
    proc = train_here(background, *SCHEDULE, *EIGHT_BIT, "--checkpoint.async_mode", "async", corpus=corpus)
    assert "checkpoint step 3: saving in the background to" in proc.stderr
    assert losses(background) == losses(straight)
    assert_same_checkpoint(straight / "checkpoint" / "step-3", background / "checkpoint" / "step-3", tmp_path)
    resumed = tmp_path / "resumed"
    resume_from(background, 3, resumed)
    proc = train_here(resumed, *SCHEDULE, *EIGHT_BIT, corpus=corpus)
    assert "resumed from" in proc.stderr and "at step 3 (data position and RNG restored)" in proc.stderr
    full = {r["step"]: (r["loss"], r["lr"]) for r in metrics(straight)}
    again = {r["step"]: (r["loss"], r["lr"]) for r in metrics(resumed)}
    assert sorted(again) == [4, 5, 6] and again == {s: full[s] for s in again}  # bit for bit
    assert_same_checkpoint(straight / "checkpoint" / "step-6", resumed / "checkpoint" / "step-6", tmp_path)
