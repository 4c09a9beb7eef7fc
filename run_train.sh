#!/usr/bin/env bash
""":"
# titanlike launcher. This file is valid bash *and* valid Python:
#   ./run_train.sh [--section.key value ...]          bash: starts torchrun on this very file
#   torchrun --nproc_per_node=8 run_train.sh [...]    torchrun runs it with Python: trains
# Environment: CONFIG_FILE (default train_configs/debug_model.toml; in both modes, and a
# --job.config_file on the command line wins). Bash mode only: NGPU (default: visible GPUs, or 1),
# NNODES, RDZV_ENDPOINT, RDZV_ID for several nodes, LOG_RANK (which rank logs, default 0),
# PYTHON (default python3).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
PYTHON="${PYTHON:-python3}"
if ! command -v "$PYTHON" > /dev/null 2>&1; then
  echo "error: PYTHON='$PYTHON': no such command; set PYTHON to the Python that has titanlike's packages (default python3)" >&2
  exit 2
fi
# A script's `./run_train.sh … &` starts this with Ctrl-C (SIGINT) and SIGQUIT ignored, and bash can never
# trap a signal ignored on entry: torchrun would never hear of a Ctrl-C or `kill -INT`. Start again, the
# same process, with both at their defaults (as a terminal's job has them).
if [ -n "$(trap -p INT QUIT)" ]; then
  exec "$PYTHON" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); signal.signal(signal.SIGQUIT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' "$BASH" "${BASH_SOURCE[0]}" "$@"
fi
if [ -z "${NGPU:-}" ]; then
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
fi
CONFIG_FILE="${CONFIG_FILE:-$here/train_configs/debug_model.toml}"  # Python mode below: the same default
NNODES="${NNODES:-1}"
# A count, in bash's own arithmetic: digits only, no leading zero (octal to bash), no overflow.
for count in "NGPU:processes on this node (default: the visible GPUs, or 1)" "NNODES:nodes (default 1)"; do
  var="${count%%:*}"
  case "${!var}" in
    [1-9] | [1-9][0-9] | [1-9][0-9][0-9] | [1-9][0-9][0-9][0-9] | [1-9][0-9][0-9][0-9][0-9]) ;;
    *) echo "error: $var='${!var}': must be a whole number from 1 to 99999: the ${count#*:}" >&2
       exit 2 ;;
  esac
done
# Whole numbers from 0 (which rank logs; seconds torchrun waits for the workers' save after a signal).
for var in LOG_RANK TORCH_ELASTIC_SHUTDOWN_TIMEOUT; do
  case "${!var:-0}" in
    0 | [1-9] | [1-9][0-9] | [1-9][0-9][0-9] | [1-9][0-9][0-9][0-9] | [1-9][0-9][0-9][0-9][0-9] | [1-9][0-9][0-9][0-9][0-9][0-9]) ;;
    *) echo "error: $var='${!var}': must be a whole number from 0 to 999999" >&2
       exit 2 ;;
  esac
done
if [ "$NNODES" -gt 1 ]; then
  rdzv=(--nnodes="$NNODES" --rdzv_backend=c10d --rdzv_endpoint="${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of node 0}" --rdzv_id="${RDZV_ID:-titanlike}")
else
  rdzv=(--standalone --nnodes=1)
fi
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
# Check the config (and data headers, and that no run holds the folders) for this world size before
# torchrun starts any worker, without importing torch: one clear line and exit code 2 on a mistake;
# --help and --job.print_config print and stop here (exit 3).
rc=0
TITANLIKE_PREFLIGHT_WORLD=$((NGPU * NNODES)) TITANLIKE_PREFLIGHT_LOCAL=$NGPU "$PYTHON" -m titanlike.preflight --job.config_file "$CONFIG_FILE" "$@" || rc=$?
[ "$rc" -eq 3 ] && exit 0
[ "$rc" -ne 0 ] && exit "$rc"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$([ "$NGPU" -gt 1 ] && echo 1 || nproc)}"
if [ "$((NGPU * NNODES))" -eq 1 ]; then
  # One process needs no torchrun, and without it the exit code (2 for a mistake the user can
  # fix) and the one-line message reach the caller as they are, not as exit 1 and a traceback.
  exec "$PYTHON" -m titanlike.train --job.config_file "$CONFIG_FILE" "$@"
fi
# Schedulers preempt with SIGTERM or SIGUSR1: torchrun forwards both to the workers, which finish
# the step and save; give them time for that save before torchrun escalates to SIGKILL.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"
# torchrun (titanlike.process.launch: torchrun ending in one line, not a traceback) exits 128 + signal
# after forwarding a signal, even when every worker saved and stopped cleanly; the workers leave
# a marker so that this launcher can report the truth: exit 0.
export TITANLIKE_PREEMPTED_MARKER="$(mktemp -u "${TMPDIR:-/tmp}/titanlike-preempted.XXXXXX")"
# torchrun runs in a process group of its own (set -m), so that a signal sent to this launcher's
# group (a terminal's Ctrl-C, a scheduler signalling the job) reaches it once: passed on from here.
# Ctrl-C (SIGINT): the workers finish the step, save and exit 130; a second one stops them at once.
# torchrun follows this launcher and the workers follow torchrun (titanlike/process/lifeline.py): a SIGKILL
# of this launcher's group ends the run with a save, as a preemption does, never leaving it headless.
set -m
TITANLIKE_LAUNCHER_PID=$$ "$PYTHON" -m titanlike.process.launch "${rdzv[@]}" --nproc_per_node="$NGPU" --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
  "$here/run_train.sh" --job.config_file "$CONFIG_FILE" "$@" &
pid=$!
set +m
# (Quoted without a backslash: this file is Python too, where a backslash before a dollar sign warns.)
for sig in TERM USR1 INT HUP QUIT; do trap 'kill -s '"$sig"' "$pid" 2>/dev/null' "$sig"; done
rc=0
# wait returns early (status > 128) when a trapped signal arrives: keep waiting for torchrun.
while kill -0 "$pid" 2>/dev/null; do rc=0; wait "$pid" || rc=$?; done
if [ -e "$TITANLIKE_PREEMPTED_MARKER" ]; then
  rm -f "$TITANLIKE_PREEMPTED_MARKER"
  echo "preempted: the workers saved a checkpoint and stopped; run the same command to resume" >&2
  exit 0
fi
exit "$rc"
":"""
# Python mode (under torchrun): the repository root is this file's folder, so the package imports.
import os
import sys

from titanlike.process import lifeline

lifeline.follow_torchrun()  # before torch loads: a worker ends with the torchrun that started it
from titanlike.train import main  # noqa: E402


def names_config_file(arg: str) -> bool:
    # --job.config_file X, --job.config_file=X, or the dashed spelling the config parser accepts too.
    return arg.split("=", 1)[0].replace("-", "_") == "__job.config_file"


# `torchrun ... run_train.sh` means the same run as `./run_train.sh`: without a --job.config_file,
# read CONFIG_FILE (default train_configs/debug_model.toml), as bash mode does.
args = sys.argv[1:]
if not any(map(names_config_file, args)):
    here = os.path.dirname(os.path.realpath(__file__))
    args = ["--job.config_file", os.environ.get("CONFIG_FILE") or os.path.join(here, "train_configs", "debug_model.toml"), *args]
sys.exit(main(args))
