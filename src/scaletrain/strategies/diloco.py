"""DiLoCo (Douillard et al. 2023): local SGD with an outer optimizer on the pseudo-gradient.

Every worker runs H inner steps with its own optimizer (the paper's inner optimizer is AdamW:
use ``--optimizer adamw``; the configured optimizer is used as given). Then:

  pseudo-gradient  Delta = theta_global - theta_local_r,   averaged over ranks (sample-weighted)
  outer step       theta_global <- NesterovSGD(theta_global, Delta; --outer-lr, --outer-momentum)
  every replica    theta_local_r <- theta_global

Every rank holds the same theta_global and outer momentum, because all apply the same averaged
pseudo-gradient. With outer lr 1 and no momentum this is exactly local SGD's averaging; the
paper's 0.7 and Nesterov 0.9 are the defaults. Float buffers are plainly averaged. Period,
weighting, stand-in ranks and checkpoints as in local_sgd.py; checkpoints add theta_global and
the outer optimizer's state.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from scaletrain.config import RunConfig
from scaletrain.strategies.base import LossFn, OptimizerFactory, model_bytes
from scaletrain.strategies.local_sgd import LocalSGDStrategy, float_buffers


class DiLoCoStrategy(LocalSGDStrategy):
    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory, loss_fn: LossFn) -> None:
        super().setup(model, build_optimizer, loss_fn)
        self.global_params = [p.detach().clone() for p in model.parameters()]
        self.outer = torch.optim.SGD(
            self.global_params,
            lr=self.cfg.comm.outer_lr,
            momentum=self.cfg.comm.outer_momentum,
            nesterov=self.cfg.comm.outer_momentum > 0,
        )

    @classmethod
    def estimate_state_bytes(
        cls, model: nn.Module, optimizer_copies: int, cfg: RunConfig, world_size: int
    ) -> int | None:
        # A replica, plus the global parameters and the outer momentum.
        return model_bytes(model) * (4 + optimizer_copies)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "global_params": [p.clone() for p in self.global_params],
            "outer_optimizer": self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for p, saved in zip(self.global_params, state["global_params"], strict=True):
            p.copy_(saved)
        self.outer.load_state_dict(state["outer_optimizer"])

    def eval_model(self) -> nn.Module:
        """--eval-every between synchronizations: the global model the replicas last agreed
        on (theta_global, the same on every rank; an average of the replicas now would
        be a model the outer optimizer never makes), its float buffers averaged over the
        replicas."""
        if self.in_sync:
            return self.module
        model = copy.deepcopy(self.module)
        with torch.no_grad():
            for p, g in zip(model.parameters(), self.global_params, strict=True):
                p.copy_(g)
        buffers = float_buffers(model)
        if buffers:
            self.weighted_average(buffers, self.samples_since_sync)
        return model

    def synchronize(self, num_samples: int) -> int:
        local = list(self.module.parameters())
        deltas = [g - p.detach() for g, p in zip(self.global_params, local, strict=True)]
        nbytes = self.weighted_average(deltas + float_buffers(self.module), num_samples)
        for g, delta in zip(self.global_params, deltas, strict=True):
            g.grad = delta
        self.outer.step()
        with torch.no_grad():
            for g, p in zip(self.global_params, local, strict=True):
                p.copy_(g)
        return nbytes
