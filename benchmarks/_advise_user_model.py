"""A network written the way a practitioner writes one (plain PyTorch, no bnlab), for bench_advise.py and the
tests: ``bnlab advise --model benchmarks/_advise_user_model.py:build`` loads it through ``module:factory``."""
import torch
from torch import nn


class SmallConvNet(nn.Module):
    """Three Conv → BatchNorm2d → ReLU blocks with max pooling, then a linear classifier (28×28 inputs)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        )
        self.classifier = nn.Linear(2 * width * 7 * 7, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def build():
    torch.manual_seed(0)
    return SmallConvNet()
