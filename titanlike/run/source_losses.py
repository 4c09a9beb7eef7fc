"""The training loss of each data source of a mixture, for the log (`loss_by_source`).

The trainer's loss is the mean over every token of a step; with several sources it also hands each
micro-batch's per-token losses (detached: they take no part in backward) and each sample's source
here. The sums stay on the device and the token counts on the host, so a step costs no host sync;
at a log step one all-reduce adds them up over ranks. Like `loss`, the numbers are the logged step's:
each source's mean over its tokens in that step, so their token-weighted mean is `loss` itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

# model/loss.py's TokenLossFn: (model, inputs, targets) -> (mean loss, each token's loss)
TokenLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class SourceLosses:
    """`token_loss`: model/loss.py's build_loss(..., per_token=True), whose mean is the plain loss's, bit for bit."""

    def __init__(self, names: list[str], device: torch.device, token_loss: TokenLossFn):
        self.names, self.device, self.token_loss = names, device, token_loss
        self.start_step()

    def start_step(self) -> None:
        """Forget the previous step's sums: called before each step's first micro-batch."""
        self.sums = torch.zeros(len(self.names), dtype=torch.float32, device=self.device)
        self.tokens = np.zeros(len(self.names), dtype=np.int64)

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, sources: np.ndarray | None,
             context=None) -> torch.Tensor:
        """The micro-batch's mean loss, as the plain loss function gives it; each source's share is kept."""
        assert sources is not None, "a mixture's trainer reads every micro-batch's sources"
        loss, token_losses = self.token_loss(model, inputs, targets, context)
        self.add(sources, token_losses)
        return loss

    def add(self, sources: np.ndarray, token_losses: torch.Tensor) -> None:
        """`sources`: each sample's source index (host); `token_losses`: (samples, seq) fp32 losses."""
        index = torch.from_numpy(np.ascontiguousarray(sources, dtype=np.int64)).to(self.device, non_blocking=True)
        self.sums.index_add_(0, index, token_losses.float().sum(dim=1))
        self.tokens += np.bincount(sources, minlength=len(self.names)) * token_losses.shape[1]

    def reduce(self) -> dict[str, float]:
        """The step's mean loss of each source over every rank's tokens (sources the step did not read are
        left out). Every rank calls it: one all-reduce."""
        # float64: a step's token count passes fp32's exact integers (2^24) at 16M tokens.
        both = torch.stack([self.sums.double(), torch.from_numpy(self.tokens).to(self.device, torch.float64)])
        if dist.is_initialized():
            dist.all_reduce(both)  # a sum: the sums and the counts each add up over ranks
        sums, tokens = both.tolist()
        return {name: s / n for name, s, n in zip(self.names, sums, tokens) if n}
