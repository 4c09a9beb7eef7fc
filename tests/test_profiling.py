"""Profiling: which steps are traced, where the traces go, and that they hold the step's work."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerAction

from conftest import losses, train_here
from titanlike.records.profiling import Profiler

A = ProfilerAction


def phases(freq: int, warmup: int, active: int, steps: range, start_step: int = 0) -> list:
    cfg = SimpleNamespace(enable=False, freq=freq, warmup=warmup, active=active, memory_snapshot=False,
                          folder="profile")
    p = Profiler(cfg, "/nonexistent", 0, torch.device("cpu"), start_step=start_step)
    return [p.phase(s) for s in steps]


def test_windows_are_fixed_on_the_global_step():
    # A window ends at each multiple of freq: its last `active` steps are recorded, after `warmup`.
    assert phases(5, 2, 1, range(1, 11)) == [A.NONE, A.NONE, A.WARMUP, A.WARMUP, A.RECORD_AND_SAVE] * 2
    assert phases(4, 1, 2, range(1, 9)) == [A.NONE, A.WARMUP, A.RECORD, A.RECORD_AND_SAVE] * 2
    assert phases(3, 0, 3, range(1, 4)) == [A.RECORD, A.RECORD, A.RECORD_AND_SAVE]
    # torch.profiler counts its own steps from 0; what it is told follows the global step: a run
    # resumed after step 7 still records step 10, and a rollback from step 12 to 8 records 10 again.
    cfg = SimpleNamespace(enable=False, freq=5, warmup=2, active=1, memory_snapshot=False, folder="profile")
    p = Profiler(cfg, "/nonexistent", 0, torch.device("cpu"), start_step=7)
    told = [p._schedule(0)]  # for step 8
    for step in (8, 9, 10, 11, 12, 8, 9):  # the loop calls step() after each step it trains
        p.step(step)
        told.append(p._schedule(len(told)))  # for the next step
    #               8         9         10                 11      12      13        9 again   10 again
    assert told == [A.WARMUP, A.WARMUP, A.RECORD_AND_SAVE, A.NONE, A.NONE, A.WARMUP, A.WARMUP, A.RECORD_AND_SAVE]


def test_the_profiler_says_nothing_of_windows_holding_their_own_events(tmp_path, monkeypatch):
    """torch warns, as each window starts, that a window's trace holds that window's events only: what we want.
    The filter set at import was lost wherever filters are reset (each pytest test): quieted where it is said."""
    import warnings

    import torch.profiler.profiler as torch_profiler

    monkeypatch.setattr(torch_profiler, "_WARNINGS_SHOWN", set())  # torch says it once a process
    cfg = SimpleNamespace(enable=True, freq=2, warmup=0, active=1, memory_snapshot=False, folder="profile")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # the filters reset, as pytest's are for each test
        p = Profiler(cfg, str(tmp_path), 0, torch.device("cpu"), start_step=0)
        for step in range(1, 5):
            torch.ones(8).sum()
            p.step(step)
        p.close()
    assert not [w for w in said if "Profiler clears events" in str(w.message)]
    assert sorted(d.name for d in (tmp_path / "profile").iterdir()) == ["step-2", "step-4"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, corpus):
    dump = tmp_path_factory.mktemp("profiled")
    proc = train_here(dump, "--training.steps", "7", "--metrics.log_freq", "1", "--data.seq_len", "64",
                     "--training.local_batch_size", "2", "--validation.enable", "false",
                     "--profiling.enable", "--profiling.freq", "3", "--profiling.warmup", "1",
                     "--profiling.active", "1", "--profiling.memory_snapshot", corpus=corpus)
    return dump, proc.stdout + proc.stderr


def test_profiling_writes_one_trace_per_window(profiled):
    dump, log = profiled
    folder = dump / "profile"
    # Steps 3 and 6 end a window; the run stops at 7, inside the next window's warm-up: no third trace.
    assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-6"]
    for step in (3, 6):
        assert [p.name for p in (folder / f"step-{step}").iterdir()] == ["rank0_trace.json"]
        assert f"profiling: trace of step {step} written to {folder / f'step-{step}' / 'rank0_trace.json'}" in log
    assert losses(dump).keys() == set(range(1, 8))  # profiling does not disturb training


def test_trace_holds_the_recorded_step_and_its_ops(profiled):
    dump, _ = profiled
    trace = json.loads((dump / "profile" / "step-3" / "rank0_trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    # Only the active step is recorded (torch numbers its own steps from 0: step 3 is #2), not the warm-up one.
    assert {n for n in names if n.startswith("ProfilerStep#")} == {"ProfilerStep#2"}
    # The whole training step: forward and backward matmuls, attention, the loss, the optimizer.
    assert "aten::mm" in names or "aten::addmm" in names
    assert "aten::scaled_dot_product_attention" in names and "aten::cross_entropy_loss" in names
    assert any(re.match(r"Optimizer\.step#AdamW\.step", n) for n in names)
    assert any("backward" in n.lower() for n in names)
    # record_shapes is on: the matmuls carry their input shapes (batch 2 × seq 64 tokens).
    mm = [e for e in trace["traceEvents"] if e.get("name") == "aten::mm" and "Input Dims" in e.get("args", {})]
    assert mm and any(128 in dims for e in mm for dims in e["args"]["Input Dims"])


def test_memory_snapshot_needs_cuda(profiled):
    _, log = profiled
    assert "profiling.memory_snapshot records the CUDA allocator: nothing to record on cpu, skipped" in log
    assert not list((profiled[0] / "profile").rglob("*.pickle"))


def test_memory_snapshot_on_a_torch_without_the_allocators_history_is_one_line(tmp_path, monkeypatch, caplog):
    """The allocator's history is private API (overrides/cuda.py): on a torch that moved it, a GPU run with
    profiling.memory_snapshot says so in one line and trains on without snapshots."""
    monkeypatch.delattr(torch.cuda.memory, "_record_memory_history")
    cfg = SimpleNamespace(enable=False, freq=2, warmup=0, active=1, memory_snapshot=True, folder="profile")
    with caplog.at_level("WARNING", logger="titanlike"):
        p = Profiler(cfg, str(tmp_path), 0, torch.device("cuda"), start_step=0)
    assert [r.getMessage() for r in caplog.records] == [
        "profiling.memory_snapshot records the CUDA allocator: torch.cuda.memory has no _record_memory_history, "
        "skipped"]
    p.step(2)
    assert p.oom_snapshot(2) is None
    p.close()
    assert not (tmp_path / "profile").exists()


@pytest.mark.gpu
def test_memory_snapshot_and_oom_snapshot_on_cuda(tmp_path):
    """One GPU: a snapshot at the end of the first window, and one when a step runs out of memory."""
    import pickle

    cfg = SimpleNamespace(enable=False, freq=2, warmup=0, active=1, memory_snapshot=True, folder="profile")
    p = Profiler(cfg, str(tmp_path), 0, torch.device("cuda"), start_step=0)
    x = torch.randn(1024, 1024, device="cuda")
    for step in (1, 2, 3, 4):
        x = x @ x
        p.step(step)
    first = tmp_path / "profile" / "step-2" / "rank0_memory_snapshot.pickle"
    assert first.exists() and not (tmp_path / "profile" / "step-4").exists()  # the first window only
    snapshot = pickle.loads(first.read_bytes())
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"])
    with pytest.raises(torch.OutOfMemoryError):
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            path = p.oom_snapshot(4)
            raise
    assert path == str(tmp_path / "profile" / "oom-after-step-4" / "rank0_memory_snapshot.pickle")
    assert pickle.loads(open(path, "rb").read())["segments"]
    p.close()


# ---- scripts/summarize_trace.py ------------------------------------------------------------------


def write_trace(path, window_ms: float, kernels: list[tuple[str, float, float]]) -> str:
    """A chrome trace as torch.profiler writes it, reduced to what the summary reads: one recorded
    step's span on the GPU and (name, start ms, duration ms) kernels."""
    events = [{"cat": "gpu_user_annotation", "name": "ProfilerStep#10", "ts": 0, "dur": window_ms * 1e3}]
    events += [{"cat": "kernel", "name": n, "ts": t * 1e3, "dur": d * 1e3} for n, t, d in kernels]
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def summarize(*args: str) -> str:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "summarize_trace.py"
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_summarize_trace_timeline_and_comparison(tmp_path):
    two = write_trace(tmp_path / "two.json", 100, [
        ("nvjet_gemm", 0, 40),
        ("ncclDevKernel_ReduceScatter", 30, 30),  # 10 ms beside the gemm, 20 ms exposed
        ("triton_poi_fused_mul_silu_4", 70, 20),
        ("triton_poi_fused_mul_silu_4", 150, 5),  # after the recorded step: not counted
    ])
    one = write_trace(tmp_path / "one.json", 80, [("nvjet_gemm", 0, 35), ("triton_poi_fused_mul_silu_3", 50, 20)])
    out = summarize(two, "--against", one)
    assert "3 kernels, 90.0 ms of GPU time over 1 profiled step(s)" in out
    assert "100.0 ms wall, compute kernels busy 60.0 ms, idle (no kernel at all) 20.0 ms" in out
    assert "communication 30.0 ms, of which exposed (no compute beside it) 20.0 ms" in out
    assert "+35.00 ms of GPU time per step" in out  # 90 - 55
    diffs = {line.split()[-1]: float(line.split()[0]) for line in out.split("against")[1].splitlines()
             if line.strip()[:1] in "+-" and not line.startswith("against")}
    # Inductor's per-graph kernel numbers are dropped, so the same fusion compares across traces.
    assert diffs == {"ncclDevKernel_ReduceScatter": 30.0, "nvjet_gemm": 5.0, "triton_poi_fused_mul_silu": 0.0}
    # Against half of the other step (one cp 2 rank against a step over the whole window).
    half = summarize(two, "--against", one, "--against-scale", "0.5")
    assert "× 0.5: +62.50 ms of GPU time per step" in half  # 90 - 27.5
    rows = {line.split()[-1]: [float(x) for x in line.split()[:4]] for line in half.split("against")[1].splitlines()
            if line.strip()[:1] in "+-" and not line.startswith("against")}
    assert rows["nvjet_gemm"] == [22.5, 40.0, 1, 17.5]  # the difference, this trace's, its calls, the other's halved


