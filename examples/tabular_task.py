"""Your own model, data, loss and optimizer through scaletrain's Python API.

Trains a small residual MLP on scikit-learn's breast-cancer table (569 real samples, 30
features, bundled offline) as binary classification: a custom Dataset, a custom nn.Module, a
BCE loss on one logit, AdamW, and its own accuracy function. Run it with the same CLI:

    scaletrain run --task examples/tabular_task.py:build_task --nproc-per-node 2 \
        --epochs 30 --batch-size 16 --lr 0.003 --out runs/tabular

Every worker calls build_task(cfg) after joining the process group; the same seed gives
every worker the same initial weights.
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import Dataset

from scaletrain import RunConfig, Task


class TableDataset(Dataset):
    def __init__(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features[i], self.labels[i]


class ResidualMLP(nn.Module):
    def __init__(self, num_features: int, hidden: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(num_features, hidden)
        self.block = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU())
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.block(h)).squeeze(-1)


def bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Mean over the batch, as scaletrain expects of every loss_fn.
    return nn.functional.binary_cross_entropy_with_logits(logits, labels.float())


def count_correct(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    return int(((logits > 0).long() == labels).sum()), len(labels)


def build_task(cfg: RunConfig) -> Task:
    x, y = load_breast_cancer(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-6

    def to_dataset(features, labels) -> TableDataset:
        f = torch.tensor((features - mean) / std, dtype=torch.float32)
        return TableDataset(f, torch.tensor(labels, dtype=torch.long))

    return Task(
        model=ResidualMLP(x.shape[1]),
        train_data=to_dataset(x_tr, y_tr),
        test_data=to_dataset(x_te, y_te),
        loss_fn=bce_loss,
        build_optimizer=lambda params: torch.optim.AdamW(
            params, lr=cfg.optim.lr, weight_decay=1e-4
        ),
        eval_fn=count_correct,
    )
