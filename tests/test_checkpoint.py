"""Checkpoints you can trust: exact resume, resharding, crashes, preemption, and import (the
export's tests, which use the same reference runs, are in test_export.py).

Every training run here is the real launcher (`torchrun ... run_train.sh`) on the debug model, on
CPU, two ranks over gloo unless said otherwise. All runs share one short schedule (SCHEDULE), so
any run's losses can be compared with the uninterrupted two-rank reference run, step by step.
The global batch is fixed at 8 so that one rank (2 micro-batches of 4) and two ranks (4 each)
train on the same samples.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    FP8,
    ROOT,
    SCHEDULE,
    STEPS,
    _env,
    ckpt,
    error_lines,
    load_in_process,
    metrics,
    run_python,
    run_train,
    seal,
    step_losses,
    train_here,
)

# Single-process DCP calls (the export, the synthetic checkpoints) say that they are single-process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ---- helpers -------------------------------------------------------------------------------------


def train_args(dump: Path, corpus, *overrides: str) -> list[str]:
    """The arguments conftest.run_train passes, for launches it cannot do (Popen, plain python)."""
    return ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.dump_folder", str(dump),
            "--training.device", "cpu", "--data.path", corpus[0], *SCHEDULE, *overrides]


def folders(dump: Path) -> list[str]:
    """The step folders (the folder's lock file, .titanlike.lock, left out)."""
    names = [n for n in os.listdir(ckpt(dump)) if not n.startswith(".")]
    return sorted(names, key=lambda n: (int(n.split("-")[1].split(".")[0]), n))


def copy_step(src_dump: Path, step: int, dst_dump: Path) -> None:
    """A new run folder holding only the step-N checkpoint of another run (as if it stopped there)."""
    shutil.copytree(ckpt(src_dump) / f"step-{step}", ckpt(dst_dump) / f"step-{step}")


def children(pid: int) -> list[int]:
    """Direct children of a process (torchrun's workers: they run in sessions of their own)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def start(cmd: list[str], logs: Path) -> subprocess.Popen:
    """Start a run in a session of its own; its output goes to logs.out / logs.err (never a full pipe)."""
    with open(f"{logs}.out", "w") as out, open(f"{logs}.err", "w") as err:
        return subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=out, stderr=err, text=True, start_new_session=True)


def output(logs: Path) -> str:
    return Path(f"{logs}.out").read_text() + Path(f"{logs}.err").read_text()


def signal_job(proc: subprocess.Popen, sig: int) -> None:
    """Signal torchrun and every worker, as a scheduler does (scancel, a node failure)."""
    for pid in children(proc.pid) + [proc.pid]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_for(predicate, what: str, proc: subprocess.Popen, logs: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended ({proc.returncode}) before {what}:\n{output(logs)[-5000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{output(logs)[-5000:]}")
        time.sleep(0.05)


def logged_steps(dump: Path) -> int:
    path = dump / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


# ---- 1. exact resume ------------------------------------------------------------------------------


@pytest.mark.slow
def test_keep_latest_k_keeps_exactly_k(ref):
    dump, proc = ref
    # Six saves (steps 2, 4, …, 12): only the newest three remain, all complete, nothing half-written.
    assert folders(dump) == ["step-8", "step-10", "step-12"]
    for name in folders(dump):
        assert (ckpt(dump) / name / ".metadata").is_file()
        assert (ckpt(dump) / name / "model_args.json").is_file()
    assert proc.stderr.count(": saved to ") == 6  # one line a save


@pytest.mark.slow
def test_float8_resume_is_bitwise_exact(ref_fp8, tmp_path, corpus):
    dump, _ = ref_fp8
    copy_step(dump, 4, tmp_path)
    proc = run_train(tmp_path, *SCHEDULE, *FP8, "--checkpoint.interval", "4", nproc=2, corpus=corpus)
    assert f"resumed from {ckpt(tmp_path)}/step-4 at step 4 (data position and RNG restored)" in proc.stderr
    full, resumed = step_losses(dump), step_losses(tmp_path)
    assert sorted(resumed) == list(range(5, STEPS + 1))
    assert resumed == {s: full[s] for s in resumed}  # bit for bit, float8 scales included


@pytest.mark.slow
def test_float8_delayed_scaling_resume_is_bitwise_exact(ref_fp8, tmp_path, corpus):
    """Two ranks, float8 all-gather, delayed scaling measured every third step: the amax history
    (maximum over ranks) is checkpointed, so the resumed run casts with the same scales."""
    delayed = (*FP8, "--fp8.scaling", "delayed", "--fp8.amax_every", "3", "--checkpoint.interval", "4")
    full_dump, resumed_dump = tmp_path / "full", tmp_path / "resumed"
    run_train(full_dump, *SCHEDULE, *delayed, nproc=2, corpus=corpus)
    copy_step(full_dump, 4, resumed_dump)
    proc = run_train(resumed_dump, *SCHEDULE, *delayed, nproc=2, corpus=corpus)
    assert "delayed scaling" in proc.stderr and "resumed from" in proc.stderr
    full, resumed, dynamic = step_losses(full_dump), step_losses(resumed_dump), step_losses(ref_fp8[0])
    assert sorted(resumed) == list(range(5, STEPS + 1))
    assert resumed == {s: full[s] for s in resumed}  # bit for bit
    assert full[1] == dynamic[1] and all(full[s] != dynamic[s] for s in range(2, STEPS + 1))  # really delayed


@pytest.mark.slow
def test_async_save_killed_mid_write_resumes_from_last_complete_and_exactly(ref, tmp_path, corpus):
    """SIGKILL to every process while an async save of step 6 is being written (the write is made
    slow on purpose): step-6.tmp stays behind, is reported and never loaded; the next run resumes
    from step-4, itself written in the background, and trains bit for bit like the reference."""
    marker = tmp_path / "writing-step-6"
    hooked = tmp_path / "slow_save_train.py"
    hooked.write_text(textwrap.dedent(f"""
        import os, sys, time
        import torch.distributed.checkpoint.filesystem as fs

        real_write = fs._FileSystemWriter.write_data

        def slow_write(self, plan, planner):
            if str(self.path).endswith("step-6.tmp"):
                open({str(marker)!r} + "." + os.environ["RANK"], "w").close()
                time.sleep(600)  # the process is killed in here
            return real_write(self, plan, planner)

        fs._FileSystemWriter.write_data = slow_write
        from titanlike.train import main
        sys.exit(main())
    """))
    dump = tmp_path / "run"
    args = train_args(dump, corpus, "--checkpoint.interval", "2", "--checkpoint.async_mode", "async")
    proc = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(hooked),
                  *args], tmp_path / "killed")
    try:
        wait_for(lambda: all(Path(f"{marker}.{r}").exists() for r in (0, 1)), "the save of step 6", proc,
                 tmp_path / "killed")
    finally:
        signal_job(proc, signal.SIGKILL)
        proc.wait()
    assert folders(dump) == ["step-2", "step-4", "step-6.tmp"]

    resumed = run_train(dump, *SCHEDULE, "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
                        nproc=2, corpus=corpus)
    assert f"ignoring {ckpt(dump)}/step-6.tmp: a save that never completed" in resumed.stderr
    assert f"resumed from {ckpt(dump)}/step-4 at step 4" in resumed.stderr
    # metrics.jsonl reads as one run: the killed attempt's records after step 4 were moved aside.
    losses = step_losses(dump)
    assert [r["step"] for r in metrics(dump)] == list(range(1, STEPS + 1))
    assert losses == step_losses(ref[0])
    # The resumed run saved step 6 again, properly; no half-written folder is left.
    assert folders(dump) == [f"step-{s}" for s in range(2, STEPS + 1, 2)]


@pytest.mark.slow
def test_background_save_and_the_step_vote_never_share_a_group(ref, tmp_path, corpus):
    """A background save runs collectives in its own thread (planning, then gathering every rank's
    write results), while the training loop votes every step on its CPU group (preemption, is the
    save written everywhere). Rank 0 here writes slowly, so rank 1 reaches the save's last collective
    while rank 0 is still voting: had the two shared one group, they would pair up out of order on
    the two ranks and hang. The run must finish, publish every checkpoint and train like the reference."""
    hooked = tmp_path / "slow_rank0_save.py"
    hooked.write_text(textwrap.dedent("""
        import os, sys, time
        import torch.distributed.checkpoint.filesystem as fs

        real_write = fs._FileSystemWriter.write_data

        def slow_write(self, plan, planner):
            if os.environ["RANK"] == "0":
                time.sleep(2)  # several training steps
            return real_write(self, plan, planner)

        fs._FileSystemWriter.write_data = slow_write
        from titanlike.train import main
        sys.exit(main())
    """))
    dump = tmp_path / "run"
    args = train_args(dump, corpus, "--checkpoint.interval", "4", "--checkpoint.async_mode", "async",
                      "--parallel.backend_timeout_s", "60")
    proc = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(hooked),
                  *args], tmp_path / "slow")
    try:
        wait_for(lambda: proc.poll() is not None, "the run to end (hung?)", proc, tmp_path / "slow", timeout=150)
    finally:
        signal_job(proc, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, output(tmp_path / "slow")[-5000:]
    assert folders(dump) == ["step-4", "step-8", "step-12"]
    full = step_losses(ref[0])
    assert step_losses(dump) == full


# ---- 2. another world size ------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_on_one_rank_from_two_rank_checkpoint(ref, tmp_path, corpus):
    dump, _ = ref
    copy_step(dump, 8, tmp_path)
    proc = train_here(tmp_path, *SCHEDULE, "--checkpoint.interval", "100", corpus=corpus)
    assert "data position restored; RNG afresh: saved on 2 data-parallel ranks, now 1" in proc.stderr
    full, resumed = step_losses(dump), step_losses(tmp_path)
    assert sorted(resumed) == list(range(9, STEPS + 1))
    # Same samples, same weights; only the order of floating-point reductions differs. Another
    # batch would change the loss by ~0.1, far outside this tolerance.
    for s in resumed:
        assert resumed[s] == pytest.approx(full[s], rel=2e-5, abs=0), (s, resumed[s], full[s])


# ---- 3/4. preemption ------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_to_every_process_saves_and_resumes_exactly(ref, tmp_path, corpus):
    """A scheduler's SIGTERM reaches torchrun and every worker: the workers finish the step they
    are in, save, say where, and exit; the next run resumes bit for bit. (torchrun itself reports
    the signal as a failure: its exit code is torchrun's, not the trainer's.)"""
    args = train_args(tmp_path, corpus, "--checkpoint.interval", "100")
    logs = tmp_path / "preempted"
    proc = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                  str(ROOT / "run_train.sh"), *args], logs)
    try:
        wait_for(lambda: logged_steps(tmp_path) >= 2, "step 2", proc, logs)
        signal_job(proc, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            signal_job(proc, signal.SIGKILL)
    err = output(logs)
    stopped = max(step_losses(tmp_path))
    assert stopped < STEPS
    assert f"preempted: stopped after step {stopped}; checkpoint at {ckpt(tmp_path)}/step-{stopped}" in err
    assert folders(tmp_path) == [f"step-{stopped}"]

    resumed = run_train(tmp_path, *SCHEDULE, "--checkpoint.interval", "100", nproc=2, corpus=corpus)
    assert f"resumed from {ckpt(tmp_path)}/step-{stopped} at step {stopped}" in resumed.stderr
    full = step_losses(ref[0])
    after = step_losses(tmp_path, after_line=stopped)
    assert sorted(after) == list(range(stopped + 1, STEPS + 1))
    assert after == {s: full[s] for s in after}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_signal_to_single_process_saves_and_exits_zero(tmp_path, corpus, sig):
    """One process, no torchrun (the one-GPU launch): the signal → finish the step, save, exit 0."""
    logs = tmp_path / "preempted"
    args = train_args(tmp_path, corpus, "--checkpoint.interval", "100")
    proc = start([sys.executable, "-m", "titanlike.train", *args], logs)
    try:
        wait_for(lambda: logged_steps(tmp_path) >= 2, "step 2", proc, logs)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = output(logs)
    assert proc.returncode == 0, err[-3000:]
    stopped = max(step_losses(tmp_path))
    assert stopped < STEPS
    assert f"preempted: stopped after step {stopped}; checkpoint at {ckpt(tmp_path)}/step-{stopped}" in err
    assert folders(tmp_path) == [f"step-{stopped}"]


# ---- 6. float8 is a compute choice: checkpoints load either way -----------------------------------


def checkpoint_keys(step_dir: Path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)


@pytest.mark.slow
def test_float8_and_fp32_checkpoints_load_into_each_other(ref, ref_fp8, tmp_path, corpus):
    dump, dump8 = ref[0], ref_fp8[0]
    assert checkpoint_keys(ckpt(dump) / "step-8") == checkpoint_keys(ckpt(dump8) / "step-8")

    # float8 checkpoint → plain fp32 run on one rank. Its first loss is the float8 run's loss on the
    # same weights and batch, computed without float8 rounding: close, not equal.
    copy_step(dump8, 8, tmp_path / "to_fp32")
    train_here(tmp_path / "to_fp32", *SCHEDULE, "--checkpoint.interval", "100", corpus=corpus)
    # fp32 checkpoint → float8 run on two ranks, float8 all-gather on.
    copy_step(dump, 8, tmp_path / "to_fp8")
    run_train(tmp_path / "to_fp8", *SCHEDULE, *FP8, "--checkpoint.interval", "100", nproc=2, corpus=corpus)

    for resumed, source in ((tmp_path / "to_fp32", dump8), (tmp_path / "to_fp8", dump)):
        got, want = step_losses(resumed), step_losses(source)
        assert sorted(got) == list(range(9, STEPS + 1))
        assert got[9] == pytest.approx(want[9], rel=2e-3), (resumed.name, got, want)
        # A run that lost the weights would be back near ln(320) = 5.8.
        assert got[STEPS] < want[1] - 1.0


# ---- 7/8. export and import: the export's own tests are in test_export.py -------------------------


def synthetic_checkpoint(step_dir: Path, **overrides):
    """A one-process DCP checkpoint in the trainer's layout, for model shapes no run here trains."""
    import dataclasses

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titanlike.model.decoder import Transformer
    from titanlike.model.shape import model_args

    margs = dataclasses.replace(model_args("debug"), **overrides)
    model = Transformer(margs)
    model.init_weights(seed=7, seq_len=64)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(step_dir), no_dist=True)
    (step_dir / "model_args.json").write_text(json.dumps(dataclasses.asdict(margs)))
    seal(str(step_dir))  # the manifest a titanlike save writes: trusted as this account's
    return model


