"""Shared test helpers: train the debug model with a list of CLI overrides.

Integration tests are lists of overrides, in the TorchTitan style. `train_here` runs the trainer in
this process (one rank: no new interpreter, no torchrun, a few seconds saved each time);
`run_train` runs exactly what a user starts, `torchrun run_train.sh`, as a subprocess, for several
ranks (gloo on CPU) and wherever the process boundary itself is under test (signals, exit codes).

The two-rank reference runs of the slow tier (`ref`, `ref_fp8`, one schedule) live here too: the
checkpoint tests and the export tests read the same runs.

Tiers: `python -m pytest` runs the default tier (every module, a few minutes on 2 cores);
`-m slow` the multi-process and compile tests; `-m gpu` the GPU tier (docs/gpu-tests.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The per-machine cache (titanlike/cache.py: the built-in corpus) of this test session: a fresh
# temporary folder, so that tests neither read nor write the user's ~/.cache/titanlike.
CACHE = tempfile.mkdtemp(prefix="titanlike-test-cache-")
os.environ["TITANLIKE_CACHE"] = CACHE
# The checkpoint signing key of this test session (checkpoint/manifest.py): not the user's own.
CONFIG_HOME = tempfile.mkdtemp(prefix="titanlike-test-config-")
os.environ["XDG_CONFIG_HOME"] = CONFIG_HOME


# Test-only NaN injection (TITANLIKE_NAN_BATCHES): in this process now, in the processes tests start
# through the sitecustomize.py of this folder (_env puts it on their PYTHONPATH).
PROBE_SITE = ROOT / "tests" / "probes" / "site"
sys.path.insert(0, str(PROBE_SITE))
import nan_batches  # noqa: E402

nan_batches.install()


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE, ignore_errors=True)
    shutil.rmtree(CONFIG_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def corpus() -> tuple[str, str]:
    """The embedded corpus, built once per test session: (train shard, validation shard)."""
    from titanlike.data.corpus import build_default_corpus

    return build_default_corpus(CACHE)


@pytest.fixture(autouse=True)
def overrides_as_they_were():
    """A run in this process chooses its overrides (parallel.overrides) for the whole process: the next
    test starts unconfigured again (every override whose probe passes is on)."""
    yield
    from titanlike import overrides

    overrides.reset()


def pytest_collection_modifyitems(config, items):
    """`-m gpu` tests need a CUDA GPU: without one they are skipped, so that a `-m` of one's own that
    keeps them (it replaces the default `-m 'not gpu and not slow'`) still passes on CPU. With
    TITANLIKE_GPU_SHARD (scripts/gpu_tier.sh), this process runs one shard of the GPU tier."""
    import torch

    shard = os.environ.get(GPU_SHARD_ENV)
    if shard:
        items[:] = gpu_shard(items, shard)
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(no_gpu)


GPU_SHARD_ENV = "TITANLIKE_GPU_SHARD"
# Seconds each GPU test took on two H200s in its shard of a whole tier run (cold caches, four shards at
# once: docs/gpu-tests.md); the shards balance on these. A test missing here counts as DEFAULT_COST.
GPU_TEST_COST = {
    "test_one_gpu_cpu_offload_with_8bit_moments_and_compiled_float8": 129.4,
    "test_long_context_stage_switches_compiled_on_two_gpus": 101.2,
    "test_selective_op_names_compiled_trains_as_op[rowwise]": 87.3,
    "test_two_gpus_context_parallel_matches_one_gpu[block_causal]": 67.2,
    "test_two_gpus_context_parallel_matches_one_gpu[causal]": 61.6,
    "test_two_gpus_all_gather_float8_and_match_one_gpu": 61.3,
    "test_two_gpus_context_parallel_attention_matches_unsplit": 55.4,
    "test_two_gpus_recomputed_cp_blocks_hold_only_their_inputs": 52.2,
    "test_selective_op_names_compiled_trains_as_op[none]": 54.4,
    "test_two_gpus_background_save_resumes_exactly_and_on_one_gpu": 53.3,
    "test_float8_recipe_trains_compiled[delayed]": 52.5,
    "test_float8_loss_tracks_bf16_on_124m": 52.2,
    "test_float8_recipe_trains_compiled[rowwise]": 45.5,
    "test_float8_recipe_trains_compiled[measure]": 42.1,
    "test_two_gpus_cpu_offload_matches_without": 37.5,
    "test_float8_recipe_trains_compiled[rowwise_with_gw_hp]": 37.2,
    "test_float8_recipe_trains_compiled[tensorwise]": 36.4,
    "test_cpu_offload_checkpoint_resumes_the_other_way[plain-offload]": 36.4,
    "test_block_causal_trains_compiled": 35.1,
    "test_one_gpu_cpu_offload_trains_as_without": 35.0,
    "test_kept_bytes_on_the_gpu": 34.3,
    "test_cpu_offload_checkpoint_resumes_the_other_way[offload-plain]": 33.9,
    "test_fit_gib_chooses_levers_that_fit_on_the_gpu": 32.8,
    "test_pinned_background_save_resumes_exactly": 31.4,
    "test_ctrl_c_saves_and_resumes_on_the_gpu": 26.4,
    "test_memory_cap_fits_and_refuses_in_one_line": 24.8,
    "test_rollback_on_the_gpu": 18.0,
    "test_block_causal_flex_attention_matches_the_dense_mask[blocks-compiled]": 17.7,
    "test_two_gpus_gradients_live_in_the_compute_streams_memory": 17.0,
    "test_flex_kernel_options_keep_attention_as_accurate": 16.9,
    "test_plain_background_saves_on_the_gpu": 16.2,
    "test_on_a_gpu_the_blocks_built_from_document_ranges_give_the_dense_masks_gradients": 15.9,
    "test_block_causal_flex_attention_matches_the_dense_mask[flex-compiled-alone]": 9.7,
    "test_export_of_a_gpu_step_gives_transformers_our_logits": 7.7,
    "test_greedy_with_the_cuda_graph_equals_greedy_without": 6.3,
    "test_mixture_token_loss_is_the_compiled_loss_on_the_gpu[512-False]": 3.9,
    "test_mixture_token_loss_is_the_compiled_loss_on_the_gpu[0-True]": 3.1,
    "test_mixture_token_loss_is_the_compiled_loss_on_the_gpu[0-False]": 2.6,
    "test_step_fence_holds_the_cpu_until_the_backward_is_done": 1.3,
    "test_step_fence_under_cp_holds_the_cpu_in_the_forward": 0.5,
    "test_memory_snapshot_and_oom_snapshot_on_cuda": 0.5,
    "test_clip_and_step_never_syncs_on_cuda": 0.1,
    "test_real_cuda_oom_is_reported_with_its_peak": 0.0,
}
DEFAULT_COST = 45.0


def gpu_shard(items: list, shard: str) -> list:
    """The tests of shard k of the GPU tier's n (`shard` = "k/n/t"): shards t and up see two GPUs and
    take the tests that need two; every shard takes one-GPU tests. Balanced by GPU_TEST_COST, the
    largest first to the lightest shard; the tests that share a module fixture stay together (it would
    run once per shard). Every shard computes the same assignment."""
    k, n, first_two = (int(x) for x in shard.split("/"))
    groups: dict[str, list] = {}
    for item in items:
        shared = [f for f in getattr(item, "fixturenames", ()) if f in ("pinned_run",)]
        groups.setdefault(shared[0] if shared else item.nodeid, []).append(item)

    def cost(group: list) -> float:
        return sum(GPU_TEST_COST.get(i.name, DEFAULT_COST) for i in group)

    def needs_two(group: list) -> bool:
        return any(i.get_closest_marker("two_gpus") for i in group)

    loads = [0.0] * n
    mine: list = []
    # The two-GPU tests first, among the shards that have two GPUs; then the rest, among all.
    order = sorted(groups, key=lambda g: (not needs_two(groups[g]), -cost(groups[g]), g))
    for key in order:
        allowed = range(first_two, n) if needs_two(groups[key]) else range(n)
        lightest = min(allowed, key=lambda s: (loads[s], s))
        loads[lightest] += cost(groups[key])
        if lightest == k:
            mine += groups[key]
    return [i for i in items if i in mine]


# ---- helpers the tests share that no run needs ------------------------------------------------------


def resolve_model_args(cfg):
    """The model shape a config means (what a run resolves: config/resolve.py)."""
    from titanlike.config.resolve import resolve_model

    return resolve_model(cfg).args


def build_train_loader(dataset, local_batch: int, global_batch: int, dp_rank: int, dp_world: int, seed: int,
                       num_workers: int, pin_memory: bool, plan=None):
    """A loader over one dataset in `plan`'s order (default: its own epoch order), as data/build.py makes
    one for a run, without the rest of the run."""
    from titanlike.data.loader import DataError, GlobalBatchSampler, TrainLoader
    from titanlike.data.order import EpochOrder

    if len(dataset) < global_batch:
        raise DataError(f"the training data has {len(dataset)} samples of data.seq_len + 1 tokens, fewer than one "
                        f"global batch of {global_batch}; use more data, a shorter data.seq_len or a smaller batch")
    plan = plan if plan is not None else EpochOrder(len(dataset), seed)
    return TrainLoader(dataset, GlobalBatchSampler(plan, local_batch, global_batch, dp_rank, dp_world), num_workers,
                       pin_memory)


def build_data(data, *, seed: int, validation: bool = True, stages=None):
    """The run's data (data/build.py) over a [data] section, as a 1-rank run of local batch 2, global batch 4
    and vocabulary 320 builds it; `stages`: one stage of data.seq_len unless given."""
    from titanlike.config.sources import schedule_of
    from titanlike.config.stages import Stage, Stages
    from titanlike.data.build import DataSpec, build_run_data

    stages = stages or Stages((Stage(1, data.seq_len, 0.0, 2, 4, 2),))
    return build_run_data(DataSpec(data, schedule_of(data), stages, 320, seed, validation=validation))


def seal(folder: str, step: int = 0) -> None:
    """A manifest for every file of a DCP folder written in one process: what a titanlike save writes, so
    that the folder counts as written by titanlike on this account."""
    from titanlike.checkpoint.manifest import MANIFEST, describe_files, write_manifest

    write_manifest(folder, step, describe_files(folder, sorted(n for n in os.listdir(folder) if n != MANIFEST)))


def _env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(PROBE_SITE), env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    # A warm inductor cache makes repeated compile tests ~10 s instead of ~40 s.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "titanlike-inductor"))
    return env


def run_train(dump: Path, *overrides: str, nproc: int = 1, corpus: tuple[str, str] | None = None,
              check: bool = True, timeout: int = 600, device: str = "cpu") -> subprocess.CompletedProcess:
    """Train the debug model: `torchrun --nproc_per_node=nproc run_train.sh <overrides>` literally, on
    `device` (the CPU tier: cpu with gloo; the GPU tier, `-m gpu`: cuda with NCCL)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "run_train.sh"), *train_args(dump, *overrides, corpus=corpus, device=device)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def train_args(dump: Path, *overrides: str, corpus: tuple[str, str] | None = None, device: str = "cpu") -> list[str]:
    """The command line of a debug-model run into `dump` (what run_train and train_here pass)."""
    args = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.dump_folder", str(dump),
            "--training.device", device]
    if corpus:
        args += ["--data.path", corpus[0], "--data.val_path", corpus[1]]
    return [*args, *overrides]


