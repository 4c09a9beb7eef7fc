"""Weighted mixtures of prepared datasets: the plan (titanlike/data/mixture.py) as a pure function of
the position, the [data] options that name it, and a trainer run that reports and resumes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import build_data, losses, metrics, run_train, seal, train_here
from titanlike.config import ConfigError, load_config, to_toml
from titanlike.config.dataset import DatasetError
from titanlike.data.loader import GlobalBatchSampler
from titanlike.data.mixture import MixturePlan, block_counts
from titanlike.data.order import EpochOrder
from titanlike.data.prepare.driver import prepare
from titanlike.preflight import check

# ---- the plan: positions -> (source, window) ------------------------------------------------------------


def plan3(seed: int = 0) -> MixturePlan:
    return MixturePlan([50_000, 300, 20], [(0, {0: 0.6, 1: 0.3, 2: 0.1})], seed, salts=[1, 2, 3])


def test_each_source_gets_its_share_over_1000_steps():
    """1,000 steps of a global batch of 8: each source's token share within 1 % of its weight."""
    for weights in ({0: 0.6, 1: 0.3, 2: 0.1}, {0: 0.7, 1: 0.3}, {0: 1 / 3, 1: 1 / 3, 2: 1 / 3}):
        plan = MixturePlan([5000, 300, 20], [(0, weights)], seed=4, salts=[1, 2, 3])
        source, _ = plan.sources_and_uses(np.arange(1000 * 8))
        share = np.bincount(source, minlength=3) / source.size
        for s, w in weights.items():
            assert abs(share[s] - w) < 0.01, (weights, share)
    assert block_counts([0.7, 0.3], 1024) == [717, 307] and sum(block_counts([1, 1, 1], 1024)) == 1024


def test_sources_interleave_within_a_block():
    source, _ = plan3().sources_and_uses(np.arange(1024))
    runs = np.flatnonzero(np.diff(source)).size + 1
    assert runs > 300  # dealt out, not 614 of one source then 307 of the next


