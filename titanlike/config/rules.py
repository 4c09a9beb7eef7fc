"""The rules that tie one section of the config to another, checked after each section's own (`validate()`):
folders, the model's shape against the activation-checkpointing blocks, the stages against the model and the
context-parallel degree, what parallel.cpu_offload and parallel.overrides ask of the rest. Apart from the
schema (schema.py), so that the modules these rules call (stages.py) can take the typed JobConfig."""

from __future__ import annotations

import os

from titanlike.config import sources, speed
from titanlike.config.loader import need
from titanlike.config.optimizer import OPTIMIZERS
from titanlike.config.schema import JobConfig, in_dump_folder
from titanlike.config.stages import check_stages, stage_seq_lens
from titanlike.model.shape import model_args


def validate_across_sections(cfg: JobConfig) -> None:
    """Rules that tie one section's value to another's."""
    ckpt = cfg.checkpoint.folder
    # The checkpoint folder has a lock of its own beside the dump folder's: one folder for both would be
    # "in use by another run", naming this one.
    need(os.path.realpath(in_dump_folder(cfg.job.dump_folder, ckpt)) != os.path.realpath(cfg.job.dump_folder),
         f"checkpoint.folder = {ckpt!r} is job.dump_folder itself ({cfg.job.dump_folder}): name a folder inside it "
         f"(default \"checkpoint\") or elsewhere")
    prof = in_dump_folder(cfg.job.dump_folder, cfg.profiling.folder)
    need(not (cfg.profiling.enable or cfg.profiling.memory_snapshot) or not os.path.lexists(prof)
         or os.path.isdir(prof),
         f"profiling.folder = {cfg.profiling.folder!r} is a file: the traces go into a folder ({prof}); name "
         f"another one")
    m = cfg.model
    need(m.flavor != "hf" or bool(cfg.checkpoint.initial_load_path),
         "model.flavor = hf takes the shape from a Hugging Face folder's config.json: "
         "set --checkpoint.initial_load_path")
    max_seq_len = 0
    if m.flavor != "hf":  # an hf shape is checked once its config.json is read (titanlike/config/resolve.py)
        shape = model_args(m.flavor, **m.shape_overrides())
        for problem in shape.problems():
            need(False, f"model shape ({m.flavor} with the model.* overrides): {problem}")
        max_seq_len, n_layers = shape.max_seq_len, shape.n_layers
        blocks = cfg.activation_checkpoint.selective_ac_blocks
        need(blocks <= n_layers,
             f"activation_checkpoint.selective_ac_blocks = {blocks} is more than the model's {n_layers} blocks")
    schedule = sources.schedule_of(cfg.data)
    check_stages(cfg, max_seq_len if m.flavor != "hf" else None, schedule)
    for where, seq_len in stage_seq_lens(cfg, schedule):  # a long-context stage's windows split over cp ranks too
        speed.validate_context_parallel(cfg.parallel.cp, seq_len, m.attn_mask, cfg.training.device, where)
    for phase in schedule.phases[1:]:
        need(1 < phase.start_step <= cfg.training.steps,
             f"{phase.option}: a mixture from step {phase.start_step} must start in [2, training.steps = "
             f"{cfg.training.steps}] (the first applies from step 1; one past the last step is never read)")
    need(
        cfg.activation_checkpoint.mode != "budget" or cfg.compile.enable,
        "activation_checkpoint.mode = budget is carried out by torch.compile's partitioner: set --compile.enable",
    )
    offload_rules(cfg)
    overrides_rules(cfg)
    need(cfg.checkpoint.load_step == -1 or cfg.checkpoint.enable,
         f"checkpoint.load_step = {cfg.checkpoint.load_step} resumes from a checkpoint: it needs --checkpoint.enable")
    need(
        cfg.training.nonfinite != "rollback" or cfg.checkpoint.enable,
        "training.nonfinite = rollback reloads the last checkpoint: it needs --checkpoint.enable",
    )


def offload_rules(cfg: JobConfig) -> None:
    """parallel.cpu_offload against the other sections (the degrees at a world size: dims.check_offload)."""
    if not cfg.parallel.cpu_offload:
        return
    need(cfg.training.device != "cpu",
         "parallel.cpu_offload moves weights, gradients and optimizer state from the GPU to host memory: a run "
         "with training.device = cpu has nothing to offload; drop --parallel.cpu_offload")
    need(not cfg.fp8.enable_fsdp_float8_all_gather,
         "parallel.cpu_offload cannot all-gather weights in float8 (the offloaded weights are fp32 on the host): "
         "set --fp8.enable_fsdp_float8_all_gather false")
    need(cfg.parallel.gradient_sync == "micro_batch",
         "parallel.gradient_sync = step keeps the whole model's gradients on the GPU between micro-batches, which "
         "parallel.cpu_offload exists to avoid: set --parallel.gradient_sync micro_batch")
    host_step = OPTIMIZERS[cfg.optimizer.name].host_step
    need(not host_step,
         f"parallel.cpu_offload runs the optimizer step on the CPU, where with optimizer.name = {cfg.optimizer.name} "
         f"{host_step}: drop --parallel.cpu_offload, or use --optimizer.name "
         f"{' or '.join(n for n, f in OPTIMIZERS.items() if not f.host_step)}")
    need(cfg.parallel.dp_replicate in (1, -1),
         f"parallel.cpu_offload works with plain FSDP, not HSDP (parallel.dp_replicate = {cfg.parallel.dp_replicate}): "
         f"set --parallel.dp_replicate 1")


def overrides_rules(cfg: JobConfig) -> None:
    """parallel.overrides against what needs one of them (the names themselves: titanlike/overrides)."""
    kept = {n.strip() for n in cfg.parallel.overrides.split(",")}
    need(cfg.activation_checkpoint.mode != "budget" or "on" in kept or "activation_memory_budget" in kept,
         f"activation_checkpoint.mode = budget needs the override activation_memory_budget (torch's private "
         f"setting), which parallel.overrides = {cfg.parallel.overrides!r} leaves off: use mode full or selective")