# ---- 9. errors the user can fix ------------------------------------------------------------------


@pytest.mark.slow
def test_load_step_missing_and_shape_mismatch_are_one_line(ref, tmp_path, corpus):
    shutil.copytree(ckpt(ref[0]), ckpt(tmp_path))
    missing = run_python("-m", "titanlike.train", *train_args(tmp_path, corpus, "--checkpoint.load_step", "5"))
    assert missing.returncode == 2
    assert error_lines(missing.stderr) == [
        f"error: checkpoint.load_step = 5: no complete checkpoint {ckpt(tmp_path)}/step-5 "
        f"(complete steps in {ckpt(tmp_path)}: 8, 10, 12)"
    ]
    assert "Traceback" not in missing.stderr

    # On two ranks every rank meets the mismatch; one of them says so (torchrun adds its own report).
    other = run_train(tmp_path, *SCHEDULE, "--model.vocab_size", "384", nproc=2, corpus=corpus, check=False)
    assert other.returncode != 0
    assert error_lines(other.stderr) == [
        f"error: {ckpt(tmp_path)}/step-12 was saved from a different model shape: tok_embeddings.weight is "
        f"(320, 256) there, (384, 256) here (check --model.flavor / --model.vocab_size)"
    ]

    # Steps of another run (this dump folder records a run of its own): every rank refuses alike, one says so.
    (tmp_path / "run-id").write_text("0123456789ab\n")
    foreign = run_train(tmp_path, *SCHEDULE, nproc=2, corpus=corpus, check=False)
    assert foreign.returncode != 0
    (line,) = error_lines(foreign.stderr)
    assert line.startswith(f"error: {ckpt(tmp_path)}/step-12 was saved by run ") and \
        f"not by this dump folder's run 0123456789ab ({tmp_path})" in line, line


