"""Small models shared by the training tests of bnlab.nets."""
from __future__ import annotations

import torch
from torch import nn


def dropout_bn_mlp(seed: int, width: int = 16, p: float = 0.2, inputs: int = 64, outputs: int = 10) -> nn.Module:
    """A float64 network Linear → BN → tanh → Dropout(p) → Linear, its weights and biases N(0, 0.3²) from
    ``seed``: a module with dropout (random numbers from torch's generator) and a bias right before BN."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    m = nn.Sequential(nn.Linear(inputs, width, dtype=f64), nn.BatchNorm1d(width, dtype=f64), nn.Tanh(), nn.Dropout(p),
                      nn.Linear(width, outputs, dtype=f64))
    with torch.no_grad():
        for q in m.parameters():
            q.copy_(torch.randn(q.shape, generator=g, dtype=f64) * 0.3)
    return m