def test_summarize_trace_names_what_each_gap_waited_for(tmp_path):
    """--gaps: a kernel launched just before it ran waited for the CPU; one that started when a collective
    ended waited for that collective; short gaps (launch latency) are not counted."""
    events = [{"cat": "gpu_user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 100_000}]

    def kernel(name, start_ms, dur_ms, launched_ms, correlation, collective=None):
        args = {"correlation": correlation, **({"Collective name": collective} if collective else {})}
        events.append({"cat": "kernel", "name": name, "ts": start_ms * 1e3, "dur": dur_ms * 1e3, "args": args})
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launched_ms * 1e3, "dur": 5,
                       "args": {"correlation": correlation}})

    kernel("nvjet_gemm", 0, 10, 0, 1)
    kernel("ncclDevKernel_AllGather_RING_LL", 5, 15, 1, 2, collective="allgather_into_tensor_coalesced")
    kernel("triton_poi_fused_cat_7", 20, 10, 2, 3)  # queued long before: waited 10 ms for the gather
    kernel("nvjet_gemm", 34, 10, 33.99, 4)  # launched 10 µs before it ran: 4 ms waiting for the CPU
    kernel("nvjet_gemm", 44.03, 10, 40, 5)  # a 30 µs gap: launch latency, not counted
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = summarize(str(path), "--gaps")
    assert "compute kernels waiting (gaps over 50 µs): 14.0 ms per step" in out
    rows = {" ".join(line.split()[2:]): float(line.split()[0]) for line in out.split("waited for")[-1].splitlines()
            if line.strip()}
    assert rows == {"allgather_into_tensor_coalesced before triton_poi_fused_cat": 10.0,
                    "the CPU before nvjet_gemm": 4.0}


