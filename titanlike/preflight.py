"""The preflight: everything about a run that can be checked without torch, before any worker starts.

`run_train.sh` runs `python -m titanlike.preflight` with the world size it is about to launch
(TITANLIKE_PREFLIGHT_WORLD) and starts torchrun only if it exits 0; so a mistyped option, an
impossible batch, a shape that cannot be built, a wrong data file or a folder in use costs a fraction
of a second and one `error:` line (exit 2), not a queue slot. It imports no torch (nor numpy, which
only the data check loads): the config schema, the model shapes and the file checks are plain Python.

    exit 0   the config is fine: the launcher goes on
    exit 2   one `error:` line on stderr
    exit 3   printed what was asked (--help, --job.print_config): the launcher stops there
"""

from __future__ import annotations

import dataclasses
import os
import sys

from titanlike.config import JobConfig, help_text, load_config, to_toml
from titanlike.config.resolve import resolve_model
from titanlike.errors import UserError
from titanlike.world import ParallelDims, parallel_dims

PRINTED = 3
WORLD_ENV = "TITANLIKE_PREFLIGHT_WORLD"


def resolved(cfg: JobConfig) -> JobConfig:
    """The config as the run will use it: [model] with the shape it resolves to (the preset's or the
    data's values where the config leaves them unset), for --job.print_config and config.toml."""
    args = resolve_model(cfg).args
    shape = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **shape))


def checkpoint_folder(cfg: JobConfig) -> str:
    folder = cfg.checkpoint.folder
    return folder if os.path.isabs(folder) else os.path.join(cfg.job.dump_folder, folder)


def check(cfg: JobConfig, world_size: int) -> ParallelDims:
    """The checks that need the world size but no GPU; returns the resolved degrees and batch plan."""
    from titanlike.data import schedule
    from titanlike.data.shards import open_shards

    dims = parallel_dims(cfg, world_size)
    model = resolve_model(cfg)  # reads dataset.json / an hf config.json: a bad shape stops here
    info = model.dataset  # data.path's dataset.json, or the one tokenizer of a mixture's sources
    limit, source = ((info.vocab_size, f"its tokenizer ({info.path})") if info else
                     (model.args.vocab_size, "the model's vocabulary"))
    # Shard headers only: cheap, and catches wrong files before any GPU is touched.
    if schedule.is_mixture(cfg.data):
        for s in schedule.all_sources(cfg.data):
            open_shards(s.splits()[0], cfg.data.seq_len, limit, source, f"data source {s.name}")
    elif cfg.data.path:
        open_shards(cfg.data.path, cfg.data.seq_len, limit, source, "data.path")
    return dims


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if any(a in ("-h", "--help") for a in argv):
            print(help_text())
            return PRINTED
        cfg = load_config(argv)
        if cfg.job.print_config:
            print(to_toml(resolved(cfg)), end="")
            return PRINTED
        check(cfg, int(os.environ.get(WORLD_ENV, "1")))
        from titanlike.run.folder import check_not_in_use

        check_not_in_use(cfg.job.dump_folder, checkpoint_folder(cfg))  # a second run into a folder in use
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
