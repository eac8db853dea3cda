"""Models for MNIST-1D (inputs ``(batch, 40)`` float32, 10 classes), and the gpt (:mod:`~gradsync.train.gpt`).

The CNN is the MNIST-1D paper's (Greydanus 2020, "Scaling down deep
learning", github.com/greydanus/mnist1d): three stride-2 convolutions of 25
channels and a linear classifier, ~5.2k parameters, 94% test accuracy there.
"""

from __future__ import annotations

import torch
from torch import nn

from gradsync.train.gpt import GPT

INPUT_NUMEL = 40
NUM_CLASSES = 10


class LogReg(nn.Module):
    """Multinomial logistic regression: one linear layer."""

    def __init__(self, input_numel: int = INPUT_NUMEL, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.linear = nn.Linear(input_numel, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 40) -> (B, 10)
        return self.linear(x)


class MLP(nn.Module):
    """Two hidden layers of ``hidden`` ReLU units."""

    def __init__(self, input_numel: int = INPUT_NUMEL, num_classes: int = NUM_CLASSES, hidden: int = 100):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(input_numel, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 40) -> (B, 10)
        return self.net(x)


class ConvNet(nn.Module):
    """The MNIST-1D paper's CNN: conv(5, s2) -> conv(3, s2) -> conv(3, s2) -> linear."""

    def __init__(self, num_classes: int = NUM_CLASSES, channels: int = 25, input_numel: int = INPUT_NUMEL):
        super().__init__()
        self.conv1 = nn.Conv1d(1, channels, 5, stride=2, padding=1)
        self.conv2 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(channels, channels, 3, stride=2, padding=1)
        length = input_numel
        for kernel in (5, 3, 3):
            length = (length + 2 - kernel) // 2 + 1  # 40 -> 19 -> 10 -> 5
        self.linear = nn.Linear(channels * length, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 40) -> (B, 10)
        h = x.view(x.shape[0], 1, x.shape[-1])  # (B, 1, 40)
        h = self.conv1(h).relu()  # (B, C, 19)
        h = self.conv2(h).relu()  # (B, C, 10)
        h = self.conv3(h).relu()  # (B, C, 5)
        return self.linear(h.flatten(1))


MODELS = {"logreg": LogReg, "mlp": MLP, "cnn": ConvNet, "gpt": GPT}


def build_model(name: str, **sizes) -> nn.Module:
    """Return a fresh model by name (one of ``MODELS``) at ``sizes``, its class's keywords (the gpt's
    ``width``, ``depth``, ``heads``, ``context``; defaults :data:`~gradsync.train.gpt.GPT_DEFAULT`).

    Raises:
        ValueError: an unknown name (the message lists the choices) or a bad gpt size.
        TypeError: a size the model does not take.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name](**sizes)
