"""Operating at scale on CPU: two nodes through the SLURM script and torchrun's c10d rendezvous, the
eight-rank path of an 8-GPU node (HSDP 2 × 4, then resumed on 4 ranks), and what a rank says when a
collective times out.

The two "nodes" are two torchrun processes on this machine, each started by run_train.sh with
NNODES=2 exactly as scripts/slurm/train.sbatch starts them under srun (a stand-in `srun` runs
the command once per node; a stand-in `scontrol` lists the node names). They meet at a c10d
rendezvous on 127.0.0.1 and train the debug model with FSDP over both: the same world of 2 ranks
as one torchrun with 2 processes, so the losses must agree to rounding.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, _env, losses, run_train

STEPS = 4
COMMON = ("--training.steps", str(STEPS), "--metrics.log_freq", "1", "--data.seq_len", "64",
          "--training.local_batch_size", "2", "--validation.enable", "false", "--checkpoint.enable", "false")

FAKE_SRUN = """#!/usr/bin/env bash
# Stand-in for srun --ntasks-per-node=1: run the command once per node, each in the background.
echo "$@" > "$FAKE_SLURM_LOGS/srun_args"
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
  SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$FAKE_SLURM_LOGS/node$node.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
# Stand-in for `scontrol show hostnames NODELIST`: both nodes are this machine.
[ "$1 $2" = "show hostnames" ] || exit 1
printf '127.0.0.1\\n127.0.0.1\\n'
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_through_slurm_script_match_one_node(tmp_path, corpus):
    fake_bin, logs, dump = tmp_path / "bin", tmp_path / "logs", tmp_path / "two_nodes"
    fake_bin.mkdir()
    logs.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    port = free_port()
    env = _env()
    env.pop("CONFIG_FILE", None)
    env.update(PATH=f"{fake_bin}{os.pathsep}{env['PATH']}", PYTHON=sys.executable, FAKE_SLURM_LOGS=str(logs),
               SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="4242",
               SLURM_SUBMIT_DIR=str(ROOT), NGPU="1", RDZV_PORT=str(port))
    overrides = ["--job.dump_folder", str(dump), "--training.device", "cpu",
                 "--data.path", corpus[0], "--data.val_path", corpus[1], *COMMON]
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), *overrides], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    node_logs = [(logs / f"node{i}.log").read_text() if (logs / f"node{i}.log").exists() else "" for i in range(2)]
    assert proc.returncode == 0, proc.stdout + proc.stderr + "\n".join(node_logs)
    assert f"rendezvous at 127.0.0.1:{port} (id titanlike-4242)" in proc.stdout
    srun_args = (logs / "srun_args").read_text().split()
    assert "--ntasks-per-node=1" in srun_args
    assert srun_args[srun_args.index(str(ROOT / "run_train.sh")) + 1:] == overrides
    # Each node's torchrun started one worker; together they form one world of 2 ranks, sharded 2 ways.
    both = "\n".join(node_logs)
    assert "2 rank(s) on cpu (dp_replicate 1 × dp_shard 2)" in both
    assert sum("[rank0]" in log for log in node_logs) == 1  # one node holds global rank 0, and it logs
    two_nodes = losses(dump)

    ref = tmp_path / "one_node"
    run_train(ref, *COMMON, nproc=2, corpus=corpus)
    one_node = losses(ref)
    assert two_nodes.keys() == one_node.keys() == set(range(1, STEPS + 1))
    assert one_node[STEPS] < one_node[1]
    for step in one_node:
        assert math.isfinite(two_nodes[step])
        assert abs(two_nodes[step] - one_node[step]) <= 1e-6 * abs(one_node[step]), (step, two_nodes, one_node)


@pytest.mark.slow
def test_eight_ranks_hsdp_checkpoint_resumes_on_four(tmp_path, corpus):
    """The path of `torchrun --nproc_per_node=8` on one node, on gloo: an HSDP mesh of 2 replicas × 4
    shards trains and checkpoints; its step-2 checkpoint resumes on 4 ranks (FSDP over 4) and the
    resumed steps match the 8-rank run's (same global batch, so the same samples)."""
    common = (*COMMON, "--training.global_batch_size", "16", "--checkpoint.enable", "true",
              "--checkpoint.interval", "2", "--training.deterministic")
    eight = tmp_path / "eight"
    proc = run_train(eight, *common, "--parallel.dp_replicate", "2", "--parallel.dp_shard", "4", nproc=8,
                     corpus=corpus)
    assert "8 rank(s) on cpu (dp_replicate 2 × dp_shard 4)" in proc.stdout + proc.stderr
    four = tmp_path / "four"
    (four / "checkpoint").mkdir(parents=True)
    shutil.copytree(eight / "checkpoint" / "step-2", four / "checkpoint" / "step-2")
    proc = run_train(four, *common, nproc=4, corpus=corpus)
    assert "resumed from" in proc.stdout + proc.stderr
    assert "4 rank(s) on cpu (dp_replicate 1 × dp_shard 4)" in proc.stdout + proc.stderr
    eight_losses, four_losses = losses(eight), losses(four)
    assert set(four_losses) == set(range(3, STEPS + 1)), four_losses
    for step, loss in four_losses.items():
        assert math.isfinite(loss)
        assert abs(loss - eight_losses[step]) <= 1e-5 * abs(eight_losses[step]), (step, eight_losses, four_losses)


@pytest.mark.slow
def test_collective_timeout_names_rank_and_host(tmp_path, corpus):
    """Rank 1 stalls before its first step: rank 0's first all-gather times out after
    parallel.backend_timeout_s and says, in one line, which rank on which host saw it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "probes" / "stalled_rank_probe.py"), "10",
           "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.dump_folder", str(tmp_path),
           "--training.device", "cpu", "--data.path", corpus[0], "--parallel.backend_timeout_s", "3", *COMMON]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    assert errors[0].startswith(f"error: rank 0 on {socket.gethostname()}: a collective timed out ("), errors[0]
    assert "3000ms" in errors[0] and "another rank" in errors[0]
    # The one line replaces the worker's traceback (torchrun still prints its own summary).
    assert "stalled_rank_probe.py\", line" not in proc.stderr and "titanlike/train.py\", line" not in proc.stderr \
        and "titanlike/trainer.py\", line" not in proc.stderr


def test_collective_failure_recognises_backend_errors_only():
    import torch.distributed as dist

    from titanlike.process.faults import collective_failure

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.7]:4802: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in "
                        "the application. Check the logs of the remote worker before reporting an error. GLHF!")
    assert collective_failure(gloo) == ("a collective failed (Read error [10.0.0.7]:4802: Connection reset by peer); "
                                        "another rank probably failed or stopped first: see its log")
    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited or there was a "
                                 "network error\nLast error: socket closed")
    assert collective_failure(nccl).startswith("a collective failed (NCCL error in: ProcessGroupNCCL.cpp:1, remote")
    assert "\n" not in collective_failure(nccl)
    assert collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
