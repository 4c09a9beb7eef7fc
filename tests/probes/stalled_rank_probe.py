"""Worker for tests/test_scale.py: the real trainer on rank 0, and a rank 1 that stalls instead of training.

Run as `torchrun --nproc_per_node=2 tests/probes/stalled_rank_probe.py SECONDS <titanlike overrides>`. Both
ranks build everything as usual (process group, mesh, sharded model); then rank 1 sleeps SECONDS
instead of training and exits 0, so rank 0's first collective waits parallel.backend_timeout_s for
a peer that never comes, which is what a hung or dead rank on another node looks like.
"""

from __future__ import annotations

import os
import sys
import time

from titanlike import train

if __name__ == "__main__":
    stall_s = float(sys.argv[1])
    if int(os.environ["RANK"]) == 1:
        train.Trainer.train = lambda self: time.sleep(stall_s)
    sys.exit(train.main(sys.argv[2:]))
