"""The device a rank trains on and how it is set up: the CUDA caching allocator's settings, a cap on
the GPU memory a run may use (training.gpu_memory_limit_gib), and deterministic kernels
(training.deterministic); and how far the CPU may queue work ahead of the GPU (StepFence). On the CPU,
whether its compute threads outnumber the idle cores (a start line)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from titanlike.config import ConfigError
from titanlike.config.host import available_cores

if TYPE_CHECKING:
    from titanlike.model.decoder import Transformer

# The CUDA caching allocator's settings, unless the user chose their own. Expandable segments let
# a block grow in place instead of reserving a new one, so activations of changing sizes (compile's
# buffers, float8 casts, the 128K-vocabulary logits) fragment memory far less; every benchmark in
# docs/benchmarks/ ran with it.
ALLOCATOR_DEFAULT = "expandable_segments:True"


def allocator_settings(environ=os.environ) -> str | None:
    """The allocator settings the user chose: PYTORCH_ALLOC_CONF, or its older name
    PYTORCH_CUDA_ALLOC_CONF; None if neither is set."""
    return environ.get("PYTORCH_ALLOC_CONF", environ.get("PYTORCH_CUDA_ALLOC_CONF"))


def default_allocator_settings(environ=os.environ) -> None:
    """Set PYTORCH_CUDA_ALLOC_CONF when the user chose no allocator settings. Read when CUDA
    allocates first, so call this before anything touches the GPU."""
    if allocator_settings(environ) is None:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = cuda but no CUDA GPU is visible; use --training.device cpu or auto")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                f"lower --nproc_per_node / NGPU"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def configure_device(device: torch.device, memory_limit_gib: float, deterministic: bool) -> None:
    """training.gpu_memory_limit_gib (a cap below the card's memory, to train as a smaller card would)
    and training.deterministic (the same bits from the same seed, at some cost in speed)."""
    if memory_limit_gib and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory_limit_gib * 2**30 / total), device)
    elif memory_limit_gib:  # a GPU config run where there is none: said, not silently dropped
        logging.getLogger("titanlike").warning(
            f"training.gpu_memory_limit_gib = {memory_limit_gib:g} caps a GPU's memory; this run trains on the "
            f"{device.type.upper()}, where it does nothing")
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def other_busy_cores(loadavg: str = "/proc/loadavg") -> float | None:
    """About how many cores other work keeps busy: the 1-minute load average, capped on Linux by the tasks that
    are runnable right now less the one reading (a run that just ended leaves a load average behind and nothing
    running). None where the system says neither."""
    try:
        with open(loadavg) as f:
            fields = f.read().split()
        return max(0.0, min(float(fields[0]), int(fields[3].split("/")[0]) - 1))
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy_cpu_note(threads: int, cores: int, busy: float | None) -> str | None:
    """The start line for a CPU run whose compute threads outnumber the cores other work leaves idle. Each
    parallel region waits for its slowest thread, so one thread that shares its core holds all back: on two busy
    cores 20 steps of the debug model took 1.7-1.9x as long with the default threads as with OMP_NUM_THREADS=1,
    with the same losses; 14x in another measurement (docs/performance.md)."""
    if threads <= 1 or busy is None or busy < cores - threads + 1:
        return None
    return (f"the CPU is busy: other work holds about {busy:.1f} cores' worth of its {cores}, and this run computes "
            f"with {threads} threads (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), which wait on "
            f"one another whenever one is descheduled; OMP_NUM_THREADS=1, or the number of idle cores, can train "
            f"many times faster here (docs/performance.md, \"Training on a CPU\")")


def cpu_threads_note(device: torch.device) -> str | None:
    """busy_cpu_note for this process on `device` (None off the CPU)."""
    if device.type != "cpu":
        return None
    return busy_cpu_note(torch.get_num_threads(), available_cores(), other_busy_cores())


def device_memory_bytes(device: torch.device, cap_gib: float) -> int | None:
    """What one GPU may use: its memory, or training.gpu_memory_limit_gib if lower; None off CUDA."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return min(total, int(cap_gib * 2**30)) if cap_gib else total


def this_gpu() -> tuple[str, float] | None:
    """(name, GiB) of the GPU this process trains on (its local rank's, as pick_device chooses it), for
    `training.fit_gib = auto`; None where none is visible."""
    if not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        return None  # pick_device says why
    props = torch.cuda.get_device_properties(index)
    return props.name, props.total_memory / 2**30


class StepFence:
    """Holds the CPU back, once a step, until the GPU has finished the previous step's backward: the CPU
    may queue no more than the update of one step (with cp, and the first quarter of the next forward)
    ahead of the GPU.

    The caching allocator decides in the CPU's time. Left alone, the CPU runs the better part of a
    step ahead (0.4 s on `8b` over two GPUs) wherever nothing synchronises it, and a block freed while
    another stream may still use it (FSDP's reduce-scatter buffers) is not reusable until the GPU
    has caught up; the next step's forward then takes fresh memory around it. On `8b` over two H200s
    a run that synchronised at every step (logging every step) reserved 97.7 GiB, one logging every
    10 steps 99.0 to 99.5; with this wait, 97.7 either way, at the same speed
    (docs/benchmarks/2026-11-26-8b-step-fence-and-copy-in.md). Waiting costs no GPU time: the update
    (45 ms on that shape) is still queued when the wait ends, and the next forward's first kernels are
    queued before it is done.

    Where it waits: at the step's start, or with context parallelism (`hold_in` the model) in the forward,
    before the block a quarter of the way down (the model's `hooks.before_block`: between compiled blocks, not in
    one). Under cp a block's forward costs the CPU more than the GPU (FSDP's gathers, the cp attention's
    parts): held at the step's start, the CPU began each forward with only the update queued ahead, and on
    two H200s the GPU waited for it about 1 ms before every block.
    The quarter of the forward queued before the wait is GPU time the rest of the forward draws on: `1b`,
    cp 2, 16,384 tokens, 1.09x (docs/benchmarks/2026-11-28-cp-step-fence-in-the-forward.md). Not without
    cp: there the forward is the GPU's, and `8b` on two H200s reserved 99.6 GiB held in the forward."""

    def __init__(self, device: torch.device, hold_in: Transformer | None = None):
        self.device = device if device.type == "cuda" else None
        self._backward_done: torch.cuda.Event | None = None
        self.in_forward = self.device is not None and hold_in is not None
        if hold_in is not None and self.in_forward:
            # Through a lambda: `wait` is looked up at each call (the tests swap it for a recorder).
            hold_in.hooks.before_block[len(hold_in.layers) // 4] = lambda: self.wait()

    def step_start(self) -> None:
        """At the start of a step: the wait, unless the model's forward holds it."""
        if not self.in_forward:
            self.wait()

    def backward_queued(self) -> None:
        """After the step's last backward is queued, before the update."""
        if self.device is not None:
            self._backward_done = torch.cuda.Event()
            self._backward_done.record(torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        """Until the GPU has done the previous step's backward."""
        if self._backward_done is not None:
            self._backward_done.synchronize()
            self._backward_done = None