def debug_model(**overrides):
    import dataclasses

    from titanlike.model.decoder import Transformer
    from titanlike.model.shape import model_args

    model = Transformer(dataclasses.replace(model_args("debug"), **overrides))
    model.init_weights(seed=5, seq_len=64)
    return model


def load_error(model, path: Path, config_agrees: bool = False, trust: bool = False) -> str:
    """The one line that loading `path` into `model` gives. config_agrees rewrites the folder's config.json
    to describe `model`, to reach the checks of the tensors themselves (config.json is checked first);
    trust = --checkpoint.trust_pickled_dcp, for DCP folders written here by plain DCP."""
    from titanlike.errors import UserError
    from titanlike.model.hf_names import hf_config

    if config_agrees:
        (path / "config.json").write_text(json.dumps(hf_config(model.args, "float32")))
    with pytest.raises(UserError) as e:
        load_in_process(model, path, trust)
    return str(e.value)


def test_stacked_qkv_is_three_hugging_face_projections(tmp_path):
    """Export splits wqkv's rows into q_proj, k_proj, v_proj; import stacks them back, or says what is wrong."""
    from safetensors.torch import load_file, save_file

    from titanlike.hf.interchange import write_hf_folder

    source = debug_model()
    a, hf = source.args, tmp_path / "hf"
    write_hf_folder(source.state_dict(), a, str(hf), torch.float32)
    tensors = load_file(hf / "model.safetensors")
    assert not any("wqkv" in name or "qkv_proj" in name for name in tensors)
    q, k, v = (tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    kv = a.n_kv_heads * a.head_dim
    assert q.shape == (a.n_heads * a.head_dim, a.dim) and k.shape == v.shape == (kv, a.dim) and kv < a.dim
    assert torch.equal(torch.cat([q, k, v]), source.state_dict()["layers.1.attention.wqkv.weight"])

    assert load_error(debug_model(n_kv_heads=a.n_heads), hf) == (
        f"{hf}/config.json: num_key_value_heads is 4 there, 8 in this run (model.n_kv_heads); use the same value, "
        f"or --model.flavor hf to take the whole shape from it")
    assert load_error(debug_model(n_kv_heads=a.n_heads), hf, config_agrees=True) == (
        f"{hf} holds a different model shape: layer 0 has q_proj (256, 256), k_proj (128, 256), v_proj (128, 256) "
        f"(check --model.flavor / --model.vocab_size)"
    )
    write_hf_folder(source.state_dict(), a, str(hf), torch.float32)
    del tensors["model.layers.2.self_attn.v_proj.weight"]
    save_file(tensors, hf / "model.safetensors")
    assert load_error(debug_model(), hf) == (
        f"{hf} has no model.layers.2.self_attn.v_proj.weight: it holds a different model")
    # A tensor no Llama has, in a second shard file: named with its file.
    save_file({"model.layers.0.mlp.extra_proj.weight": torch.zeros(2, 2)}, hf / "model-extra.safetensors")
    assert load_error(debug_model(), hf) == (
        f"{hf}/model-extra.safetensors: parameter model.layers.0.mlp.extra_proj.weight "
        f"is not part of a Llama or Qwen3 model")


def test_import_of_another_model_names_the_first_difference(tmp_path):
    """`--checkpoint.initial_load_path` with weights of another shape: one line, never a silent partial load."""
    from titanlike.hf.interchange import write_hf_folder

    hf = tmp_path / "hf"
    source = debug_model()
    write_hf_folder(source.state_dict(), source.args, str(hf), torch.float32)
    assert load_error(debug_model(vocab_size=384), hf) == (
        f"{hf}/config.json: vocab_size is 320 there, 384 in this run (model.vocab_size); use the same value, "
        f"or --model.flavor hf to take the whole shape from it")
    # Behind a config.json that agrees (hand-made, or edited), the tensors themselves are checked too.
    assert load_error(debug_model(vocab_size=384), hf, config_agrees=True) == (
        f"{hf} holds a different model shape: model.embed_tokens.weight is (320, 256) there, (384, 256) here "
        f"(check --model.flavor / --model.vocab_size)"
    )
    assert load_error(debug_model(n_layers=5), hf, config_agrees=True) == (
        f"{hf} has no model.layers.4.input_layernorm.weight, which this run's model (5 layers, dim 256, vocab 320) "
        f"needs: it holds a different model"
    )
    assert load_error(debug_model(n_layers=3), hf, config_agrees=True) == (
        f"{hf} has model.layers.3.input_layernorm.weight, which this run's model (3 layers, dim 256, vocab 320) "
        f"does not: it holds a different model"
    )
    assert load_error(debug_model(tie_embeddings=True), hf, config_agrees=True) == (
        f"{hf} has an lm_head.weight of its own (untied embeddings); run with --model.tie_embeddings false"
    )
    # The same from a checkpoint step folder: a tied model has both names, so without the check the
    # untied checkpoint's embedding and output layer would both load into the one shared tensor.
    step_dir = tmp_path / "step-1"
    synthetic_checkpoint(step_dir)
    assert load_error(debug_model(tie_embeddings=True), step_dir, trust=True) == (
        f"{step_dir} was saved with untied embeddings (an output layer of its own); "
        f"run with --model.tie_embeddings false"
    )
    # A checkpoint of an earlier titanlike, whose attention had separate wq, wk, wv: the line says how across.
    import torch.distributed.checkpoint as dcp

    model = debug_model()
    a, old = model.args, tmp_path / "step-2"
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("wqkv.weight"):
            kv = a.n_kv_heads * a.head_dim
            for part, rows in zip("qkv", tensor.split([a.n_heads * a.head_dim, kv, kv])):
                state[name.replace("wqkv", f"w{part}")] = rows.clone()
        else:
            state[name] = tensor
    dcp.save({"model": state}, checkpoint_id=str(old), no_dist=True)
    assert load_error(debug_model(), old, trust=True) == (
        f"{old} was saved by an earlier titanlike, with separate wq/wk/wv projections (now one stacked wqkv): export "
        f"it with that version's scripts/export_safetensors.py and start from the export with "
        f"--checkpoint.initial_load_path"
    )


def test_a_resume_onto_data_of_another_tokenizer_is_refused(tmp_path):
    """checkpoint/weights.py check_tokenizer: the step's copy of the tokenizer against the run's data's. Another
    (here byte-level against a tokenizer.json) is one line naming both kinds; the same, or a side without a
    record (an older checkpoint, data without dataset.json), resumes."""
    from titanlike.checkpoint.weights import CheckpointMismatch, check_tokenizer
    from titanlike.data.tokenizer import run_tokenizer_files

    step = tmp_path / "step-2"
    step.mkdir()
    byte = run_tokenizer_files(None, builtin_corpus=True)
    for name, text in byte.items():
        (step / name).write_text(text)
    check_tokenizer(str(step), byte)  # the same tokenizer
    check_tokenizer(str(step), {})  # data without a tokenizer record
    other = {"tokenizer.json": '{"model": {"type": "BPE"}}',
             "tokenizer_info.json": json.dumps({"kind": "huggingface", "eos_token": "</s>"})}
    said = r"step-2 was trained with the byte tokenizer, but the run's data were made with a Hugging Face tokenizer: "
    with pytest.raises(CheckpointMismatch, match=said + r".*--checkpoint.initial_load_path"):
        check_tokenizer(str(step), other)
    for name in byte:
        (step / name).unlink()
    check_tokenizer(str(step), other)  # a checkpoint saved before runs kept their tokenizer


def test_a_resume_onto_another_tokenizer_of_the_same_kind_names_what_differs(tmp_path):
    """Two Hugging Face tokenizers were said as "another tokenizer (huggingface) than the run's data have
    (huggingface)": the line names the dataset each came with, and where that is one too, their files' hashes."""
    import hashlib

    from titanlike.checkpoint.weights import CheckpointMismatch, check_tokenizer

    def files(vocab: str, dataset: str) -> dict[str, str]:
        return {"tokenizer.json": json.dumps({"model": {"type": "BPE", "vocab": {vocab: 0}}}),
                "tokenizer_info.json": json.dumps({"kind": "huggingface", "dataset": dataset})}

    step = tmp_path / "step-2"
    step.mkdir()
    for name, text in files("a", "/data/web/dataset.json").items():
        (step / name).write_text(text)
    with pytest.raises(CheckpointMismatch) as e:
        check_tokenizer(str(step), files("b", "/data/code/dataset.json"))
    assert (f"{step} was trained with a Hugging Face tokenizer from /data/web/dataset.json, but the run's data were "
            f"made with a Hugging Face tokenizer from /data/code/dataset.json: each token id") in str(e.value)
    remade = files("b", "/data/web/dataset.json")  # the dataset made again in place with another tokenizer
    with pytest.raises(CheckpointMismatch) as e:
        check_tokenizer(str(step), remade)

    def digest(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    theirs, ours = digest((step / "tokenizer.json").read_text()), digest(remade["tokenizer.json"])
    assert (f"trained with a Hugging Face tokenizer from /data/web/dataset.json (tokenizer.json {theirs}), but the "
            f"run's data were made with a Hugging Face tokenizer from /data/web/dataset.json (tokenizer.json {ours})"
            ) in str(e.value) and theirs != ours