def test_summarize_trace_names_the_ops_that_launched_a_kernel(tmp_path):
    """--launched-by: kernels matching the text, grouped by the CPU ops around their launch (same thread,
    outermost first, the innermost with its input shapes); other kernels and other threads' ops are not
    counted."""
    events = [{"cat": "gpu_user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 100_000}]

    def op(name, start_ms, dur_ms, tid=1, dims=None):
        events.append({"cat": "cpu_op", "name": name, "ts": start_ms * 1e3, "dur": dur_ms * 1e3, "pid": 0, "tid": tid,
                       "args": {"Input Dims": dims} if dims else {}})

    def kernel(name, start_ms, dur_ms, launched_ms, correlation, tid=1):
        events.append({"cat": "kernel", "name": name, "ts": start_ms * 1e3, "dur": dur_ms * 1e3,
                       "args": {"correlation": correlation}})
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launched_ms * 1e3, "dur": 5,
                       "pid": 0, "tid": tid, "args": {"correlation": correlation}})

    op("attention", 0, 10)
    op("aten::contiguous", 1, 2, dims=[[1, 8, 64]])
    op("aten::copy_", 1.5, 1, dims=[[1, 8, 64], [1, 8, 64]])
    kernel("direct_copy_kernel", 10, 3, 2, 1)
    op("aten::copy_", 4, 1, dims=[[4]])
    kernel("direct_copy_kernel", 20, 1, 4.5, 2)
    kernel("direct_copy_kernel", 30, 2, 5.5, 3, tid=2)  # on a thread with no op around its launch
    kernel("nvjet_gemm", 40, 5, 6, 4)
    op("backward", 60, 10, tid=2)  # the other thread's op, later: around nothing
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = summarize(str(path), "--launched-by", "direct_copy", "--launched-by", "nvjet")
    assert "kernels holding 'direct_copy': 6.00 ms per step" in out
    assert "kernels holding 'nvjet': 5.00 ms per step" in out  # a second text, from the same reading
    copies = out.split("launched from")[1].split("kernels holding")[0]
    rows = {" ".join(line.split()[2:]): float(line.split()[0]) for line in copies.splitlines() if line.strip()}
    assert rows == {"attention > aten::contiguous > aten::copy_ [[1, 8, 64], [1, 8, 64]]": 3.0,
                    "attention > aten::copy_ [[4]]": 1.0, "(no CPU op around its launch)": 2.0}
