"""Small convolutional networks used by the five papers.

Input sizes are generalised where the source hard-codes them (e.g. MAP's LeNet accepts only
28 or 32 pixels, TFCNN only 3 channels): the flatten width is computed from ``input_shape``, so
the same definition serves Fashion-MNIST (1x28x28), CIFAR (3x32x32) and others. At the sources'
own input sizes the architectures are identical to the sources.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from torch import nn

from pflkit.models.base import (
    PFLModel,
    boolean,
    check_classes_and_image,
    conv_out,
    map_init,
    positive_int,
)


def _min_side(side: Callable[[int], int]) -> int:
    """Smallest input side for which ``side(n) >= 1`` (the network's output is not empty)."""
    return next(n for n in range(1, 4097) if side(n) >= 1)


def _two_conv5_pool(n: int) -> int:
    """[conv 5x5 (no pad) -> maxpool 2] twice: LeNet-style geometry (28 -> 4, 32 -> 5)."""
    return conv_out(conv_out(conv_out(conv_out(n, 5), 2, 2), 5), 2, 2)


_LENET_MIN = _min_side(_two_conv5_pool)


def _tfcnn_side(n: int) -> int:
    return n // 8  # three same-padded 3x3 convs, each followed by maxpool 2


_TFCNN_MIN = _min_side(_tfcnn_side)


def _femnist_side(n: int) -> int:
    return n // 2  # conv5 pad 2 keeps the size; one maxpool 2; then adaptive pooling to 4x4


_FEMNIST_MIN = _min_side(_femnist_side)


def _model(
    name: str,
    body: list[tuple[str, nn.Module]],
    head: nn.Module,
    feature_dim: int,
    input_shape: Sequence[int],
    num_classes: int,
) -> PFLModel:
    return PFLModel(
        nn.Sequential(OrderedDict(body)),
        head,
        feature_dim,
        name=name,
        input_shape=tuple(input_shape),
        num_classes=num_classes,
    )


# -- MAP (lxcnju/MAP, networks/basic_classify_nets.py) -----------------------------------------


def map_lenet(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """MAP code's ``LeNet``: Conv(C->16, 5) ReLU MaxPool2, Conv(16->16, 5) ReLU MaxPool2, Flatten
    (256 at 28x28, 400 at 32x32) -> bias-free Linear head. MAP init."""
    name = "map_lenet"
    c, h, w = check_classes_and_image(name, input_shape, num_classes, _LENET_MIN)
    dim = 16 * _two_conv5_pool(h) * _two_conv5_pool(w)
    body = [
        ("conv1", nn.Conv2d(c, 16, 5)),
        ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(16, 16, 5)),
        ("relu2", nn.ReLU()),
        ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
    ]
    model = _model(name, body, nn.Linear(dim, num_classes, bias=False), dim, (c, h, w), num_classes)
    map_init(model)
    return model


def tfcnn(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """MAP code's ``TFCNN``: 3 x [Conv3x3 pad 1 -> ReLU -> MaxPool2] with 32/64/64 channels,
    Flatten (1024 at 32x32) -> bias-free Linear head. MAP init."""
    name = "tfcnn"
    c, h, w = check_classes_and_image(name, input_shape, num_classes, _TFCNN_MIN)
    body: list[tuple[str, nn.Module]] = []
    in_c = c
    for i, out_c in enumerate((32, 64, 64), start=1):
        body += [
            (f"conv{i}", nn.Conv2d(in_c, out_c, 3, padding=1)),
            (f"relu{i}", nn.ReLU()),
            (f"pool{i}", nn.MaxPool2d(2)),
        ]
        in_c = out_c
    body.append(("flatten", nn.Flatten()))
    dim = 64 * _tfcnn_side(h) * _tfcnn_side(w)
    model = _model(name, body, nn.Linear(dim, num_classes, bias=False), dim, (c, h, w), num_classes)
    map_init(model)
    return model


def femnist_cnn(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """MAP code's ``FeMnistNet``: Conv(C->32, 5, pad 2) ReLU MaxPool2, Conv(32->64, 5, pad 2)
    ReLU, AdaptiveAvgPool(4x4), Flatten (1024) -> bias-free Linear head. MAP init."""
    name = "femnist_cnn"
    c, h, w = check_classes_and_image(name, input_shape, num_classes, _FEMNIST_MIN)
    body = [
        ("conv1", nn.Conv2d(c, 32, 5, padding=2)),
        ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(32, 64, 5, padding=2)),
        ("relu2", nn.ReLU()),
        ("pool2", nn.AdaptiveAvgPool2d((4, 4))),
        ("flatten", nn.Flatten()),
    ]
    dim = 64 * 4 * 4
    model = _model(name, body, nn.Linear(dim, num_classes, bias=False), dim, (c, h, w), num_classes)
    map_init(model)
    return model


# -- PFLlib / GPFL -----------------------------------------------------------------------------


def cnn4(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """PFLlib's ``FedAvgCNN`` (GPFL's "4-layer CNN"): Conv(C->32, 5) ReLU MaxPool2,
    Conv(32->64, 5) ReLU MaxPool2, Flatten (1024 at 28x28, 1600 at 32x32), FC(->512) ReLU
    [end of body, feature_dim 512], FC(512->C) head. PyTorch default init."""
    name = "cnn4"
    c, h, w = check_classes_and_image(name, input_shape, num_classes, _LENET_MIN)
    dim = 64 * _two_conv5_pool(h) * _two_conv5_pool(w)
    body = [
        ("conv1", nn.Conv2d(c, 32, 5)),
        ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(32, 64, 5)),
        ("relu2", nn.ReLU()),
        ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(dim, 512)),
        ("relu3", nn.ReLU()),
    ]
    return _model(name, body, nn.Linear(512, num_classes), 512, (c, h, w), num_classes)


# -- LeNet-5 (pFedSim / FL-bench, KT-pFL) ------------------------------------------------------


def _lenet5(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    *,
    bn: bool,
    fc_relu: bool,
) -> PFLModel:
    c, h, w = check_classes_and_image(name, input_shape, num_classes, _LENET_MIN)
    dim = 16 * _two_conv5_pool(h) * _two_conv5_pool(w)
    body: list[tuple[str, nn.Module]] = [("conv1", nn.Conv2d(c, 6, 5))]
    if bn:
        body.append(("bn1", nn.BatchNorm2d(6)))
    body += [("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)), ("conv2", nn.Conv2d(6, 16, 5))]
    if bn:
        body.append(("bn2", nn.BatchNorm2d(16)))
    body += [
        ("relu2", nn.ReLU()),
        ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(dim, 120)),
        ("relu3", nn.ReLU()),
        ("fc2", nn.Linear(120, 84)),
    ]
    if fc_relu:
        body.append(("relu4", nn.ReLU()))
    return _model(name, body, nn.Linear(84, num_classes), 84, (c, h, w), num_classes)


def lenet5_bn(input_shape: Sequence[int], num_classes: int, fc_relu: bool = False) -> PFLModel:
    """pFedSim's LeNet5 (paper Table 5 / FL-bench code): [Conv5 -> BN -> ReLU -> MaxPool2] with
    6 and 16 channels, Flatten (400 at 32x32, 256 at 28x28) -> FC 120 -> ReLU -> FC 84 [end of
    body], FC(84->C) head. PyTorch default init.

    ``fc_relu=False`` (default) is the 2023 code used for the paper: no activation after
    FC(84). ``fc_relu=True`` adds the ReLU there, as FL-bench does since June 2024.
    """
    fc_relu = boolean("lenet5_bn", "fc_relu", fc_relu)
    return _lenet5("lenet5_bn", input_shape, num_classes, bn=True, fc_relu=fc_relu)


def lenet5(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """KT-pFL code's ``LeNet`` (classic LeNet-5, no BN): [Conv5 -> ReLU -> MaxPool2] with 6 and 16
    channels, FC 120 -> ReLU -> FC 84 -> ReLU [end of body], FC(84->C) head. PyTorch default
    init. 44,726 parameters on 3x28x28 input with 10 classes."""
    return _lenet5("lenet5", input_shape, num_classes, bn=False, fc_relu=True)


# -- FedProto / pFedPM -------------------------------------------------------------------------


def fedproto_cnn(
    input_shape: Sequence[int], num_classes: int, channels: int = 20, conv1_kernel: int = 5
) -> PFLModel:
    """FedProto code's ``CNNMnist``/``CNNFemnist`` (pFedPM's MNIST/FEMNIST CNN):
    Conv(C->10, k) MaxPool2 ReLU, Conv(10->channels, 5) Dropout2d MaxPool2 ReLU, Flatten,
    FC(->50) ReLU = the feature / prototype (d = 50) [end of body]; head = Dropout(0.5) ->
    FC(50->C). PyTorch default init.

    ``channels`` is the second conv's width (20; FedProto's heterogeneous runs use 18/20/22);
    ``conv1_kernel`` is 5 for MNIST and 3 for FEMNIST (128x128 input). The source's final
    log-softmax is left out: the model returns logits (cross-entropy on logits equals NLL on
    log-softmax). The head is Dropout + Linear because the source applies dropout after the
    prototype is taken.
    """
    name = "fedproto_cnn"
    channels = positive_int(name, "channels", channels)
    k = positive_int(name, "conv1_kernel", conv1_kernel)

    def side(n: int) -> int:
        return conv_out(conv_out(conv_out(conv_out(n, k), 2, 2), 5), 2, 2)

    c, h, w = check_classes_and_image(name, input_shape, num_classes, _min_side(side))
    dim = channels * side(h) * side(w)
    body = [
        ("conv1", nn.Conv2d(c, 10, k)),
        ("pool1", nn.MaxPool2d(2)),
        ("relu1", nn.ReLU()),
        ("conv2", nn.Conv2d(10, channels, 5)),
        ("drop2", nn.Dropout2d()),
        ("pool2", nn.MaxPool2d(2)),
        ("relu2", nn.ReLU()),
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(dim, 50)),
        ("relu3", nn.ReLU()),
    ]
    head = nn.Sequential(nn.Dropout(0.5), nn.Linear(50, num_classes))
    return _model(name, body, head, 50, (c, h, w), num_classes)
