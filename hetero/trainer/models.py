"""CIFAR-form models (32x32 input, 10 classes) built from small tables, plus a tiny CNN for CPU runs."""
from __future__ import annotations

import torch
from torch import nn

# VGG: numbers are conv widths, "M" a 2x2 max-pool (Simonyan & Zisserman, CIFAR form as kuangliu/pytorch-cifar).
VGG_TABLE: dict[str, list[int | str]] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}
# ResNet: (block kind, blocks per stage) (He et al. 2016, CIFAR form: 3x3 stem, no max-pool).
RESNET_TABLE: dict[str, tuple[str, list[int]]] = {
    "resnet18": ("basic", [2, 2, 2, 2]),
    "resnet34": ("basic", [3, 4, 6, 3]),
    "resnet50": ("bottleneck", [3, 4, 6, 3]),
}


class VGG(nn.Module):
    def __init__(self, table: list[int | str], num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = 3
        for item in table:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(in_ch, int(item), 3, padding=1, bias=False),
                           nn.BatchNorm2d(int(item)), nn.ReLU(inplace=True)]
                in_ch = int(item)
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_ch: int, ch: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_ch, ch, 3, stride, 1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(inplace=True),
            nn.Conv2d(ch, ch, 3, 1, 1, bias=False), nn.BatchNorm2d(ch))
        self.shortcut = _shortcut(in_ch, ch * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, ch: int, stride: int):
        super().__init__()
        out = ch * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(in_ch, ch, 1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(inplace=True),
            nn.Conv2d(ch, ch, 3, stride, 1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(inplace=True),
            nn.Conv2d(ch, out, 1, bias=False), nn.BatchNorm2d(out))
        self.shortcut = _shortcut(in_ch, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _shortcut(in_ch: int, out_ch: int, stride: int) -> nn.Module:
    if stride == 1 and in_ch == out_ch:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch))


class ResNet(nn.Module):
    def __init__(self, kind: str, blocks: list[int], num_classes: int = 10):
        super().__init__()
        block = BasicBlock if kind == "basic" else Bottleneck
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        stages, in_ch = [], 64
        for i, n in enumerate(blocks):
            ch = 64 * 2 ** i
            for j in range(n):
                stages.append(block(in_ch, ch, 2 if (i > 0 and j == 0) else 1))
                in_ch = ch * block.expansion
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class TinyCNN(nn.Module):
    """A few thousand parameters: fast enough for multi-process tests on a 2-core CPU."""

    def __init__(self, num_classes: int = 10, batch_norm: bool = True, width: int = 16):
        super().__init__()
        norm = (lambda c: nn.BatchNorm2d(c)) if batch_norm else (lambda c: nn.Identity())
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), norm(width), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), norm(2 * width), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), norm(4 * width), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


MODELS = sorted([*VGG_TABLE, *RESNET_TABLE, "tiny", "tiny_nobn"])


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    """A freshly initialised model; the caller seeds torch first so every rank builds the same weights."""
    if name in VGG_TABLE:
        return VGG(VGG_TABLE[name], num_classes)
    if name in RESNET_TABLE:
        return ResNet(*RESNET_TABLE[name], num_classes=num_classes)
    if name == "tiny":
        return TinyCNN(num_classes)
    if name == "tiny_nobn":  # no batch norm: per-sample gradients are independent (exactness tests)
        return TinyCNN(num_classes, batch_norm=False)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
