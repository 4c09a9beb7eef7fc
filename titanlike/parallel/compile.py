"""torch.compile, one block at a time."""

from __future__ import annotations

from titanlike.model.decoder import Transformer


def apply_compile(model: Transformer, options: dict[str, object] | None = None) -> None:
    # Per block rather than whole-model: blocks are identical, so inductor compiles one graph
    # and reuses it, and FSDP's per-block hooks stay outside the graphs. `options` are inductor
    # settings for these graphs only (float8.inductor_options), not for the whole process.
    for block in model.layers:
        block.compile(fullgraph=True, options=options or None)
