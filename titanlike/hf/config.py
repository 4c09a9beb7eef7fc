"""A Hugging Face folder's config.json against this run's shape: the check that an initial-weights
folder holds the model this run builds. The names are model/hf_names.py's; reading a config.json
into ModelArgs is config/resolve.py's (a `--model.flavor hf` shape is resolved before any worker
starts).
"""

from __future__ import annotations

import os

from titanlike.config.resolve import read_hf_config
from titanlike.errors import UserError
from titanlike.model.hf_names import COMPARED, CONFIG
from titanlike.model.shape import ModelArgs


def check_hf_config(folder: str, a: ModelArgs) -> None:
    """Refuse a folder whose config.json describes another model than this run's, naming the first
    field that differs and both values (same tensor shapes can hide another head layout or rope_theta)."""
    theirs = read_hf_config(folder)
    for key, field, option in COMPARED:
        there, here = getattr(theirs, field), getattr(a, field)
        if there != here:
            raise UserError(f"{os.path.join(folder, CONFIG)}: {key} is {there!r} there, {here!r} in this run "
                            f"({option}); use the same value, or --model.flavor hf to take the whole shape from it")
