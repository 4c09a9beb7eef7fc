"""Which rank's log is printed, and how: the lines of rank LOG_RANK (default 0) at INFO, the others'
warnings and errors only, each prefixed with its rank when there are several."""

from __future__ import annotations

import logging
import os

from titanlike.errors import UserError

logger = logging.getLogger("titanlike")


def setup_logging(rank: int) -> None:
    text = os.environ.get("LOG_RANK", "0")
    if not (text.isascii() and text.isdigit()):
        raise UserError(f"LOG_RANK={text!r}: must be a whole number, the rank whose log is printed (default 0)")
    log_rank = int(text)
    level = logging.INFO if rank == log_rank else logging.WARNING
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    logging.basicConfig(level=level, format=f"{prefix}%(asctime)s %(message)s", datefmt="%H:%M:%S", force=True)
    logger.setLevel(level)
    # torchao reports optional CUDA extensions it could not load, and trips a pytree deprecation
    # notice at import: neither is actionable for a user.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
