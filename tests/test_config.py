"""The job configuration: TOML + `--section.key value` overrides, validation, and the launcher's checks."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import tomllib
import traceback
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, _env
from titanlike.config import ConfigError, JobConfig, field_docs, load_config, schema, sections, speed, to_toml
from titanlike.config import optimizer as optimizer_section
from titanlike.config.dims import resolve_dims
from titanlike.data.shards import DataError, write_shard
from titanlike.preflight import check, resolved

DEBUG_TOML = str(ROOT / "train_configs" / "debug_model.toml")


def preflight(cfg: JobConfig, world: int) -> tuple[int, int, int, int]:
    """The preflight's checks at this world size: (dp_replicate, dp_shard, global batch, micro-batches)."""
    dims = check(cfg, world).dims
    return dims.dp_replicate, dims.dp_shard, dims.global_batch, dims.accum_steps


def error_of(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    msg = str(e.value)
    assert "\n" not in msg, f"a config error must be one line: {msg!r}"
    return msg


# ---- parsing the command line -------------------------------------------------------------------


def test_defaults_without_arguments():
    cfg = load_config([])
    assert cfg == JobConfig()


def test_space_and_equals_forms():
    a = load_config(["--training.steps", "7", "--optimizer.lr", "0.01", "--job.dump_folder", "/tmp/x"])
    b = load_config(["--training.steps=7", "--optimizer.lr=0.01", "--job.dump_folder=/tmp/x"])
    assert a == b
    assert a.training.steps == 7 and isinstance(a.training.steps, int)
    assert a.optimizer.lr == 0.01 and isinstance(a.optimizer.lr, float)
    assert a.job.dump_folder == "/tmp/x"


def test_negative_numbers_are_values_not_options():
    cfg = load_config(["--parallel.dp_shard", "-1", "--checkpoint.load_step", "-1", "--training.steps", "3"])
    assert cfg.parallel.dp_shard == -1 and cfg.checkpoint.load_step == -1 and cfg.training.steps == 3


def test_dashes_in_names_mean_underscores():
    assert load_config(["--training.local-batch-size", "3"]).training.local_batch_size == 3


def test_boolean_flags():
    assert JobConfig().compile.enable is False
    assert load_config(["--compile.enable"]).compile.enable is True
    # A bare flag followed by another option is still a bare flag.
    cfg = load_config(["--compile.enable", "--training.steps", "5"])
    assert cfg.compile.enable is True and cfg.training.steps == 5
    assert load_config(["--compile.enable", "false"]).compile.enable is False
    assert load_config(["--compile.enable=false"]).compile.enable is False
    assert load_config(["--compile.enable", "true"]).compile.enable is True
    assert load_config(["--metrics.enable_tensorboard", "false"]).metrics.enable_tensorboard is False
    # Optional booleans: unset means "decide for me"; none/auto unset them again.
    assert load_config(["--model.tie_embeddings"]).model.tie_embeddings is True
    assert load_config(["--model.tie_embeddings", "false"]).model.tie_embeddings is False
    assert load_config(["--model.tie_embeddings", "none"]).model.tie_embeddings is None


def test_comma_lists():
    cfg = load_config(["--optimizer.betas", "0.8,0.99", "--fp8.filter_fqns", "output,wq"])
    assert cfg.optimizer.betas == [0.8, 0.99] and all(isinstance(b, float) for b in cfg.optimizer.betas)
    assert cfg.fp8.filter_fqns == ["output", "wq"]
    assert load_config(["--fp8.filter_fqns", " output , wq "]).fp8.filter_fqns == ["output", "wq"]
    assert load_config(["--fp8.filter_fqns", ""]).fp8.filter_fqns == []
    assert "expected a number" in error_of(["--optimizer.betas", "0.9,x"])


def test_defaults_are_not_shared_between_instances():
    a, b = JobConfig(), JobConfig()
    a.optimizer.betas.append(0.5)
    a.fp8.filter_fqns.append("wq")
    assert b.optimizer.betas == [0.9, 0.95] and b.fp8.filter_fqns == ["output"]


# ---- TOML and precedence --------------------------------------------------------------------------


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_precedence_default_toml_cli(tmp_path):
    path = write_toml(tmp_path, '[training]\nsteps = 7\nlocal_batch_size = 3\n[optimizer]\nbetas = [0.5, 0.6]\n')
    cfg = load_config(["--job.config_file", path, "--training.steps", "9"])
    assert cfg.training.steps == 9  # CLI over TOML
    assert cfg.training.local_batch_size == 3  # TOML over default
    assert cfg.optimizer.betas == [0.5, 0.6]
    assert cfg.training.max_norm == JobConfig().training.max_norm  # default where neither says
    # The CLI wins whatever its position relative to --job.config_file.
    cfg = load_config(["--training.steps", "9", "--job.config_file", path])
    assert cfg.training.steps == 9 and cfg.training.local_batch_size == 3


def test_debug_model_toml_loads():
    cfg = load_config(["--job.config_file", DEBUG_TOML])
    raw = tomllib.loads(Path(DEBUG_TOML).read_text())
    for section, table in raw.items():
        for key, value in table.items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"


def test_toml_errors(tmp_path):
    assert "no such file" in error_of(["--job.config_file", str(tmp_path / "missing.toml")])
    bad = write_toml(tmp_path, "[training\nsteps = 3\n")
    assert "not valid TOML" in error_of(["--job.config_file", bad])
    top = write_toml(tmp_path, "steps = 3\n")
    assert "must be a [section] table" in error_of(["--job.config_file", top])
    msg = error_of(["--job.config_file", write_toml(tmp_path, "[training]\nstepz = 3\n")])
    assert "training.stepz" in msg and "job.toml" in msg and "did you mean training.steps" in msg
    assert "expected an integer" in error_of(["--job.config_file", write_toml(tmp_path, "[training]\nsteps = 7.5\n")])
    assert "expected a number" in error_of(["--job.config_file", write_toml(tmp_path, "[optimizer]\nlr = true\n")])
    assert "comma-separated list" in error_of(["--job.config_file", write_toml(tmp_path, "[optimizer]\nbetas = 0.9\n")])


def test_a_mistyped_config_file_gets_a_did_you_mean(tmp_path, monkeypatch):
    """The closest .toml name in the folder given, or in the shipped train_configs/ when the folder is mistyped
    too; no hint when nothing is close."""
    (tmp_path / "mine.toml").write_text("[training]\nsteps = 3\n")
    assert error_of(["--job.config_file", str(tmp_path / "mien.toml")]) == (
        f"job.config_file = '{tmp_path}/mien.toml': no such file; did you mean {tmp_path}/mine.toml?")
    assert error_of(["--job.config_file", str(tmp_path / "zzzz.toml")]).endswith(": no such file")
    monkeypatch.chdir(ROOT)
    assert error_of(["--job.config_file", "train_configs/llama3_8B.toml"]).endswith(
        "no such file; did you mean train_configs/llama3_8b.toml?")
    assert error_of(["--job.config_file", "train_config/debug_model.toml"]).endswith(
        "no such file; did you mean train_configs/debug_model.toml?")


def test_a_toml_string_where_a_number_goes_is_refused_as_on_the_command_line(tmp_path):
    """`seq_len = "128"` was read as 128 while `--training.steps ten` is refused: TOML has numbers, booleans and
    arrays, and a quoted one is a string; refused in the command line's words, saying how to write it."""
    quoted = "(a TOML string in quotes is text: write the value without quotes)"
    cases = [('[data]\nseq_len = "128"\n', f"data.seq_len = '128' is not valid: expected an integer {quoted}"),
             ('[optimizer]\nlr = "3e-4"\n', f"optimizer.lr = '3e-4' is not valid: expected a number {quoted}"),
             ('[compile]\nenable = "true"\n', f"compile.enable = 'true' is not valid: expected true or false {quoted}"),
             ('[optimizer]\nbetas = "0.9,0.95"\n',
              "optimizer.betas = '0.9,0.95' is not valid: expected a comma-separated list of a number (a TOML string "
              "in quotes is text: write an array, [a, b])"),
             ('[training]\nfit_gib = "31"\n', "training.fit_gib = '31' is not valid: expected a number or auto")]
    for text, expected in cases:
        assert error_of(["--job.config_file", write_toml(tmp_path, text)]) == expected
    # Where a string is one of the values (auto, none, a list of names), and on the command line, as before.
    strings = '[training]\nfit_gib = "auto"\n[model]\ntie_embeddings = "none"\n[fp8]\nfilter_fqns = "output"\n'
    cfg = load_config(["--job.config_file", write_toml(tmp_path, strings), "--data.seq_len", "128"])
    assert (cfg.training.fit_gib, cfg.model.tie_embeddings, cfg.fp8.filter_fqns, cfg.data.seq_len) == (
        "auto", None, ["output"], 128)


# ---- what a mistake looks like ---------------------------------------------------------------------


def test_unknown_key_names_the_closest():
    msg = error_of(["--training.stepz", "1"])
    assert msg.startswith("unknown config key training.stepz") and "did you mean training.steps?" in msg
    # The same key in another section is the likeliest intent.
    assert "did you mean optimizer.lr?" in error_of(["--training.lr", "1e-3"])
    # Nothing close: list the section's valid keys.
    msg = error_of(["--training.zzzzzzzz", "1"])
    assert "valid:" in msg and "training.steps" in msg and "training.local_batch_size" in msg


def test_unknown_section():
    msg = error_of(["--trainig.steps", "3"])
    assert "unknown config section [trainig]" in msg and "did you mean training?" in msg
    msg = error_of(["--zzz.steps", "3"])
    assert "valid:" in msg and "optimizer" in msg


def test_malformed_arguments():
    assert "unexpected argument 'steps'" in error_of(["steps"])
    assert "needs a section" in error_of(["--steps", "3"])


def test_wrong_types():
    assert error_of(["--training.steps", "abc"]) == "training.steps = 'abc' is not valid: expected an integer"
    assert "expected a number" in error_of(["--optimizer.lr", "fast"])
    assert "expected true or false" in error_of(["--compile.enable", "maybe"])
    assert "expected an integer" in error_of(["--training.steps", "2.5"])
    assert "training.steps" in error_of(["--training.steps"])  # a bare flag on an integer
    assert load_config(["--training.steps", "1_000"]).training.steps == 1000


@pytest.mark.parametrize("key", ["optimizer.lr", "optimizer.weight_decay", "optimizer.eps", "model.rope_theta",
                                 "model.norm_eps", "training.max_norm"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_numbers_are_refused(key, value, tmp_path):
    """An infinite lr once trained a step of non-finite weights and saved it: no float setting takes one,
    on the command line or in TOML (where `inf` and `nan` are literals)."""
    assert error_of([f"--{key}", value]) == f"{key} = '{value}' is not valid: expected a finite number"
    section, name = key.split(".")
    toml = tmp_path / "c.toml"
    toml.write_text(f"[{section}]\n{name} = {value}\n")
    assert "expected a finite number" in error_of(["--job.config_file", str(toml)])


def test_literal_choices():
    msg = error_of(["--fp8.recipe", "rowwse"])
    assert msg.startswith("fp8.recipe = 'rowwse' is not one of none, tensorwise, rowwise, rowwise_with_gw_hp")
    assert "did you mean 'rowwise'?" in msg
    msg = error_of(["--training.device", "gpu"])
    assert "auto, cuda, cpu" in msg
    assert "linear, cosine" in error_of(["--lr_scheduler.decay_type", "exp"])
    for recipe in ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp"):
        assert load_config(["--fp8.recipe", recipe]).fp8.recipe == recipe


# ---- every validation rule in config.py --------------------------------------------------------------

# (overrides, a piece of the message); together they trip every need(...) in config.py.
INVALID = [
    (["--model.flavor", "9b"], "model.flavor = '9b' is not a preset"),
    (["--model.vocab_size", "-1"], "model.vocab_size = -1 must be >= 0"),
    (["--model.dim", "-8"], "model.dim = -8 must be >= 0 (0 = the preset's)"),
    (["--model.attn_mask", "document"], "model.attn_mask = 'document' is not one of causal, block_causal"),
    (["--model.flavor", "hf"], "model.flavor = hf takes the shape from a Hugging Face folder's config.json"),
    (["--model.n_kv_heads", "3"],
     "model shape (debug with the model.* overrides): n_heads = 8 is not divisible by n_kv_heads = 3"),
    (["--data.seq_len", "4"], "data.seq_len = 4 must be at least 8"),
    (["--data.num_workers", "-1"], "data.num_workers = -1 must be >= 0"),
    (["--data.num_workers", "100000"], "data.num_workers = 100000 is more than 4 per CPU core"),
    (["--data.num_workers", "99999999999999999999"], "data.num_workers = 99999999999999999999 is out of range"),
    (["--checkpoint.load_step", "5"], "checkpoint.load_step = 5 resumes from a checkpoint: it needs"),
    (["--model.n_layers", str(10**18)], f"n_layers = {10**18} is more than any model titanlike builds: at most 4,096"),
    (["--model.n_layers", "4000", "--model.dim", "131072"], "parameters is more than any model titanlike builds"),
    (["--training.fit_gib", "1e300"], "training.fit_gib = 1e+300 must be in [0, 1048576] GiB"),
    (["--training.gpu_memory_limit_gib", "1e300"], "training.gpu_memory_limit_gib = 1e+300 must be in [0, 1048576]"),
    (["--activation_checkpoint.mode", "budget", "--compile.enable", "--parallel.overrides", "off"],
     "activation_checkpoint.mode = budget needs the override activation_memory_budget"),
    (["--data.path", "/nonexistent/shards"], "data.path = '/nonexistent/shards': no such file or folder"),
    (["--data.val_path", "/nonexistent/val.bin"], "data.val_path = '/nonexistent/val.bin': no such file"),
    (["--data.mix", "web=/tmp:1", "--data.path", "/tmp"], "data.mix names the training data and each source's val/"),
    (["--data.mix", "web=/tmp:0.7,code=/nonexistent/code:0.3"], "data source code = '/nonexistent/code': no such"),
    (["--data.mix", "web=/tmp:0"], "data.mix = 'web=/tmp:0': source web's weight 0 must be a finite number > 0"),
    (["--data.mix", "web=/tmp:-1"], "source web's weight -1 must be a finite number > 0"),
    (["--data.mix", "web=/tmp:nan"], "source web's weight nan must be a finite number > 0"),
    (["--data.mix", "web=/tmp:inf"], "source web's weight inf must be a finite number > 0"),
    (["--data.mix", "web=/tmp:x"], "source web's weight 'x' is not a number"),
    (["--data.mix", "web=/tmp:1,web=/var:1"], "source name web appears twice"),
    (["--data.mix", "web:1"], "'web:1' is not NAME=FOLDER:WEIGHT"),
    (["--data.mix", "w b=/tmp:1"], "source name 'w b' must be letters, digits"),
    (["--data.mix", "web=:1"], "source web names no folder"),
    (["--data.mix", "web=/tmp:1,tiny=/tmp:1e-9"], "source tiny's share 1e-09 is below 1e-06"),
    (["--data.path", "/tmp", "--data.anneal_mix", "b=/tmp:0", "--data.anneal_from_step", "5"],
     "data.anneal_mix = 'b=/tmp:0': source b's weight 0 must be a finite number > 0"),
    (["--data.path", "/tmp", "--data.phase", "x:b=/tmp:1"], "data.phase = 'x:b=/tmp:1': phase step 'x' is not a whole"),
    (["--data.path", "/tmp", "--data.phase", "b=/tmp"], "'b=/tmp' is not STEP:MIX"),
    (["--data.path", "/tmp", "--data.phase", "9:b=/tmp:1;5:c=/tmp:1"], "phase steps 9, 5 must increase"),
    (["--data.path", "/tmp", "--data.phase", "9:b=/tmp:-2"], "the phase from step 9: source b's weight -2 must be"),
    (["--data.path", "/tmp", "--data.anneal_mix", "b=/tmp:1"],
     "data.anneal_mix and data.anneal_from_step go together: the second mixture and its first step (got 'b=/tmp:1' "
     "from step 0)"),
    (["--data.path", "/tmp", "--data.anneal_from_step", "5"], "data.anneal_mix and data.anneal_from_step go together"),
    (["--data.path", "/tmp", "--data.anneal_from_step", "-1"], "data.anneal_mix and data.anneal_from_step go together"),
    (["--data.path", "/tmp", "--data.anneal_mix", "b=/tmp:1", "--data.anneal_from_step", "5", "--data.phase",
      "7:b=/tmp:1"], "data.anneal_mix is one later mixture and data.phase a list of them: give one of the two"),
    (["--data.anneal_mix", "b=/tmp:1", "--data.anneal_from_step", "5"],
     "a schedule mixes prepared datasets: name the first mixture with data.mix (or data.path)"),
    (["--data.mix", "web=/tmp:1", "--data.anneal_mix", "web=/var:1", "--data.anneal_from_step", "5"],
     "data source web is '/tmp' in data.mix but '/var' in data.anneal_from_step: a name is one dataset"),
    (["--data.path", "/tmp", "--data.anneal_mix", "b=/nonexistent/b:1", "--data.anneal_from_step", "5"],
     "data source b = '/nonexistent/b': no such folder"),
    (["--data.path", "/tmp", "--data.anneal_mix", "b=/tmp:1", "--data.anneal_from_step", "500"],
     "data.anneal_from_step: a mixture from step 500 must start in [2, training.steps = 150]"),
    (["--data.path", "/tmp", "--data.phase", "1:b=/tmp:1"], "data.phase: a mixture from step 1 must start in [2, "),
    (["--training.local_batch_size", "0"], "training.local_batch_size = 0 must be >= 1"),
    (["--training.global_batch_size", "-4"], "training.global_batch_size = -4 must be >= 0"),
    (["--training.local_batch_size", "4", "--training.global_batch_size", "6"],
     "training.global_batch_size = 6 must be a multiple of training.local_batch_size = 4"),
    (["--training.steps", "0"], "training.steps = 0 must be >= 1"),
    (["--training.max_norm", "-1"], "training.max_norm = -1.0 must be >= 0"),
    (["--training.gpu_memory_limit_gib", "-2"], "training.gpu_memory_limit_gib = -2.0 must be in [0, 1048576] GiB"),
    (["--training.fit_gib", "-1"], "training.fit_gib = -1.0 must be in [0, 1048576] GiB"),
    (["--optimizer.lr", "0"], "optimizer.lr = 0.0 must be > 0"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay = -0.1 must be >= 0"),
    (["--optimizer.betas", "0.9"], "optimizer.betas = [0.9] must be two numbers in [0, 1)"),
    (["--optimizer.betas", "0.9,1.0"], "optimizer.betas = [0.9, 1.0] must be two numbers"),
    (["--optimizer.momentum", "1"], "optimizer.momentum = 1.0 must be in [0, 1)"),
    (["--optimizer.ns_steps", "0"], "optimizer.ns_steps = 0 must be in 1..99"),
    (["--optimizer.name", "muon", "--optimizer.state_dtype", "8bit"],
     "optimizer.state_dtype = 8bit does not go with optimizer.name = muon: its AdamW parameters take fp32 or bf16"),
    (["--optimizer.name", "muon", "--parallel.cpu_offload", "--training.device", "cuda"],
     "parallel.cpu_offload runs the optimizer step on the CPU, where with optimizer.name = muon Muon's Newton–Schulz "
     "iterations (bf16 matmuls over every block matrix) would run on the host's CPU: drop --parallel.cpu_offload, or "
     "use --optimizer.name adamw"),
    (["--optimizer.eps", "0"], "optimizer.eps = 0.0 must be > 0"),
    (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps = -1 must be >= 0"),
    (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio = 1.5 must be in [0, 1]"),
    (["--lr_scheduler.min_lr_factor", "2"], "lr_scheduler.min_lr_factor = 2.0 must be in [0, 1]"),
    (["--parallel.dp_shard", "0"], "parallel.dp_shard = 0 must be -1 (all ranks) or >= 1"),
    (["--parallel.dp_replicate", "-2"], "parallel.dp_replicate = -2 must be -1 (the rest) or >= 1"),
    (["--parallel.backend_timeout_s", "0"], "parallel.backend_timeout_s = 0 must be in [1, 1000000]"),
    (["--parallel.cp", "0"], "parallel.cp = 0 must be >= 1 (1 = no context parallelism)"),
    (["--parallel.cp", "2", "--data.seq_len", "64", "--data.phase", "5:seq_len=66"],
     "data.phase: the stage from step 5: seq_len = 66 must be a multiple of 2 × parallel.cp = 4"),
    (["--parallel.cp", "3", "--data.seq_len", "64"],
     "data.seq_len = 64 must be a multiple of 2 × parallel.cp = 6: each of the cp ranks holds 2 of 2·cp equal chunks"),
    (["--parallel.cp", "2", "--data.seq_len", "256", "--model.attn_mask", "block_causal"],
     "model.attn_mask = block_causal with parallel.cp = 2 runs flex attention on a GPU, which can split a window "
     "only into chunks of whole 128-token tiles: data.seq_len = 256 must be a multiple of 512"),
    (["--parallel.backend_timeout_s", "100000000000000"], "parallel.backend_timeout_s = 100000000000000 must be in"),
    (["--job.seed", "-1"], "job.seed = -1 must be in [0, 2^63)"),
    (["--job.seed", str(2**63)], f"job.seed = {2**63} must be in [0, 2^63)"),
    (["--job.dump_folder", ""], "job.dump_folder must not be empty"),
    (["--model.vocab_size", "2000000000"], "model.vocab_size = 2000000000 is too large: at most 2^24"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "²"],
     "activation_checkpoint.selective_ac_option = '²' must be 'op', 'op:' and Linears' names or a positive integer"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op:wqkv,w4"],
     "selective_ac_option = 'op:wqkv,w4': after 'op:' name the Linears whose outputs to keep, each once, of wqkv"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op:"],
     "selective_ac_option = 'op:': after 'op:' name the Linears"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op:w1,w1"],
     "selective_ac_option = 'op:w1,w1': after 'op:' name the Linears"),
    (["--parallel.cpu_offload", "--training.device", "cpu"],
     "parallel.cpu_offload moves weights, gradients and optimizer state from the GPU to host memory: a run with "
     "training.device = cpu has nothing to offload"),
    (["--parallel.cpu_offload", "--fp8.recipe", "tensorwise", "--fp8.enable_fsdp_float8_all_gather", "true"],
     "parallel.cpu_offload cannot all-gather weights in float8"),
    (["--parallel.cpu_offload", "--parallel.dp_replicate", "2"],
     "parallel.cpu_offload works with plain FSDP, not HSDP (parallel.dp_replicate = 2)"),
    (["--parallel.cpu_offload", "--parallel.gradient_sync", "step"],
     "parallel.gradient_sync = step keeps the whole model's gradients on the GPU between micro-batches"),
    (["--parallel.gradient_sync", "once"], "parallel.gradient_sync = 'once' is not one of micro_batch, step"),
    (["--fp8.recipe", "rowwise", "--fp8.enable_fsdp_float8_all_gather"],
     "fp8.enable_fsdp_float8_all_gather needs fp8.recipe = tensorwise (got 'rowwise')"),
    (["--fp8.recipe", "rowwise_with_gw_hp", "--fp8.enable_fsdp_float8_all_gather", "true"],
     "needs fp8.recipe = tensorwise (got 'rowwise_with_gw_hp')"),
    (["--fp8.enable_fsdp_float8_all_gather"], "needs fp8.recipe = tensorwise (got 'none')"),
    (["--fp8.recipe", "tensorwise", "--fp8.enable_fsdp_float8_all_gather", "false",
      "--fp8.precompute_float8_dynamic_scale_for_fsdp"],
     "fp8.precompute_float8_dynamic_scale_for_fsdp needs fp8.enable_fsdp_float8_all_gather"),
    (["--fp8.recipe", "rowwise", "--fp8.scaling", "delayed"],
     "fp8.scaling = delayed needs fp8.recipe = tensorwise (got 'rowwise')"),
    (["--fp8.scaling", "late"], "fp8.scaling = 'late' is not one of dynamic, delayed"),
    (["--fp8.recipe", "tensorwise", "--fp8.amax_history", "0"], "fp8.amax_history = 0 must be in [1, 1024]"),
    (["--fp8.recipe", "tensorwise", "--fp8.scaling", "delayed", "--fp8.amax_history", str(10**18)],
     "fp8.amax_history = 1000000000000000000 must be in [1, 1024] (default 16)"),
    (["--fp8.recipe", "tensorwise", "--fp8.amax_every", "0"], "fp8.amax_every = 0 must be >= 1"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "ops"],
     "activation_checkpoint.selective_ac_option = 'ops': after 'op:' name the Linears"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"],
     "selective_ac_option = '0' must be 'op', 'op:' and Linears' names or a positive integer"),
    (["--activation_checkpoint.memory_budget", "0"], "activation_checkpoint.memory_budget = 0.0 must be in (0, 1]"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_blocks", "2"],
     "activation_checkpoint.selective_ac_blocks = 2 chooses the blocks that follow an op:NAMES option"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op:wqkv,w1",
      "--activation_checkpoint.selective_ac_blocks", "-1"],
     "activation_checkpoint.selective_ac_blocks = -1 must be >= 0 (0 = every block)"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op:wqkv,w1",
      "--activation_checkpoint.selective_ac_blocks", "99"],
     "activation_checkpoint.selective_ac_blocks = 99 is more than the model's 4 blocks"),
    (["--activation_checkpoint.mode", "budget"],
     "activation_checkpoint.mode = budget is carried out by torch.compile's partitioner: set --compile.enable"),
    (["--checkpoint.interval", "0"], "checkpoint.interval = 0 must be >= 1"),
    (["--training.loss_chunk_tokens", "-1"], "training.loss_chunk_tokens = -1 must be >= 0 (0 = off)"),
    (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k = -1 must be >= 0"),
    (["--checkpoint.load_step", "-2"], "checkpoint.load_step = -2 must be -1 (newest) or a step"),
    (["--checkpoint.initial_load_path", "/nonexistent/ckpt"],
     "checkpoint.initial_load_path = '/nonexistent/ckpt': no such"),
    (["--training.nonfinite", "rollback"],
     "training.nonfinite = rollback reloads the last checkpoint: it needs --checkpoint.enable"),
    (["--fp8.health_log_freq", "-1"], "fp8.health_log_freq = -1 must be >= 0 (0 = off)"),
    (["--metrics.log_freq", "0"], "metrics.log_freq = 0 must be >= 1"),
    (["--metrics.wandb_project", "team/run"], "metrics.wandb_project = 'team/run': a W&B project name is 1 to 128"),
    (["--validation.freq", "0"], "validation.freq must be >= 1 and validation.steps >= 0 (0 = all the held-out "
                                 "data) (got 0, 4)"),
    (["--validation.steps", "-1"], "validation.freq must be >= 1 and validation.steps >= 0 (0 = all the held-out "
                                   "data) (got 50, -1)"),
    (["--profiling.freq", "0"], "profiling: need freq >= 1"),
    (["--profiling.warmup", "-1"], "profiling: need"),
    (["--profiling.active", "0"], "profiling: need"),
    (["--profiling.freq", "3", "--profiling.warmup", "3", "--profiling.active", "1"], "(got 3, 3, 1)"),
    (["--profiling.folder", " "], 'profiling.folder must not be empty (default "profile", inside job.dump_folder)'),
    (["--profiling.enable", "--profiling.folder", __file__],
     f"profiling.folder = {__file__!r} is a file: the traces go into a folder"),
    (["--checkpoint.folder", ""], 'checkpoint.folder must not be empty (default "checkpoint", inside job.dump_folder)'),
    (["--checkpoint.folder", "."], "checkpoint.folder = '.' is job.dump_folder itself (./outputs/debug): name a folder "
                                   "inside it (default \"checkpoint\") or elsewhere"),
    (["--job.dump_folder", "/tmp/x", "--checkpoint.folder", "/tmp/x/"], "checkpoint.folder = '/tmp/x/' is "
                                                                        "job.dump_folder itself"),
    (["--data.mix", "a=/tmp:1e308,b=/tmp:1e308"], "the weights add up to more than the largest number (inf)"),
]


@pytest.mark.parametrize("argv,expected", INVALID, ids=[" ".join(a) for a, _ in INVALID])
def test_validation_rejects(argv, expected):
    assert expected in error_of(argv)


# The modules whose need(...) calls are the rules.
SCHEMA_FILES = (schema.__file__, speed.__file__, optimizer_section.__file__)


def _need_call_lines() -> list[tuple[str, range]]:
    """(file, line range) of every need(...) call in the schema's modules: each section's validate()
    and the rules across sections alike, so a rule added anywhere in the schema is found."""
    calls = []
    for file in SCHEMA_FILES:
        tree = ast.parse(Path(file).read_text())
        calls += [(file, range(n.lineno, n.end_lineno + 1)) for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "need"]
    return calls


def test_every_validation_is_exercised():
    """Each need(...) in the schema is tripped by at least one case of INVALID (and no other line raises)."""
    calls = _need_call_lines()
    assert len(calls) >= 25  # the test below would pass vacuously if the AST walk found nothing
    hit = set()
    for argv, _ in INVALID:
        with pytest.raises(ConfigError) as e:
            load_config(argv)
        tb = traceback.extract_tb(e.value.__traceback__)
        if not any(f.filename in SCHEMA_FILES for f in tb):
            continue  # a parse-time error (loader.py), not a validation (none expected, checked below)
        # The innermost frame in the schema outside need() itself is the rule that failed.
        frames = [f for f in tb if f.filename in SCHEMA_FILES and f.name != "need"]
        where = frames[-1]
        owner = [i for i, (file, r) in enumerate(calls) if file == where.filename and where.lineno in r]
        assert owner, f"{argv} raised from {where.filename} line {where.lineno} ({where.name}), outside any need(...)"
        hit.add(owner[0])
    missed = [f"{Path(calls[i][0]).name}:{calls[i][1].start}" for i in range(len(calls)) if i not in hit]
    assert not missed, f"need(...) calls at {missed} have no failing case in INVALID"


def test_every_section_validates_itself():
    """Each section's rules sit on its dataclass: every section has a validate() of its own."""
    for name, cls in sections().items():
        assert "validate" in vars(cls), f"[{name}] ({cls.__name__}) has no validate() method"


def test_valid_edge_values_pass():
    load_config(["--data.seq_len", "8", "--lr_scheduler.decay_ratio", "1", "--lr_scheduler.min_lr_factor", "0",
                 "--training.max_norm", "0", "--activation_checkpoint.mode", "selective",
                 "--activation_checkpoint.selective_ac_option", "2", "--profiling.freq", "4",
                 "--profiling.warmup", "3", "--profiling.active", "1"])
    # The selective option only matters in selective mode.
    load_config(["--activation_checkpoint.mode", "full", "--activation_checkpoint.selective_ac_option", "junk"])
    load_config(["--fp8.recipe", "tensorwise", "--fp8.enable_fsdp_float8_all_gather",
                 "--fp8.precompute_float8_dynamic_scale_for_fsdp"])


# ---- world-size checks: config.dims.resolve_dims and the preflight -------------------------------------------


@pytest.mark.parametrize("world,shard,replicate,expected", [
    (1, -1, 1, (1, 1)),
    (8, -1, 1, (1, 8)),
    (8, -1, 2, (2, 4)),
    (8, 4, -1, (2, 4)),
    (8, 2, 4, (4, 2)),
    (2, 1, 2, (2, 1)),
    (2, 2, 1, (1, 2)),
])
def test_resolve_dims_valid(world, shard, replicate, expected):
    assert resolve_dims(world, shard, replicate) == expected


@pytest.mark.parametrize("world,shard,replicate,expected", [
    (4, 3, 1, "parallel.dp_replicate × parallel.dp_shard = 1 × 3 must equal the 4 ranks"),
    (4, 4, 2, "parallel.dp_replicate × parallel.dp_shard = 2 × 4 must equal the 4 ranks"),
    (2, 2, 2, "parallel.dp_replicate × parallel.dp_shard = 2 × 2 must equal the 2 ranks"),
    (4, -1, 3, "parallel.dp_replicate = 3 does not divide the 4 ranks"),
    (4, 3, -1, "parallel.dp_replicate = -1 needs parallel.dp_shard to be a divisor of the 4 ranks (got 3)"),
    (4, -1, -1, "parallel.dp_replicate = -1 needs parallel.dp_shard to be a divisor"),
])
def test_resolve_dims_invalid(world, shard, replicate, expected):
    with pytest.raises(ConfigError) as e:
        resolve_dims(world, shard, replicate)
    assert expected in str(e.value)


@pytest.mark.parametrize("world,shard,replicate,cp,expected", [
    (2, -1, 1, 2, (1, 1)),  # all ranks split the sequence
    (8, -1, 1, 2, (1, 4)),  # dp_shard = -1: world / (dp_replicate × cp)
    (8, -1, 2, 2, (2, 2)),
    (8, 2, -1, 2, (2, 2)),
    (8, 1, 1, 8, (1, 1)),
])
def test_resolve_dims_with_cp(world, shard, replicate, cp, expected):
    assert resolve_dims(world, shard, replicate, cp) == expected


@pytest.mark.parametrize("world,shard,replicate,cp,expected", [
    (4, -1, 1, 3, "parallel.cp = 3 does not divide the 4 ranks"),
    (8, 4, 1, 4, "parallel.dp_replicate × parallel.dp_shard = 1 × 4 must equal the 2 data-parallel ranks "
                 "(8 ranks / cp 4)"),
    (8, 3, -1, 2, "parallel.dp_replicate = -1 needs parallel.dp_shard to be a divisor of the 4 data-parallel ranks"),
])
def test_resolve_dims_with_cp_invalid(world, shard, replicate, cp, expected):
    with pytest.raises(ConfigError) as e:
        resolve_dims(world, shard, replicate, cp)
    assert expected in str(e.value)


def test_preflight_cp_batch_arithmetic():
    """The cp ranks of a data-parallel group read the same samples: dp = world / cp."""
    cfg = load_config(["--training.local_batch_size", "2", "--training.global_batch_size", "8", "--parallel.cp", "2"])
    assert preflight(cfg, 2) == (1, 1, 8, 4)
    assert preflight(cfg, 4) == (1, 2, 8, 2)
    dims = check(cfg, 4).dims
    assert (dims.cp, dims.dp, dims.fsdp_shard) == (2, 2, 4)
    # block_causal on a CPU: the dense mask takes any 2·cp chunks.
    load_config(["--parallel.cp", "2", "--data.seq_len", "64", "--model.attn_mask", "block_causal",
                 "--training.device", "cpu"])


def test_preflight_batch_arithmetic():
    cfg = load_config(["--training.local_batch_size", "2", "--training.global_batch_size", "8"])
    assert preflight(cfg, 2) == (1, 2, 8, 2)  # 8 = 2 local × 2 ranks × 2 micro-batches
    assert preflight(cfg, 1) == (1, 1, 8, 4)
    assert preflight(cfg, 4) == (1, 4, 8, 1)
    cfg = load_config(["--training.local_batch_size", "2"])  # global 0 = local × DP
    assert preflight(cfg, 4) == (1, 4, 8, 1)
    cfg = load_config(["--training.local_batch_size", "2", "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"])
    assert preflight(cfg, 4) == (2, 2, 8, 1)


def test_preflight_global_batch_not_divisible_by_local_times_dp():
    # 12 is a multiple of the local batch 4 (validate passes) but not of 4 × 2 ranks.
    cfg = load_config(["--training.local_batch_size", "4", "--training.global_batch_size", "12"])
    assert preflight(cfg, 1)[3] == 3
    with pytest.raises(ConfigError) as e:
        preflight(cfg, 2)
    assert str(e.value) == ("training.global_batch_size = 12 must be a multiple of "
                            "training.local_batch_size × data-parallel degree = 4 × 2 = 8")


def test_preflight_world_size_mismatch():
    cfg = load_config(["--parallel.dp_shard", "3"])
    with pytest.raises(ConfigError, match="must equal the 2 ranks"):
        preflight(cfg, 2)


def test_preflight_reads_data_headers(tmp_path):
    shard = tmp_path / "big_ids.bin"
    write_shard(shard, np.array([1, 2, 400, 3] * 100))
    cfg = load_config(["--data.path", str(shard)])
    with pytest.raises(DataError, match="token id 400 .* vocabulary has 320 ids; set --model.vocab_size 401"):
        preflight(cfg, 1)
    cfg = load_config(["--data.path", str(shard), "--model.vocab_size", "401"])
    assert preflight(cfg, 1)[0:2] == (1, 1)


# ---- output: TOML round trip, print_config, docstrings --------------------------------------------


def _without_none(d):
    if isinstance(d, dict):
        return {k: _without_none(v) for k, v in d.items() if v is not None}
    return d


def test_to_toml_round_trip(tmp_path):
    argv = ["--job.config_file", DEBUG_TOML, "--optimizer.betas", "0.85,0.97", "--fp8.filter_fqns", "output,wq",
            "--job.dump_folder", 'odd "name" \\ path', "--optimizer.lr", "1e-30", "--model.tie_embeddings", "false",
            "--fp8.recipe", "tensorwise", "--compile.enable"]
    cfg = load_config(argv)
    text = to_toml(cfg)
    parsed = tomllib.loads(text)
    assert parsed == _without_none(dataclasses.asdict(cfg))
    again = load_config(["--job.config_file", write_toml(tmp_path, text)])
    again.job.config_file = cfg.job.config_file
    assert again == cfg


def test_unset_optionals_round_trip(tmp_path):
    cfg = load_config([])
    assert cfg.model.tie_embeddings is None and cfg.fp8.enable_fsdp_float8_all_gather is None
    assert "tie_embeddings" not in to_toml(cfg)
    again = load_config(["--job.config_file", write_toml(tmp_path, to_toml(cfg))])
    again.job.config_file = ""
    assert again == cfg


def test_non_utf8_config_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[job]\nseed = 1\n# \xff\xfe\n")
    assert error_of(["--job.config_file", str(bad)]) == (
        f"job.config_file = '{bad}' is not UTF-8 text (byte 17): TOML files are UTF-8")


def test_a_warmup_as_long_as_the_run_is_said_at_start(trained_run):
    """A warmup of training.steps or more never reaches optimizer.lr: one start line says so (a trial run of a few
    steps with the default warmup stays legal), in train.log as on the console."""
    from titanlike.config.run import resolve_run

    said = "lr_scheduler.warmup_steps = 10 is not below training.steps = 4: the LR still rises at the last step"
    assert said in (trained_run / "train.log").read_text()  # 4 steps, the default warmup of 10
    for warmup, steps, noted in ((20, 20, True), (10**6, 20, True), (19, 20, False), (0, 1, False)):
        cfg = load_config(["--training.steps", str(steps), "--lr_scheduler.warmup_steps", str(warmup)])
        notes = [n for n in resolve_run(cfg, 1).notes if n.startswith("lr_scheduler.warmup_steps")]
        assert notes == ([f"lr_scheduler.warmup_steps = {warmup} is not below training.steps = {steps}: the LR still "
                          f"rises at the last step and never reaches optimizer.lr = 0.003 (no stable or decay phase); "
                          f"set --lr_scheduler.warmup_steps below {steps} to train at the peak"] if noted else [])


def test_a_config_file_nested_past_the_toml_reader_is_one_line_in_the_preflight(tmp_path, monkeypatch):
    """tomllib recurses once a level: an array nested 5,000 deep was a RecursionError traceback."""
    from conftest import call
    from titanlike import preflight

    deep = write_toml(tmp_path, "[training]\nsteps = " + "[" * 5000 + "]" * 5000 + "\n")
    monkeypatch.setenv(preflight.WORLD_ENV, "1")
    rc, err = call(preflight.main, "--job.config_file", deep)
    assert rc == 2 and err == (f"error: job.config_file = {deep!r} nests arrays or inline tables deeper than the TOML "
                               f"reader goes: no option takes such a value\n"), err


def test_a_config_file_that_is_not_a_file_is_one_line_that_says_so(tmp_path):
    """--job.config_file with no value, a folder, a FIFO (which an open() would block on) or a device: each
    is said as what it is, never as a missing file; a byte-order mark, as some editors write, is read."""
    import os

    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo.toml")
    assert error_of(["--job.config_file"]) == "--job.config_file needs a value: the path of a TOML file"
    assert error_of(["--job.config_file", str(tmp_path / "folder")]).endswith("is a folder; name the TOML file in it")
    for special in (tmp_path / "fifo.toml", Path("/dev/zero")):
        assert error_of(["--job.config_file", str(special)]) == f"job.config_file {special} is not a regular file"
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf[training]\nsteps = 3\n")
    assert load_config(["--job.config_file", str(bom)]).training.steps == 3


def test_a_window_longer_than_any_model_takes_says_so_and_not_to_raise_the_model():
    """Raising model.max_seq_len to such a window would only be refused next: the one line says the limit."""
    for argv, option in ((["--data.seq_len", "99999999999"], "data.seq_len"),
                         (["--data.phase", "2:seq_len=99999999999"], "data.phase: the stage from step 2: seq_len")):
        msg = error_of(argv)
        assert msg == f"{option} = 99999999999 is more than titanlike's models take: at most 16,777,216 tokens", msg


def test_config_toml_round_trips_paths_with_quotes_and_newlines(tmp_path):
    """config.toml must stay valid TOML whatever a path holds (a newline, a quote, a backslash, a tab)."""
    odd = str(tmp_path / 'we"ird\nna\tme\\x\x7f')
    cfg = load_config(["--job.dump_folder", odd])
    again = tomllib.loads(to_toml(cfg))
    assert again["job"]["dump_folder"] == odd


def test_every_field_has_a_docstring():
    assert set(sections()) == {f.name for f in dataclasses.fields(JobConfig)}
    for name, cls in sections().items():
        docs = field_docs(cls)
        fields = [f.name for f in dataclasses.fields(cls)]
        missing = [f for f in fields if not docs.get(f, "").strip()]
        assert not missing, f"[{name}] fields without a docstring: {missing}"
        assert set(docs) == set(fields)


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit) as e:
        load_config(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name, cls in sections().items():
        for f in dataclasses.fields(cls):
            assert f"--{name}.{f.name} " in out


def test_titanlike_train_with_no_config_trains_the_launchers_default_job():
    """`titanlike-train` with no config file and `./run_train.sh` with no arguments (debug_model.toml) are one
    job: the schema's defaults are that file's values."""
    bare, debug = load_config([]), load_config(["--job.config_file", DEBUG_TOML])
    assert dataclasses.replace(debug, job=dataclasses.replace(debug.job, config_file="")) == bare


def test_help_shows_the_values_a_run_uses(capsys):
    """`./run_train.sh --help` passes the launcher's config file (debug_model.toml): each option shows the
    value a run with those arguments would use, in TOML, beside the schema's default."""
    from titanlike import preflight

    assert preflight.main(["--job.config_file", DEBUG_TOML, "--training.steps", "7", "--help"]) == 3
    out = capsys.readouterr().out
    assert '--job.dump_folder = "./outputs/debug"  (a string; default "./outputs/debug")' in out
    assert "--training.steps = 7  (an integer; default" in out  # the command line over the file
    assert "--data.seq_len = 256  (an integer; default" in out
    assert "--model.tie_embeddings = unset" in out
    assert preflight.main(["--training.stepz", "7", "--help"]) == 3  # a typo: the defaults, and why
    out = capsys.readouterr().out
    assert "--training.steps = 150  (an integer; default 150)" in out and "unknown config key training.stepz" in out


# ---- the launcher ---------------------------------------------------------------------------------


def launcher(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = _env()
    env.pop("CONFIG_FILE", None)
    env["NGPU"] = "1"
    env.update(env_extra or {})
    return subprocess.run([str(ROOT / "run_train.sh"), *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_launcher_typo_is_one_line_and_exit_2():
    proc = launcher("--training.stepz", "1")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:") and "training.stepz" in lines[0] and "training.steps" in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_launcher_world_size_error_is_one_line():
    proc = launcher("--parallel.dp_shard", "2", env_extra={"NGPU": "4"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "must equal the 4 ranks" in lines[0], proc.stderr


def test_launcher_print_config(tmp_path):
    proc = launcher("--job.print_config", "--training.steps", "5", "--fp8.filter_fqns", "output,wq")
    assert proc.returncode == 0, proc.stderr
    printed = tomllib.loads(proc.stdout)
    expected = load_config(["--job.config_file", DEBUG_TOML, "--job.print_config", "--training.steps", "5",
                            "--fp8.filter_fqns", "output,wq"])
    # The [model] section as the run uses it: the preset's values where the config leaves them unset.
    assert printed == _without_none(dataclasses.asdict(resolved(expected)))
    assert printed["model"] == {"flavor": "debug", "vocab_size": 320, "tie_embeddings": False, "dim": 256,
                                "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 768, "rope_theta": 10000.0,
                                "norm_eps": 1e-05, "qk_norm": False, "max_seq_len": 131072,
                                "attn_mask": "causal"}
    assert printed["training"]["steps"] == 5 and printed["data"]["seq_len"] == 256  # CLI and debug TOML
    assert "train step" not in proc.stdout + proc.stderr  # printed, not trained


def test_a_printed_config_trains_when_read_back(tmp_path, capsys):
    """`--job.print_config > saved.toml`, then `--job.config_file saved.toml`: the saved file is a config to
    train with, not one more request to print (the flag stays on the command line, not in the file)."""
    from titanlike import preflight

    assert preflight.main(["--job.config_file", DEBUG_TOML, "--job.print_config", "--training.steps", "5"]) == 3
    saved = write_toml(tmp_path, capsys.readouterr().out)
    again = load_config(["--job.config_file", saved])
    assert again.job.print_config is False and again.training.steps == 5
    assert load_config(["--job.config_file", saved, "--job.print_config"]).job.print_config is True


def test_bare_option_needs_a_value_unless_boolean():
    with pytest.raises(ConfigError, match=r"^--training.steps needs a value: an integer$"):
        load_config(["--training.steps", "--compile.enable"])
    assert load_config(["--compile.enable", "--training.steps", "7"]).compile.enable is True


@pytest.mark.parametrize("toml", sorted(p.name for p in (ROOT / "train_configs").glob("*.toml")))
def test_every_shipped_config_loads_and_passes_preflight(toml, monkeypatch):
    """Each train_configs/*.toml parses, validates, builds a model shape and passes the launcher's
    checks on the ranks it is meant for (one, or two replicas of its dp_shard for a multi-node one), on
    the GPUs it is meant for: a typo in a shipped config would otherwise first show on a GPU."""
    from titanlike.config import host

    monkeypatch.setattr(host, "gpu_visible", lambda: True)  # this machine may have none: the check is the GPUs'
    cfg = load_config(["--job.config_file", str(ROOT / "train_configs" / toml)])
    p = cfg.parallel
    world = max(p.dp_shard, 1) * (2 if p.dp_replicate == -1 else p.dp_replicate)
    preflight(cfg, world)


@pytest.mark.parametrize("toml", sorted(p.name for p in (ROOT / "train_configs").glob("*.toml")))
def test_every_shipped_config_runs_in_bf16_with_one_flag(toml):
    """`--fp8.recipe none` turns float8 off whatever else the config sets for it (rtx5090_124m.toml sets
    delayed scaling: its own comment names this flag for plain bf16, which once failed validation)."""
    cfg = load_config(["--job.config_file", str(ROOT / "train_configs" / toml), "--fp8.recipe", "none"])
    assert cfg.fp8.recipe == "none"


def test_gpt2_112m_config_is_the_reports_shape():
    from conftest import resolve_model_args
    from titanlike.model.shape import count_params

    margs = resolve_model_args(load_config(["--job.config_file", str(ROOT / "train_configs" / "gpt2_112m.toml")]))
    assert (margs.n_layers, margs.n_heads, margs.dim, margs.vocab_size) == (12, 12, 768, 49152)
    assert round(count_params(margs)[0] / 1e6) == 112


def test_a_resume_says_each_changed_setting_and_what_an_older_muon_checkpoint_ran_with():
    """changed_settings (the resume's lines): one line for each setting that differs from the checkpoint's
    record, in the record's terms; a Muon checkpoint saved before optimizer.ns_coefficients was recorded ran
    the quintic, so this run's Polar Express is one line, and a run asking for the quintic none."""
    from titanlike.config import changed_settings

    now = load_config(["--optimizer.name", "muon"]).optimizer.settings()
    before = {key: value for key, value in now.items() if key != "optimizer.ns_coefficients"}
    assert changed_settings(before, now) == ["optimizer.ns_coefficients: checkpoint quintic → config polar_express"]
    lr_line = changed_settings({**before, "optimizer.lr": 1.0}, now)[0]
    assert lr_line == f"optimizer.lr: checkpoint 1.0 → config {now['optimizer.lr']}"
    quintic = load_config(["--optimizer.name", "muon", "--optimizer.ns_coefficients", "quintic"]).optimizer.settings()
    assert changed_settings(before, quintic) == [] and changed_settings(now, now) == []
    adamw = load_config([]).optimizer.settings()
    assert "optimizer.ns_coefficients" not in adamw and changed_settings({}, adamw) == []
