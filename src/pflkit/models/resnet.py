"""Residual networks: CIFAR-style ResNet-20/56 (MAP) and ResNet-18 (KT-pFL, GPFL).

All use the same BasicBlock: conv3x3 -> BN -> ReLU -> conv3x3 -> BN, plus the shortcut (identity,
or a 1x1 conv + BN projection when the stride or width changes), then ReLU. Convolutions have no
bias. The body ends with global average pooling and a flatten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pflkit.models.base import (
    PFLModel,
    check_classes_and_image,
    map_init,
    option_error,
    torchvision_resnet_init,
)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BN and a residual connection (He et al. 2016)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x if self.shortcut is None else self.shortcut(x)
        return torch.relu_(out)


def _stage(in_planes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
    layers = [BasicBlock(in_planes, planes, stride)]
    layers += [BasicBlock(planes, planes, 1) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


# -- CIFAR-style 6n+2 ResNets (MAP code's ``ResNet``) ------------------------------------------


def _cifar_resnet(name: str, depth: int, input_shape: Sequence[int], num_classes: int) -> PFLModel:
    c, h, w = check_classes_and_image(name, input_shape, num_classes, 1)
    n = (depth - 2) // 6
    body = nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(c, 16, 3, stride=1, padding=1, bias=False),
            bn1=nn.BatchNorm2d(16),
            relu=nn.ReLU(),
            layer1=_stage(16, 16, n, 1),
            layer2=_stage(16, 32, n, 2),
            layer3=_stage(32, 64, n, 2),
            avgpool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
        )
    )
    model = PFLModel(
        body,
        nn.Linear(64, num_classes, bias=False),
        64,
        name=name,
        input_shape=(c, h, w),
        num_classes=num_classes,
    )
    map_init(model)
    return model


def resnet20(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """MAP code's ResNet20 (n = 3): 3x3 stem with 16 channels, stages 16/32/64, projection
    shortcuts, global average pool (64) -> bias-free Linear head. MAP init."""
    return _cifar_resnet("resnet20", 20, input_shape, num_classes)


def resnet56(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """MAP code's ResNet56 (n = 9); otherwise as ResNet20."""
    return _cifar_resnet("resnet56", 56, input_shape, num_classes)


# -- ResNet-18 ---------------------------------------------------------------------------------

STEMS = ("cifar", "imagenet")


def resnet18(input_shape: Sequence[int], num_classes: int, stem: str = "cifar") -> PFLModel:
    """ResNet-18: BasicBlocks [2, 2, 2, 2] with 64/128/256/512 channels, global average pool
    (512) [end of body], Linear(512->C) head (with bias).

    ``stem="cifar"`` (default): 3x3 stride-1 conv, BN, ReLU, no max-pool, as KT-pFL's code;
    PyTorch default init (as that code). ``stem="imagenet"``: torchvision's ``resnet18`` (7x7
    stride-2 conv, BN, ReLU, 3x3 stride-2 max-pool), as GPFL trains it from scratch on
    Tiny-ImageNet; torchvision's init (Kaiming-normal fan_out convs, BN 1/0, default Linear).
    """
    name = "resnet18"
    if stem not in STEMS:
        raise option_error(name, "stem", stem, "'cifar' or 'imagenet'")
    c, h, w = check_classes_and_image(name, input_shape, num_classes, 1)
    if stem == "cifar":
        stem_layers: list[tuple[str, nn.Module]] = [
            ("conv1", nn.Conv2d(c, 64, 3, stride=1, padding=1, bias=False)),
            ("bn1", nn.BatchNorm2d(64)),
            ("relu", nn.ReLU()),
        ]
    else:
        stem_layers = [
            ("conv1", nn.Conv2d(c, 64, 7, stride=2, padding=3, bias=False)),
            ("bn1", nn.BatchNorm2d(64)),
            ("relu", nn.ReLU()),
            ("maxpool", nn.MaxPool2d(3, stride=2, padding=1)),
        ]
    body = nn.Sequential(
        OrderedDict(
            stem_layers
            + [
                ("layer1", _stage(64, 64, 2, 1)),
                ("layer2", _stage(64, 128, 2, 2)),
                ("layer3", _stage(128, 256, 2, 2)),
                ("layer4", _stage(256, 512, 2, 2)),
                ("avgpool", nn.AdaptiveAvgPool2d(1)),
                ("flatten", nn.Flatten()),
            ]
        )
    )
    model = PFLModel(
        body,
        nn.Linear(512, num_classes),
        512,
        name=name,
        input_shape=(c, h, w),
        num_classes=num_classes,
    )
    if stem == "imagenet":
        torchvision_resnet_init(model)
    return model
