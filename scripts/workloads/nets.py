"""The models and the test accuracy that the training workloads share (train_importance.py,
train_hybrid.py), under Debian's /usr/bin/python3 with torchvision."""
import torch
from torch import nn
from torchvision import models


def small_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, classes))


def resnet18_cifar(classes: int) -> nn.Module:
    """ResNet-18 with the CIFAR stem (3x3 conv, stride 1, no max-pool) for 32 px inputs."""
    m = models.resnet18(num_classes=classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


@torch.no_grad()
def accuracy(model, loader) -> float:
    """Test accuracy of model (on its own device) over loader."""
    dev = next(model.parameters()).device
    model.eval()
    right = total = 0
    for x, y in loader:
        right += int((model(x.to(dev)).argmax(1).cpu() == y).sum())
        total += len(y)
    model.train()
    return right / max(total, 1)