def train_here(dump: Path, *overrides: str, corpus: tuple[str, str] | None = None, check: bool = True,
               device: str = "cpu") -> subprocess.CompletedProcess:
    """One rank, in this process: `titanlike.train.main` with the arguments run_train passes, its output
    captured, and the process-wide state a run changes put back afterwards (signal handlers, logging,
    deterministic kernels, environment). One thread, as run_train's workers (OMP_NUM_THREADS=1), so
    that its losses are bit for bit those of a subprocess run."""
    import torch

    from titanlike import train

    argv = train_args(dump, *overrides, corpus=corpus, device=device)
    out, err = io.StringIO(), io.StringIO()
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
    handlers = {sig: signal.getsignal(sig) for sig in signals}
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    environ, root_handlers, root_level = dict(os.environ), list(logging.root.handlers), logging.root.level
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = train.main(argv)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        os.environ.clear()
        os.environ.update(environ)
        logging.root.handlers[:] = root_handlers
        logging.root.setLevel(root_level)
    proc = subprocess.CompletedProcess(argv, rc, out.getvalue(), err.getvalue())
    if check and rc != 0:
        raise AssertionError(f"training failed ({rc}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_python(*args: str, check: bool = False, timeout: int = 300,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """`python <args>` from the repository root (for single-process entry points and scripts)."""
    proc = subprocess.run([sys.executable, *args], env=env or _env(), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_probe(script: str, out: Path, device: str = "cpu") -> dict:
    """`torchrun --nproc_per_node=2 tests/probes/<script> OUT.json DEVICE`; the JSON rank 0 wrote there."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests" / "probes" / script), str(out), device],
                          env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(Path(out).read_text())