def test_every_use_of_a_source_is_its_next_window_and_a_small_source_repeats_in_a_new_order():
    plan = plan3()
    positions = np.arange(20_000)
    source, use = plan.sources_and_uses(positions)
    windows = plan.windows(positions)
    for s, n in enumerate((50_000, 300, 20)):
        assert np.array_equal(use[source == s], np.arange((source == s).sum()))  # uses in position order
        local = windows[source == s] - plan.offsets[s]
        assert local.min() >= 0 and local.max() < n
        epochs = [local[e * n:(e + 1) * n] for e in range(local.size // n)]
        for epoch in epochs:
            assert np.array_equal(np.sort(epoch), np.arange(n))  # each window once an epoch
        if len(epochs) > 1:
            assert not np.array_equal(epochs[0], epochs[1])  # a new order every epoch
    assert (source == 0).sum() < 50_000  # the large source has not come round yet: no repeats


def test_uses_before_is_what_was_read_also_across_phases():
    # A second phase from position 3000 (not a block boundary) without source 0, then a third.
    plan = MixturePlan([400, 300, 50], [(0, {0: 0.5, 1: 0.5}), (3001, {1: 0.2, 2: 0.8}), (6999, {0: 1.0})],
                       seed=2, salts=[1, 2, 3])
    source, use = plan.sources_and_uses(np.arange(9000))
    for position in (0, 1, 1023, 1024, 3000, 3001, 3002, 5000, 6999, 7000, 9000):
        assert np.array_equal(plan.uses_before(position), np.bincount(source[:position], minlength=3)), position
    for s in range(3):  # a source goes on where it stopped: uses stay consecutive over phases
        assert np.array_equal(use[source == s], np.arange((source == s).sum()))
    assert set(source[3001:6999].tolist()) == {1, 2} and set(source[6999:].tolist()) == {0}
    assert plan.phase_weights(0).tolist() == pytest.approx([0.5, 0.5, 0], abs=1e-3)


def test_one_source_reads_the_plain_epoch_order():
    plan = MixturePlan([777], [(0, {0: 1.0})], seed=5, salts=[0])
    assert np.array_equal(plan.windows(np.arange(3000)), EpochOrder(777, 5).windows(np.arange(3000)))


def step_windows(plan, world: int, steps: int, local: int = 2, global_batch: int = 8, start: int = 0) -> list:
    """Each step's windows over all ranks (sorted), from every rank's own sampler."""
    out: list[list[int]] = [[] for _ in range(steps)]
    for rank in range(world):
        it = iter(GlobalBatchSampler(plan, local, global_batch, rank, world, start_step=start))
        for s in range(steps):
            for _ in range(global_batch // (local * world)):
                out[s] += next(it)
    return [sorted(w) for w in out]


def test_a_mixture_is_the_same_at_any_world_size_and_resumes_at_any_step():
    full = step_windows(plan3(), 1, 40)
    assert step_windows(plan3(), 2, 40) == step_windows(plan3(), 4, 40) == full
    for start in (1, 13, 39):
        assert step_windows(plan3(), 2, 40 - start, start=start) == full[start:]


# ---- prepared sources, the loader, the config ----------------------------------------------------------------


def prepared(root: Path, name: str, n_docs: int, word: str) -> str:
    """A folder titanlike-prepare wrote: n_docs documents of `word`s, every 5th held out for validation."""
    text = root / f"{name}-text"
    text.mkdir(parents=True)
    for i in range(n_docs):
        (text / f"{i:03d}.txt").write_text(f"{word} {i} " * (20 + i % 7))
    prepare(str(root / name), [str(text)], workers=1, val_fraction=0.2)
    return str(root / name)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mix")
    return {"web": prepared(root, "web", 60, "web page"), "code": prepared(root, "code", 15, "def f(): return")}


def data_section(mix: str, workers: int = 0, **schedule) -> SimpleNamespace:
    return SimpleNamespace(**{"mix": mix, "path": "", "val_path": "", "seq_len": 16, "num_workers": workers,
                              "anneal_mix": "", "anneal_from_step": 0, "phase": "", **schedule})


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_a_mixture_with_any_workers_and_counts_what_it_read(sources, workers):
    mix = f"web={sources['web']}:0.7,code={sources['code']}:0.3"

    def run_data(w):
        data = data_section(mix, w)
        return build_data(data, seed=1, validation=True)

    reference = run_data(0)
    batches = [next(reference.loader) for _ in range(2 * 12)]  # 12 steps of 2 micro-batches
    read = reference.read_by_source()
    assert sum(read["tokens_by_source"].values()) == 12 * 4 * 16
    code_windows = len(reference.train[1])
    assert read["epochs_by_source"]["code"] == pytest.approx(read["tokens_by_source"]["code"] / 16 / code_windows,
                                                             abs=1e-4)
    assert set(reference.val) == {"web", "code"}
    resumed = run_data(workers)
    resumed.loader.load_state_dict({"batches_read": 5, "order": "feistel"})
    again = [next(resumed.loader) for _ in range(2 * 7)]
    assert all(torch.equal(a, b) for a, b in zip(batches[10:], again))


def test_mix_as_toml_tables_is_the_string(tmp_path, sources):
    web, code = sources["web"], sources["code"]
    toml = tmp_path / "mix.toml"
    toml.write_text(f'[[data.mix]]\nname = "web"\npath = "{web}"\nweight = 0.7\n\n'
                    f'[[data.mix]]\nname = "code"\npath = "{code}"\nweight = 0.3\n')
    cfg = load_config(["--job.config_file", str(toml)])
    assert cfg.data.mix == f"web={web}:0.7,code={code}:0.3"
    assert load_config(["--data.mix", cfg.data.mix]).data == cfg.data
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))  # config.toml writes the string form, which reads back the same
    assert load_config(["--job.config_file", str(again)]).data == cfg.data
    toml.write_text(f'[[data.mix]]\nname = "web"\npath = "{web}"\n')
    with pytest.raises(ConfigError, match=r"^data.mix in .*mix.toml: a \[\[data.mix\]\] table has keys name, path "
                                          r"and weight \(this one lacks weight\)$"):
        load_config(["--job.config_file", str(toml)])
    toml.write_text(f'[[data.mix]]\npath = "{web}"\nweight = 1\nwieght = 2\n')
    with pytest.raises(ConfigError, match=r"table has keys name, path and weight \(this one lacks name and has "
                                          r"wieght\)$"):
        load_config(["--job.config_file", str(toml)])
    toml.write_text(f'[[data.mix]]\nname = "web"\npath = "{web}"\nweight = true\n')
    with pytest.raises(ConfigError, match="source web's weight True is not a number"):
        load_config(["--job.config_file", str(toml)])


def test_preflight_refuses_sources_of_two_tokenizers_or_none(tmp_path, sources):
    other = tmp_path / "other"
    shutil.copytree(sources["code"], other)
    record = json.loads((other / "dataset.json").read_text())
    (other / "dataset.json").write_text(json.dumps({**record, "vocab_size": 300}))
    cfg = load_config(["--data.mix", f"web={sources['web']}:1,code={other}:1"])
    with pytest.raises(DatasetError) as e:
        check(cfg, 1)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"data sources web ({sources['web']}/dataset.json: byte tokenizer, 258 ids")
    assert f"code ({other}/dataset.json" in message
    assert "300 ids" in message and "were tokenized differently" in message
    (other / "dataset.json").unlink()
    cfg = load_config(["--data.mix", f"web={sources['web']}:1,code={other}:1"])
    with pytest.raises(DatasetError, match=f"data source code: {other} has no dataset.json"):
        check(cfg, 1)
    good = load_config(["--data.mix", f"web={sources['web']}:1,code={sources['code']}:1", "--data.seq_len", "16"])
    assert check(good, 2).dims.dp_shard == 2


