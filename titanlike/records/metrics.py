"""What a run reports: one console line, one metrics.jsonl record and TensorBoard (and W&B) scalars per log step.

Throughput is measured over the steps between two log points, after the first step (which
pays for compilation and warm-up), with one device synchronisation per log point and none in
between: per-step timing would put a host sync in every step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator

import torch

from titanlike import fs
from titanlike.records.progress import format_duration
from titanlike.records.wandb_sink import WandbSink

logger = logging.getLogger("titanlike")

# Dense bf16 tensor-core peak with fp32 accumulation, FLOP/s, from each vendor datasheet.
# Matched against torch.cuda.get_device_name(); the first matching entry wins, so the more
# specific names come first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("RTX 4090", 165.2e12),
    ("RTX 5090", 209.5e12),
]


def peak_bf16_flops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak, or None (MFU is then reported as n/a, never guessed)."""
    for key, flops in PEAK_BF16_FLOPS:
        if key in device_name:
            return flops
    return None


class TensorBoard:
    """TensorBoard's event file. Its writer thread fails on a full disk with a traceback of its own and
    hands the error to the next call here: that thread's report is kept quiet, and the error becomes one
    FileError line naming the folder."""

    def __init__(self, folder: str, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        _quiet_tensorboard_thread_errors()
        with self._writing():
            self.writer = SummaryWriter(folder, purge_step=purge_step)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            raise fs.FileError(f"cannot write TensorBoard's records: {fs.describe_os_error(e, self.folder)}") from None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        with self._writing():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError:
            pass  # at exit: the error, if any, was reported at the write that met it


def _quiet_tensorboard_thread_errors() -> None:
    """An OSError in TensorBoard's writer thread is reported by the writer's next call (one line);
    every other thread error goes to Python's usual hook."""
    usual = threading.excepthook
    if getattr(usual, "titanlike", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard"):
            return
        usual(args)

    hook.titanlike = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class StepTimer:
    """The wall time of one step and of its update (gradient clipping and the optimizer step), made only for
    the steps that are logged: CUDA events on a GPU (on the compute stream; read when the record is written,
    which waits for the GPU anyway), perf_counter on the CPU. Other steps make none: no event, no sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.mark()  # the step starts

    def mark(self) -> None:
        """The update starts; then, the update is done."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def record(self) -> dict:
        """`optimizer_s` (seconds of the update) and `optimizer_share` (of the step's time)."""
        start, update, end = self.marks
        if self.cuda:
            end.synchronize()
            step_s, update_s = start.elapsed_time(end) / 1e3, update.elapsed_time(end) / 1e3
        else:
            step_s, update_s = end - start, end - update
        return {"optimizer_s": update_s, "optimizer_share": update_s / step_s if step_s > 0 else None}


class MetricsLogger:
    def __init__(self, folder: str, *, is_writer: bool, tensorboard: bool, device: torch.device,
                 constants: dict[str, float], purge_step: int | None = None,
                 wandb: tuple[str, str] | None = None):
        """`constants`: values that join every train record after the first (what the model converters
        report)."""
        self.is_writer = is_writer
        self.device = device
        self.constants = dict(constants)
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.peak = peak_bf16_flops(self.device_name) if device.type == "cuda" else None
        if device.type == "cuda" and self.peak is None and is_writer:
            logger.warning(f"no bf16 peak known for GPU {self.device_name!r}: MFU will show as n/a")
        self.jsonl: fs.AppendFile | None = None
        self.tb = None
        self.wandb: WandbSink | None = None
        self._notes: dict = {}  # values that join the next record (what a converter measured after a step)
        if is_writer:
            os.makedirs(folder, exist_ok=True)
            self.jsonl = fs.AppendFile(os.path.join(folder, "metrics.jsonl"))
            if tensorboard:
                # purge_step: a resumed run's events replace those the interrupted attempt wrote after it.
                self.tb = TensorBoard(os.path.join(folder, "tb"), purge_step)
            if wandb is not None:  # (project, run name): the same scalars to Weights & Biases (wandb_sink.py)
                self.wandb = WandbSink(folder, *wandb)
        self._window_start: float | None = None
        self._window_tokens = 0
        self._window_flops = 0
        self._window_data_s = 0.0
        self.start_time = time.perf_counter()
        self._loop_start = self.start_time
        self._first_logged = False

    # ---- accounting called from the training loop ----------------------------------------

    def add_tokens(self, tokens_per_device: int, data_wait_s: float, flops_per_token: int) -> None:
        """After each step: this device's tokens, the time it waited for data, and the stage's training
        FLOPs per token (MFU's numerator; the stage owns it)."""
        self._window_tokens += tokens_per_device
        self._window_flops += tokens_per_device * flops_per_token
        self._window_data_s += data_wait_s

    def start_window(self) -> None:
        """Begin a throughput window now (after the first step, and after each log point)."""
        self._sync()
        self._window_start = time.perf_counter()
        self._window_tokens = self._window_flops = 0
        self._window_data_s = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def throughput(self) -> dict:
        """Tokens/s per device, TFLOPS, MFU and data-wait share over the window; then restart it."""
        self._sync()
        now = time.perf_counter()
        out: dict = {}
        if self._window_start is not None and self._window_tokens:
            elapsed = now - self._window_start
            tps = self._window_tokens / elapsed
            tflops = self._window_flops / elapsed / 1e12
            out = {"tps": tps, "tflops": tflops, "data_share": self._window_data_s / elapsed}
            out["mfu"] = 100 * tflops * 1e12 / self.peak if self.peak else None
        self._window_start, self._window_tokens, self._window_flops, self._window_data_s = now, 0, 0, 0.0
        return out

    def memory(self) -> dict:
        if self.device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self.device)
        gib = 1024**3
        return {
            "mem_active_gib": stats.get("active_bytes.all.peak", 0) / gib,
            "mem_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / gib,
            "mem_pct": 100 * stats.get("reserved_bytes.all.peak", 0)
            / torch.cuda.get_device_properties(self.device).total_memory,
        }

    # ---- the records of a training run ------------------------------------------------------

    def begin(self) -> None:
        """The training loop starts now: the first train record reports the time from here to its step
        (compilation and warm-up), and throughput is measured from that step on."""
        self._loop_start = time.perf_counter()
        self._first_logged = False

    def log_train(self, step: int, record: dict, *, tokens_seen: int, by_source: dict, total_steps: int,
                  eta_s: float | None) -> None:
        """A train record: `record` (loss, grad_norm, lr, ...), then the first step's time or the
        throughput since the last record, what was read from each source, and GPU memory. Every rank
        calls it (the throughput's device sync); the writer writes."""
        first = not self._first_logged
        if first:
            record["first_step_s"] = time.perf_counter() - self._loop_start
        else:
            record.update(tokens_seen=tokens_seen, **self.throughput(), **self.constants)
        record.update(by_source)
        self.log(step, {**record, **self.memory()}, total_steps=total_steps, eta_s=eta_s)
        if first:
            # The first step paid for compilation and warm-up: throughput is timed from here.
            self._first_logged = True
            self.start_window()

    def log_validation(self, step: int, losses: dict[str, float], total: float, per_source: bool) -> None:
        """The held-out loss: with `per_source` (a mixture), one record per source (quiet on the console)
        before the total, which the console line follows with each source's loss."""
        for name, loss in losses.items() if per_source else ():
            self.log(step, {"source": name, "loss": loss, "ppl": math.exp(min(loss, 50.0))}, prefix="val",
                     console=False)
        self.log(step, {"loss": total, "ppl": math.exp(min(total, 50.0))}, prefix="val",
                 sources=losses if per_source else None)

    # ---- output ---------------------------------------------------------------------------

    def log(self, step: int, record: dict, prefix: str = "train", *, total_steps: int | None = None,
            eta_s: float | None = None, console: bool = True, sources: dict[str, float] | None = None) -> None:
        """Write one record (console, jsonl, TensorBoard); only the writer rank does. `total_steps`,
        `eta_s` (progress.py) and `sources` (each source's loss, after the total's) go on the console
        line only; `console=False` writes no line. A record of one data source ("source": NAME) goes to
        TensorBoard as <prefix>/NAME/<key>; a dict of numbers (tokens_by_source) as <prefix>/<key>/<name>."""
        if not self.is_writer:
            return
        record = {"step": step, **record}
        if prefix == "train":
            record.update(self._notes)
            self._notes = {}
        if self.jsonl:
            clean = {k: ({n: _finite(x) for n, x in v.items()} if isinstance(v, dict) else _finite(v))
                     for k, v in record.items()}
            self.jsonl.write_line(json.dumps({"kind": prefix, **clean}))
        if self.tb or self.wandb:
            tag = f"{prefix}/{record['source']}" if "source" in record else prefix
            scalars = {}
            for k, v in record.items():
                values = v if isinstance(v, dict) else {"": v}
                for name, x in values.items():
                    if k != "step" and isinstance(x, (int, float)) and x is not None:
                        scalars[f"{tag}/{k}/{name}" if name else f"{tag}/{k}"] = x
            self.scalars(step, scalars)
        if not console:
            return
        if self.device.type != "cuda":
            # A CPU has no bf16 peak (no MFU), and its TFLOPS would print as 0.0: the jsonl keeps them.
            record = {k: v for k, v in record.items() if k not in ("tflops", "mfu")}
        line = format_line(prefix, record, total_steps, eta_s)
        logger.info(line + "".join(f" | {name} {loss:.4f}" for name, loss in (sources or {}).items()))

    def note(self, values: dict) -> None:
        """Values for the next train record (metrics.jsonl only), from a component that measured them."""
        self._notes.update(values)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """TensorBoard and W&B only (per-layer detail that would swamp metrics.jsonl); only the writer rank writes."""
        if self.tb:
            for tag, v in values.items():
                self.tb.add_scalar(tag, v, step)
        if self.wandb:
            self.wandb.log(step, values)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.close()


def _finite(v):
    """JSON has no NaN or Infinity: a non-finite number is written as null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def format_line(prefix: str, r: dict, total_steps: int | None = None, eta_s: float | None = None) -> str:
    """`train step     20/150 | loss 3.1416 | ... | ETA 1m05s`: the keys present, in a fixed order."""
    parts = [f"{prefix} step {r['step']:>6}" + (f"/{total_steps}" if total_steps else "")]
    fmt = {
        "loss": "loss {:.4f}", "ppl": "ppl {:.2f}", "grad_norm": "grad {:.3f}", "lr": "lr {:.2e}",
        "tps": "{:,.0f} tok/s/dev", "tflops": "{:.1f} TFLOPS", "mfu": "MFU {:.1f}%",
        "mem_reserved_gib": "mem {:.1f} GiB", "data_share": "data {:.0%}", "first_step_s": "first step {:.1f}s",
        "to_step": "back to step {}", "not_replayed": "{} batches not replayed",
    }
    for key, f in fmt.items():
        if r.get(key) is not None:
            parts.append(f.format(r[key]))
    if "mfu" in r and r["mfu"] is None and r.get("mem_reserved_gib") is not None:  # a GPU without a known peak
        parts.append("MFU n/a")
    if eta_s is not None:
        parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)
