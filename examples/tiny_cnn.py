"""A tiny image classifier and a generated dataset, for ``lowcomm.fit`` (examples/fit_cnn.py and
examples/fit_notebook.ipynb import them from here: worker processes import what they train,
so a model defined in a notebook cell must live in a module like this one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class TinyCNN(nn.Module):
    """Two 3x3 convolutions and a linear head: 1x8x8 images to ``classes`` logits."""

    def __init__(self, classes: int = 2) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(images))  # (B, 8, 8, 8)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (B, 8, 4, 4)
        return self.head(x.flatten(1))  # (B, classes)


class Bars(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``size`` noisy 8x8 images of a horizontal (label 0) or vertical (label 1) bar at a
    random place; sample ``i`` is a pure function of ``(seed, i)``."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(torch.randint(0, 2, (), generator=generator))
        where = int(torch.randint(0, 8, (), generator=generator))
        image = 0.3 * torch.randn(1, 8, 8, generator=generator)
        if label == 0:
            image[0, where, :] += 1.0
        else:
            image[0, :, where] += 1.0
        return image, torch.tensor(label)


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss ``fit`` calls: ``loss_fn(model, batch)``."""
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def label(sample: tuple[torch.Tensor, torch.Tensor]) -> int:
    """A non-IID split key: each worker gets mostly one class."""
    return int(sample[1])
