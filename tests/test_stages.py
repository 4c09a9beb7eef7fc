"""Stages: from a step on, [[data.phase]] changes data.seq_len, the RoPE base and the batch (a long-context
stage). The table resolved and refused, the data re-sliced at the new length from where it was, and a
trainer run that switches and resumes before, at and after the switch with the uninterrupted losses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import build_data, call, error_lines, losses, metrics, run_train, train_here
from test_data_mixture import data_section, prepared
from titanlike import preflight
from titanlike.config import ConfigError, load_config
from titanlike.config.run import resolve_run
from titanlike.config.sources import parse_phase_items, parse_phases, schedule_of
from titanlike.config.stages import Stage, Stages

# ---- the table ---------------------------------------------------------------------------------------------


def test_phase_strings_with_and_without_stage_settings():
    mix = "web=data/web:0.7,code=data/code:0.3"
    assert parse_phases(f"5:{mix}") == [(5, [s for s in parse_phase_items(f"5:{mix}")[0].sources or ()])]
    items = parse_phase_items(f"5:{mix};9:seq_len=128,rope_theta=5e5;12:books=data/b:1,local_batch_size=2")
    assert [(p.step, p.sources is None, dict(p.settings)) for p in items] == [
        (5, False, {}), (9, True, {"seq_len": 128, "rope_theta": 5e5}), (12, False, {"local_batch_size": 2})]
    assert [step for step, _ in parse_phases(f"5:{mix};9:seq_len=128")] == [5]  # the mixtures alone
    # A source that happens to be named like a setting is still a source: it has FOLDER:WEIGHT.
    assert parse_phase_items("5:seq_len=data/x:1")[0].settings == ()
    for bad, why in (("5:seq_len=12.5", "seq_len = '12.5' is not a whole number"),
                     ("5:seq_len=64,seq_len=128", "seq_len is given twice"),
                     ("9:seq_len=64;5:seq_len=128", "phase steps 9, 5 must increase")):
        with pytest.raises(ValueError, match=why):
            parse_phase_items(bad)


def test_tables_in_toml_resolve_to_stages(tmp_path):
    toml = tmp_path / "long.toml"
    toml.write_text('[data]\nseq_len = 64\n[training]\nsteps = 20\nlocal_batch_size = 4\nglobal_batch_size = 16\n'
                    '[[data.phase]]\nfrom_step = 8\nseq_len = 128\nrope_theta = 1e5\n'
                    '[[data.phase]]\nfrom_step = 15\nlocal_batch_size = 2\nglobal_batch_size = 8\n')
    cfg = load_config(["--job.config_file", str(toml)])
    assert cfg.data.phase == "8:seq_len=128,rope_theta=100000.0;15:local_batch_size=2,global_batch_size=8"
    assert schedule_of(cfg.data).phases[1:] == ()  # no second mixture: the data goes on, re-sliced
    stages = resolve_run(cfg, 2).stages
    assert stages.stages == (Stage(1, 64, 10000.0, 4, 16, 2), Stage(8, 128, 1e5, 4, 16, 2),
                             Stage(15, 128, 1e5, 2, 8, 2))
    assert [stages.index_at_batch(b) for b in (0, 6, 7, 13, 14, 99)] == [0, 0, 1, 1, 2, 2]
    # A batch of 0 (local × DP) carries the rule, not the number: halving the local batch halves it.
    cfg = load_config(["--data.phase", "3:local_batch_size=2", "--training.local_batch_size", "4"])
    assert [(s.global_batch, s.accum_steps) for s in resolve_run(cfg, 2).stages.stages] == [(8, 1), (4, 1)]


@pytest.mark.parametrize("argv, message", [
    # Every stage's samples, the first's too, are held to the model's limit in one place (config/stages.py).
    (["--model.max_seq_len", "64", "--data.seq_len", "128"],
     "data.seq_len = 128 exceeds model.max_seq_len = 64: set --model.max_seq_len 128 or more"),
    (["--data.phase", "5:seq_len=4096", "--model.max_seq_len", "2048"],
     "data.phase: the stage from step 5: seq_len = 4096 exceeds model.max_seq_len = 2048: set --model.max_seq_len"),
    (["--data.phase", "5:seq_len=4"], "seq_len = 4 must be at least 8"),
    (["--data.phase", "500:seq_len=64"], r"the stage from step 500 must start in \[2, training.steps = 150\]"),
    (["--data.phase", "1:seq_len=64"], r"the stage from step 1 must start in \[2"),
    (["--data.phase", "9:seq_len=512;5:seq_len=128"], "phase steps 9, 5 must increase"),
    (["--data.phase", "5:rope_theta=-1"], "rope_theta = -1.0 must be a finite number > 0"),
    (["--data.phase", "5:global_batch_size=10,local_batch_size=4"],
     "global_batch_size = 10 must be a multiple of local_batch_size = 4"),
])
def test_bad_stages_are_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


def test_the_preflight_refuses_a_stage_batch_that_does_not_split_over_the_ranks(monkeypatch, tmp_path):
    monkeypatch.setenv(preflight.WORLD_ENV, "4")
    rc, err = call(preflight.main, "--job.dump_folder", str(tmp_path), "--training.local_batch_size", "2",
                   "--training.global_batch_size", "16", "--data.phase", "5:global_batch_size=12")
    assert rc == 2
    assert error_lines(err) == ["error: data.phase: the stage from step 5 has a global batch of 12, not a multiple of "
                                "local_batch_size × data-parallel degree = 2 × 4 = 8"]


# ---- the data ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stages")
    return {"web": prepared(root, "web", 40, "web page"), "code": prepared(root, "code", 15, "def f(): return")}


SWITCH = 4  # the first step of the long stage
STAGES = Stages((Stage(1, 16, 1e4, 2, 4, 2), Stage(SWITCH, 32, 1e5, 1, 2, 2)))


def staged_data(sources, workers=0):
    data = data_section(f"web={sources['web']}:0.7,code={sources['code']}:0.3", workers)
    return build_data(data, seed=2, validation=True, stages=STAGES)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_reslices_at_the_switch_and_resumes_exactly_around_it(sources, workers):
    reference = staged_data(sources)
    micro = [2] * (SWITCH - 1) + [2] * 5  # micro-batches per step: 2 in either stage
    batches = [next(reference.loader) for _ in range(sum(micro))]
    assert [tuple(b.shape) for b in batches] == [(2, 17)] * 6 + [(1, 33)] * 10
    for resume_at in (SWITCH - 2, SWITCH - 1, SWITCH, SWITCH + 1):  # batches read when the checkpoint was saved
        resumed = staged_data(sources, workers)
        resumed.loader.load_state_dict({"batches_read": resume_at, "order": "feistel"})
        again = [next(resumed.loader) for _ in range(sum(micro[resume_at:]))]
        assert all(torch.equal(a, b) for a, b in zip(batches[sum(micro[:resume_at]):], again, strict=True)), resume_at


def test_the_long_stage_goes_on_from_the_tokens_read_before_it(sources):
    data = staged_data(sources)
    for _ in range(2 * (SWITCH - 1)):
        next(data.loader)
    before = data.read_by_source()["tokens_by_source"]
    assert sum(before.values()) == (SWITCH - 1) * 4 * 16
    long = data.segments[1]
    assert long.seq_len == 32 and long.tokens_before.tolist() == list(before.values())
    # Each source's order at the new length starts at the window its tokens so far reach.
    assert long.plan.before[0].tolist() == [t // 32 for t in before.values()]
    assert data.val["web"].seq_len == 16  # validation after the last short step: at the model's length
    for _ in range(2 * 3):
        next(data.loader)
    after = data.read_by_source()
    assert sum(after["tokens_by_source"].values()) == sum(before.values()) + 3 * 2 * 32
    assert data.val["web"].seq_len == 32
    uses = long.plan.uses_before(3 * 2)
    assert after["epochs_by_source"]["web"] == round(int(uses[0]) / len(long.train[0]), 4)


def test_a_mixture_phase_inside_a_stage_keeps_its_step(sources):
    data = data_section(f"web={sources['web']}:1", phase=f"{SWITCH + 2}:code={sources['code']}:1")
    run = build_data(data, seed=2, validation=False, stages=STAGES)
    plan = run.segments[1].plan
    # The long stage reads 2 samples a step: the code phase starts 2 steps (4 positions) into it.
    assert plan.starts.tolist() == [0, 4]
    source, _ = plan.sources_and_uses(np.arange(8))
    assert source.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


# ---- a run -------------------------------------------------------------------------------------------------

RUN = ("--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
       "--data.seq_len", "64", "--training.local_batch_size", "4", "--training.steps", "6",
       "--metrics.log_freq", "1", "--validation.freq", "3", "--validation.steps", "1", "--training.deterministic",
       "--checkpoint.enable", "--checkpoint.interval", "1", "--metrics.enable_tensorboard", "false")
LONG = ("--data.phase", f"{SWITCH}:seq_len=128,rope_theta=100000,local_batch_size=2")


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, corpus) -> tuple[Path, str]:
    dump = tmp_path_factory.mktemp("long-run")
    proc = train_here(dump, *RUN, *LONG, corpus=corpus)
    return dump, proc.stderr


def test_a_run_switches_seq_len_and_rope_base_at_its_step(long_run):
    dump, log = long_run
    assert (f"stage 2 of 2 from step {SWITCH}: seq_len 128, rope_theta 100000, global batch 2 (2 a micro-batch, "
            f"1 micro-batch a rank)") in log
    records = metrics(dump)
    assert [(r["step"], r["seq_len"]) for r in records] == [(s, 64 if s < SWITCH else 128) for s in range(1, 7)]
    assert [r.get("tokens_seen") for r in records][1:] == [s * 256 for s in range(2, 7)]  # 4 × 64 = 2 × 128
    assert [r["step"] for r in metrics(dump, "val")] == [3, 6]
    args = {s: json.loads((dump / "checkpoint" / f"step-{s}" / "model_args.json").read_text())["rope_theta"]
            for s in (SWITCH - 1, SWITCH)}
    assert args == {SWITCH - 1: 10000.0, SWITCH: 100000.0}  # what an export of each step rotates with


@pytest.mark.parametrize("step", [SWITCH - 2, SWITCH - 1, SWITCH])  # before, at and after the switch
def test_resume_around_the_switch_repeats_the_losses_bit_for_bit(long_run, tmp_path, corpus, step):
    dump, _ = long_run
    shutil.copytree(dump / "checkpoint" / f"step-{step}", tmp_path / "checkpoint" / f"step-{step}")
    train_here(tmp_path, *RUN, *LONG, corpus=corpus)
    want = losses(dump)
    assert losses(tmp_path) == {s: want[s] for s in range(step + 1, 7)}


def test_a_resume_with_another_stage_table_says_so(long_run, tmp_path, corpus):
    dump, _ = long_run
    shutil.copytree(dump / "checkpoint" / f"step-{SWITCH - 1}", tmp_path / "checkpoint" / f"step-{SWITCH - 1}")
    proc = train_here(tmp_path, *RUN, "--data.phase", f"{SWITCH + 1}:seq_len=128", corpus=corpus)
    assert (f"data.stages: checkpoint from step {SWITCH}: seq_len 128, rope_theta 100000, global batch 2 (2 a "
            f"micro-batch, 1 micro-batch a rank) → config from step {SWITCH + 1}: seq_len 128") in proc.stderr
    assert metrics(tmp_path)[0]["seq_len"] == 64  # step 4 is in the first stage now


@pytest.mark.slow
def test_four_ranks_with_cp_change_the_batch_at_the_switch_and_resume_exactly(tmp_path, corpus):
    """On four ranks (gloo), two data-parallel ranks each splitting their windows over a context group of
    two (--parallel.cp 2), a stage that doubles seq_len and halves the local batch, keeping the global one
    (so doubling the gradient accumulation): a resume from the step before the switch gives the
    uninterrupted losses bit for bit (docs/parallelism.md's long-context stage with cp; resumes at the
    other steps around a switch are the one-rank tests above)."""
    stage = (*RUN, "--training.global_batch_size", "16", "--parallel.cp", "2", "--data.phase",
             f"{SWITCH}:seq_len=128,rope_theta=100000,local_batch_size=2")
    ref = tmp_path / "ref"
    proc = run_train(ref, *stage, nproc=4, corpus=corpus)
    assert "× cp 2)" in proc.stdout + proc.stderr
    want = losses(ref)
    assert sorted(want) == list(range(1, 7))
    step = SWITCH - 1
    dump = tmp_path / f"from-{step}"
    shutil.copytree(ref / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    run_train(dump, *stage, nproc=4, corpus=corpus)
    assert losses(dump) == {s: want[s] for s in range(step + 1, 7)}


def test_out_of_memory_in_a_long_stage_names_the_stage_s_knobs():
    from titanlike.process.faults import oom_message

    cfg = load_config(["--training.local_batch_size", "4", "--data.phase", "5:seq_len=128,local_batch_size=2"])
    run = resolve_run(cfg, 1)
    line = oom_message(cfg, run.dims, 0, 7, None, stage=run.stages[1])
    assert "the stage from step 5: local batch 2 × seq_len 128; to use less:" in line
    assert ("local_batch_size = 1, global_batch_size = 2 in the data.phase stage from step 5 (the same global batch "
            "in 2 gradient-accumulation micro-batches)") in line
    assert "training.local_batch_size 4 × data.seq_len 256" in oom_message(cfg, run.dims, 0, 3, None,
                                                                          stage=run.stages[0])