def metrics(dump: Path, kind: str = "train") -> list[dict]:
    """The metrics.jsonl records of one kind (train or val), in order."""
    path = Path(dump) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


def losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(dump)}


@contextlib.contextmanager
def small_disk(folder: Path, size: str = "64k", read_only: bool = False):
    """A tmpfs of `size` mounted at `folder` (read-only if asked): a full or read-only disk, for real.
    Mounting needs root; elsewhere the test is skipped, saying so."""
    folder.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root; cannot simulate a full or read-only disk here")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(folder: Path) -> None:
    """Fill the file system of `folder` to the last byte."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for block in (65536, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError:
                pass
    finally:
        os.close(fd)


# ---- one trained run, shared by the whole test session ----------------------------------------------

# Four steps of the debug model on one rank, a checkpoint every two: small enough for seconds, real
# enough to resume, export, damage and attack. Tests copy it (copy_run) and never change it.
SMALL = ("--data.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
         "--training.deterministic", "--validation.enable", "false")
TRAINED_STEPS = ("--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, corpus) -> Path:
    dump = tmp_path_factory.mktemp("trained-run")
    train_here(dump, *SMALL, *TRAINED_STEPS, corpus=corpus)
    assert sorted(n for n in os.listdir(dump / "checkpoint") if n.startswith("step-")) == ["step-2", "step-4"]
    return dump


def copy_run(run: Path, dump: Path) -> Path:
    """A copy of a run folder (its lock files left behind: the copy belongs to no process)."""
    shutil.copytree(run, dump, ignore=shutil.ignore_patterns(".titanlike.lock"))
    return dump


def words_tokenizer(path: Path, ids: int) -> str:
    """A tokenizer.json of `ids` ids (a word-level one; the last id the end-of-text token `</s>`)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(ids - 1)} | {"</s>": ids - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return str(path)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def call(main, *argv: str) -> tuple[int, str]:
    """A console script's main() in this process: (exit code, what it printed to stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, err.getvalue()


def load_in_process(model, path: Path, trust: bool = False) -> None:
    """The trainer's own loader for `--checkpoint.initial_load_path` (no process group, one rank);
    trust = --checkpoint.trust_pickled_dcp, for the synthetic checkpoints written here by plain DCP."""
    from titanlike.hf.initial import load_initial_weights

    load_initial_weights(model, model.args, str(path), trust_pickled_dcp=trust)


# ---- the two-rank reference runs (the slow tier), shared by test_checkpoint and test_export -------------

# All runs of those tests share one short schedule, so any run's losses can be compared with the
# reference run's, step by step. The global batch is fixed at 8 so that one rank (2 micro-batches
# of 4) and two ranks (4 each) train on the same samples.
STEPS = 12
SCHEDULE = ("--training.steps", str(STEPS), "--data.seq_len", "64", "--training.local_batch_size", "4",
            "--training.global_batch_size", "8", "--metrics.log_freq", "1", "--validation.enable", "false",
            "--training.deterministic", "--checkpoint.enable")
FP8 = ("--fp8.recipe", "tensorwise", "--fp8.emulate", "--fp8.auto_filter", "false")


def spawn_ranks(worker, world: int, *args) -> None:
    """`worker(rank, world, *args)` in `world` processes, each a rank of one gloo group over a file store."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        # forkserver: a server process that imports torch and titanlike once and forks each worker from
        # there (spawn would import them again for every worker, seconds). Not fork from this process:
        # from torch 2.14 a child forked after autograd ran in its parent cannot use autograd.
        mp.set_forkserver_preload(["torch", "titanlike.parallel.context"])
        mp.start_processes(_rank, args=(world, os.path.join(tmp, "store"), worker, args), nprocs=world, join=True,
                           start_method="forkserver")


def _rank(rank: int, world: int, store: str, worker, args) -> None:
    import torch
    import torch.distributed as dist

    from titanlike.parallel.mesh import destroy_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        worker(rank, world, *args)
    finally:
        destroy_process_group()  # lets gloo's threads finish first (see its docstring)


def step_losses(dump: Path, after_line: int = 0) -> dict[int, float]:
    """Losses by step from metrics.jsonl, from its `after_line`-th train record on (a resumed run appends)."""
    return {r["step"]: r["loss"] for r in metrics(dump)[after_line:]}


def ckpt(dump: Path) -> Path:
    return dump / "checkpoint"


@pytest.fixture(scope="session")
def ref(tmp_path_factory, corpus):
    """Uninterrupted 2-rank run, checkpoints every 2 steps, the newest 3 kept."""
    dump = tmp_path_factory.mktemp("ref")
    proc = run_train(dump, *SCHEDULE, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "3",
                     nproc=2, corpus=corpus)
    assert sorted(step_losses(dump)) == list(range(1, STEPS + 1))
    return dump, proc


@pytest.fixture(scope="session")
def ref_fp8(tmp_path_factory, corpus):
    """The same with float8 tensorwise (emulated) and float8 all-gather, checkpoints every 4 steps."""
    dump = tmp_path_factory.mktemp("ref_fp8")
    proc = run_train(dump, *SCHEDULE, *FP8, "--checkpoint.interval", "4", nproc=2, corpus=corpus)
    assert "float8 all-gather on" in proc.stderr
    return dump, proc
