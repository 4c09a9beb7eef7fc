"""A mixture schedule: a second mixture from a given step (data.anneal_mix) or a list of phases
([[data.phase]]), exact on resume before, at and after a switch, and a schedule changed on resume."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from conftest import build_data, losses, metrics, seal, train_here
from test_data_mixture import data_section, prepared, step_windows
from titanlike.config import ConfigError, load_config
from titanlike.config.sources import schedule_of


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("schedule")
    return {"web": prepared(root, "web", 40, "web page"), "code": prepared(root, "code", 15, "def f(): return"),
            "books": prepared(root, "books", 20, "Chapter one. It was")}


SWITCH = 6  # the first step of the second mixture


def run_data(sources, workers=0, anneal=SWITCH):
    data = data_section(f"web={sources['web']}:0.7,code={sources['code']}:0.3", workers,
                        anneal_mix=f"books={sources['books']}:0.5,web={sources['web']}:0.5", anneal_from_step=anneal)
    return build_data(data, seed=2, validation=True)


def test_the_second_mixture_starts_at_its_step_and_a_shared_source_goes_on(sources):
    data = run_data(sources)
    names = data.names
    assert names == ["web", "code", "books"]
    source, use = data.plan.sources_and_uses(np.arange(12 * 4))
    first, second = source[: (SWITCH - 1) * 4], source[(SWITCH - 1) * 4:]
    assert names.index("books") not in first.tolist() and names.index("code") not in second.tolist()
    web = use[source == names.index("web")]
    assert np.array_equal(web, np.arange(web.size))  # web's windows go on across the switch, none repeated
    assert data.plan.phase_weights((SWITCH - 1) * 4).tolist() == pytest.approx([0.5, 0, 0.5])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_before_at_and_after_the_switch_is_exact(sources, workers):
    reference = run_data(sources)
    batches = [next(reference.loader) for _ in range(2 * 10)]
    for resume_at in (SWITCH - 2, SWITCH - 1, SWITCH, SWITCH + 1):  # batches read when the checkpoint was saved
        resumed = run_data(sources, workers)
        resumed.loader.load_state_dict({"batches_read": resume_at, "order": "feistel"})
        again = [next(resumed.loader) for _ in range(2 * (10 - resume_at))]
        assert all(torch.equal(a, b) for a, b in zip(batches[2 * resume_at:], again)), resume_at
    full = step_windows(reference.plan, 1, 10, global_batch=4)
    assert step_windows(reference.plan, 2, 10, global_batch=4) == full  # any world size, across the switch
    assert step_windows(reference.plan, 2, 10 - SWITCH, global_batch=4, start=SWITCH) == full[SWITCH:]


def test_phase_tables_in_toml_and_the_cli_form(tmp_path, sources):
    web, books, code = sources["web"], sources["books"], sources["code"]
    toml = tmp_path / "phases.toml"
    toml.write_text(f'[data]\nmix = "web={web}:1"\n[training]\nsteps = 100\n'
                    f'[[data.phase]]\nfrom_step = 50\nmix = "books={books}:0.5,web={web}:0.5"\n'
                    f'[[data.phase]]\nfrom_step = 90\n'
                    f'[[data.phase.mix]]\nname = "code"\npath = "{code}"\nweight = 1\n')
    cfg = load_config(["--job.config_file", str(toml)])
    assert cfg.data.phase == f"50:books={books}:0.5,web={web}:0.5;90:code={code}:1"
    steps = [(p.start_step, [s.name for s in p.sources]) for p in schedule_of(cfg.data).phases]
    assert steps == [(1, ["web"]), (50, ["books", "web"]), (90, ["code"])]
    assert load_config(["--data.mix", f"web={web}:1", "--data.phase", cfg.data.phase]).data == cfg.data
    toml.write_text(f'[data]\nmix = "web={web}:1"\n[[data.phase]]\nstep = 50\nmix = "books={books}:1"\n')
    with pytest.raises(ConfigError, match=r"a \[\[data.phase\]\] table has keys from_step and mix \(not mix, step\)"):
        load_config(["--job.config_file", str(toml)])


RUN = ("--training.steps", "4", "--data.seq_len", "16", "--training.local_batch_size", "2",
       "--training.global_batch_size", "4", "--metrics.log_freq", "1", "--validation.enable", "false",
       "--checkpoint.enable", "--checkpoint.interval", "1", "--training.deterministic",
       "--metrics.enable_tensorboard", "false")


def test_trainer_resumes_across_the_switch_and_logs_a_changed_schedule(tmp_path, sources):
    mix = ("--data.mix", f"web={sources['web']}:0.7,code={sources['code']}:0.3",
           "--data.anneal_mix", f"books={sources['books']}:0.5,web={sources['web']}:0.5")
    ref = tmp_path / "ref"
    train_here(ref, *RUN, *mix, "--data.anneal_from_step", "3")
    want = losses(ref)
    records = metrics(ref)
    assert records[1]["tokens_by_source"]["books"] == 0 < records[2]["tokens_by_source"]["books"]
    for step in (2, 3):  # saved before the switch (step 3 reads the second mixture), and at it
        dump = tmp_path / f"from-{step}"
        shutil.copytree(ref / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
        seal(str(dump / "checkpoint" / f"step-{step}"), step)
        proc = train_here(dump, *RUN, *mix, "--data.anneal_from_step", "3")
        assert {s: losses(dump)[s] for s in range(step + 1, 5)} == {s: want[s] for s in range(step + 1, 5)}
        assert "data.schedule" not in proc.stderr
    changed = tmp_path / "changed"
    shutil.copytree(ref / "checkpoint" / "step-2", changed / "checkpoint" / "step-2")
    seal(str(changed / "checkpoint" / "step-2"), 2)
    proc = train_here(changed, *RUN, *mix, "--data.anneal_from_step", "4")
    lines = [line for line in proc.stderr.splitlines() if "data.schedule" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "data.schedule: checkpoint from step 1: web 0.7, code 0.3; from step 3: books 0.5, web 0.5 → config "
        "from step 1: web 0.7, code 0.3; from step 4: books 0.5, web 0.5"), lines
    assert losses(changed)[3] != want[3]  # step 3 reads the first mixture now, as configured


def test_data_path_with_an_anneal_is_a_source_named_data(sources):
    data = data_section("", path=f"{sources['web']}/train", val_path=f"{sources['web']}/val",
                        anneal_mix=f"books={sources['books']}/train:1", anneal_from_step=3)
    run = build_data(data, seed=2, validation=True)
    assert run.names == ["data", "books"] and set(run.val) == {"data", "books"}  # books/train: val/ beside it
    source, _ = run.plan.sources_and_uses(np.arange(4 * 4))
    assert set(source[:8].tolist()) == {0} and set(source[8:].tolist()) == {1}
    # Without a schedule, data.path reads the plain order of its windows.
    plain_data = data_section("", path=f"{sources['web']}/train")
    plain = build_data(plain_data, seed=2, validation=True)
    assert plain.names == ["data"] and not plain.mixed and not plain.val
    assert plain.read_by_source() == {"tokens_by_source": {"data": 0}, "epochs_by_source": {"data": 0.0}}