# ---- through the trainer ------------------------------------------------------------------------------------

RUN = ("--training.steps", "4", "--data.seq_len", "16", "--training.local_batch_size", "2",
       "--training.global_batch_size", "4", "--metrics.log_freq", "1", "--validation.freq", "2",
       "--validation.steps", "1", "--checkpoint.enable", "--checkpoint.interval", "2", "--training.deterministic")


def test_a_mixture_run_reports_each_source_and_resumes_exactly(tmp_path, sources):
    mix = ("--data.mix", f"web={sources['web']}:0.7,code={sources['code']}:0.3")
    ref = tmp_path / "ref"
    proc = train_here(ref, *RUN, *mix)
    step_tokens = {}
    for r in metrics(ref):
        by_source = r["tokens_by_source"]
        assert set(by_source) == {"web", "code"} and sum(by_source.values()) == r["step"] * 4 * 16
        assert set(r["epochs_by_source"]) == {"web", "code"}
        # Each source's training loss in the logged step: weighted by its tokens in that step, the loss.
        step_tokens = {n: t - step_tokens.get(n, 0) for n, t in by_source.items()}
        read = {n: t for n, t in step_tokens.items() if t}
        assert set(r["loss_by_source"]) == set(read)
        weighted = sum(r["loss_by_source"][n] * t for n, t in read.items()) / sum(read.values())
        assert weighted == pytest.approx(r["loss"], rel=1e-5)
        step_tokens = by_source
    val = metrics(ref, "val")
    assert [(r["step"], r.get("source")) for r in val] == [(2, "web"), (2, "code"), (2, None),
                                                           (4, "web"), (4, "code"), (4, None)]
    web, code, total = val[:3]
    assert total["loss"] == pytest.approx(0.7 * web["loss"] + 0.3 * code["loss"], rel=2e-3)
    lines = [line for line in proc.stderr.splitlines() if " val step " in line]
    assert len(lines) == 2 and " | web " in lines[0] and " | code " in lines[0]  # one line a validation
    train_lines = [line for line in proc.stderr.splitlines() if " train step " in line]
    assert len(train_lines) == 4 and "tokens_by_source" not in proc.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(ref / "tb"))
    tb.Reload()
    assert {"train/tokens_by_source/web", "train/epochs_by_source/code", "train/loss_by_source/web",
            "train/loss_by_source/code", "val/web/loss", "val/code/ppl", "val/loss"} <= set(tb.Tags()["scalars"])
    assert [e.value for e in tb.Scalars("val/code/loss")] == pytest.approx([r["loss"] for r in val if r.get("source")
                                                                             == "code"])

    resumed = tmp_path / "resumed"
    shutil.copytree(ref / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    seal(str(resumed / "checkpoint" / "step-2"), 2)
    train_here(resumed, *RUN, *mix, "--data.num_workers", "1")
    want, got = losses(ref), losses(resumed)
    assert {s: got[s] for s in (3, 4)} == {s: want[s] for s in (3, 4)}
    assert metrics(resumed)[-1]["tokens_by_source"] == metrics(ref)[-1]["tokens_by_source"]
    assert metrics(resumed)[-1]["loss_by_source"] == metrics(ref)[-1]["loss_by_source"]


def test_per_source_losses_leave_the_loss_as_it_was(tmp_path, sources, corpus, monkeypatch):
    """Reading each source's loss changes no loss: a mixture's losses are bit for bit those of the same
    run with the plain loss function; a run on one source logs no per-source loss at all."""
    from titanlike import trainer
    from titanlike.model.loss import build_loss

    mix = ("--data.mix", f"web={sources['web']}:0.7,code={sources['code']}:0.3")
    short = ("--training.steps", "3", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
             "--data.seq_len", "16", "--metrics.log_freq", "1", "--training.deterministic")
    train_here(tmp_path / "mixed", *short, *mix)

    def plain(chunk_tokens, compile, compile_head=False, per_token=False):  # no token losses to speak of
        loss_fn = build_loss(chunk_tokens, compile, compile_head)
        if not per_token:
            return loss_fn
        return lambda model, inputs, targets, context=None: (loss_fn(model, inputs, targets, context),
                                                             torch.zeros(targets.shape))

    monkeypatch.setattr(trainer, "build_loss", plain)
    train_here(tmp_path / "plain", *short, *mix)
    assert losses(tmp_path / "mixed") == losses(tmp_path / "plain") and len(losses(tmp_path / "plain")) == 3

    def never(*args, per_token=False, **kwargs):
        assert not per_token, "a run on one source builds the plain loss alone"
        return build_loss(*args, **kwargs)

    monkeypatch.setattr(trainer, "build_loss", never)  # one source: the plain loss path, as before
    train_here(tmp_path / "one", *short, corpus=corpus)
    assert all("loss_by_source" not in r for r in metrics(tmp_path / "one")) and len(losses(tmp_path / "one")) == 3


@pytest.mark.slow
def test_per_source_losses_over_two_ranks(tmp_path, sources):
    """On two ranks each source's loss adds up every rank's tokens of the step: weighted by the step's
    tokens per source, the per-source losses give the (rank-averaged) loss."""
    mix = ("--data.mix", f"web={sources['web']}:0.7,code={sources['code']}:0.3")
    run_train(tmp_path, "--training.steps", "3", "--training.local_batch_size", "2", "--training.global_batch_size",
              "8", "--data.seq_len", "16", "--metrics.log_freq", "1", "--validation.enable", "false", *mix, nproc=2)
    before = {"web": 0, "code": 0}
    for r in metrics(tmp_path):
        step = {n: t - before[n] for n, t in r["tokens_by_source"].items()}
        read = {n: t for n, t in step.items() if t}
        assert set(r["loss_by_source"]) == set(read) and sum(read.values()) == 8 * 16
        weighted = sum(r["loss_by_source"][n] * t for n, t in read.items()) / sum(read.values())
        assert weighted == pytest.approx(r["loss"], rel=1e-5)
        before = r["tokens_by_source"]
