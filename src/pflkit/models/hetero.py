"""KT-pFL's heterogeneous model zoo: the small-input AlexNet and ShuffleNetV2, plus ResNet-8.

KT-pFL (Zhang et al., NeurIPS 2021) trains 20 clients, five each of LeNet, AlexNet, ResNet-18 and
ShuffleNetV2 (specs/ktpfl.md §4). LeNet is ``lenet5`` (``cnn.py``) and ResNet-18 is ``resnet18``
with its default ``stem="cifar"`` (``resnet.py``); this module adds the other two, built as the
authors' code (github.com/cugzj/KT-pFL, ``src/model.py``) defines them, with the input channels
and the flatten width computed from the input shape (the code hard-codes 3 channels and 28x28).

Paper zoo (Table 1), 10 classes, 1x28x28 input (Fashion-MNIST / EMNIST; 3x32x32 for CIFAR-10)::

    per_client: [{name: lenet5, count: 5}, {name: alexnet, count: 5},
                 {name: resnet18, count: 5}, {name: shufflenetv2, count: 5}]

Small CPU zoo (same four roles, a few times to a few hundred times cheaper; ``docs/ktpfl.md``)::

    per_client: [{name: lenet5, count: 5},
                 {name: alexnet, options: {width: 0.25, hidden: 256, init: kaiming}, count: 5},
                 {name: resnet8, options: {stem_stride: 2}, count: 5},
                 {name: shufflenetv2, options: {width: 0.5, stem_stride: 2, units: [1, 2, 1]},
                  count: 5}]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pflkit.models.base import (
    ModelInfo,
    PFLModel,
    check_classes_and_image,
    conv_out,
    option_error,
    positive_int,
)
from pflkit.models.resnet import BasicBlock

# -- AlexNet (small-input, KT-pFL code) -----------------------------------------------------------

_ALEXNET_CHANNELS = (64, 192, 384, 256, 256)


def _alexnet_side(n: int) -> int:
    """conv3x3 s2 p1 -> pool2 -> conv -> pool2 -> 3 convs -> pool2 (28 -> 14 -> 7 -> 3 -> 1)."""
    return conv_out(conv_out(conv_out(conv_out(n, 3, 2, 1), 2, 2), 2, 2), 2, 2)


_ALEXNET_MIN = next(n for n in range(1, 4097) if _alexnet_side(n) >= 1)


def alexnet(
    input_shape: Sequence[int],
    num_classes: int,
    width: float = 1.0,
    hidden: int = 4096,
    init: str = "default",
) -> PFLModel:
    """KT-pFL code's small-input AlexNet: Conv(C->64, 3, stride 2, pad 1) ReLU MaxPool2,
    Conv(64->192, 3, pad 1) ReLU MaxPool2, Conv(192->384) ReLU, Conv(384->256) ReLU,
    Conv(256->256) ReLU MaxPool2 (all 3x3 pad 1), Flatten (256 at 28x28, 1024 at 32x32),
    Dropout(0.5) FC(->4096) ReLU Dropout(0.5) FC(4096->4096) ReLU [end of body, feature_dim
    4096], FC(4096->C) head. PyTorch default init. 20.1 M parameters at 3x28x28, 10 classes.

    ``width`` scales every conv's channels and ``hidden`` sets the two FC widths (1.0 and 4096
    are the code's). ``init="kaiming"`` re-initialises every conv and linear layer with
    Kaiming-normal weights (fan_in, ReLU gain) and zero biases: with PyTorch's default init
    (the code's) this 8-layer network without BatchNorm stayed at chance level in our check
    (150 Fashion-MNIST images, 60 epochs of SGD; widths 0.25-1, lr 0.01-0.2); with Kaiming
    init it reached about 70%. The small CPU zoo uses ``width=0.25, hidden=256, init="kaiming"``.
    """
    name = "alexnet"
    if isinstance(width, bool) or not isinstance(width, int | float) or not 0 < width <= 4:
        raise option_error(name, "width", width, "a number in (0, 4]")
    hidden = positive_int(name, "hidden", hidden)
    if init not in ("default", "kaiming"):
        raise option_error(name, "init", init, "'default' or 'kaiming'")
    c, h, w = check_classes_and_image(name, input_shape, num_classes, _ALEXNET_MIN)
    ch = [max(int(round(k * width)), 1) for k in _ALEXNET_CHANNELS]
    dim = ch[4] * _alexnet_side(h) * _alexnet_side(w)
    body = nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(c, ch[0], 3, stride=2, padding=1),
            relu1=nn.ReLU(),
            pool1=nn.MaxPool2d(2),
            conv2=nn.Conv2d(ch[0], ch[1], 3, padding=1),
            relu2=nn.ReLU(),
            pool2=nn.MaxPool2d(2),
            conv3=nn.Conv2d(ch[1], ch[2], 3, padding=1),
            relu3=nn.ReLU(),
            conv4=nn.Conv2d(ch[2], ch[3], 3, padding=1),
            relu4=nn.ReLU(),
            conv5=nn.Conv2d(ch[3], ch[4], 3, padding=1),
            relu5=nn.ReLU(),
            pool5=nn.MaxPool2d(2),
            flatten=nn.Flatten(),
            drop6=nn.Dropout(0.5),
            fc6=nn.Linear(dim, hidden),
            relu6=nn.ReLU(),
            drop7=nn.Dropout(0.5),
            fc7=nn.Linear(hidden, hidden),
            relu7=nn.ReLU(),
        )
    )
    model = PFLModel(
        body,
        nn.Linear(hidden, num_classes),
        hidden,
        name=name,
        input_shape=(c, h, w),
        num_classes=num_classes,
    )
    if init == "kaiming":
        for m in model.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                if m.bias is not None:  # every Conv2d and Linear here has one
                    nn.init.zeros_(m.bias)
    return model


# -- ShuffleNetV2 (Ma et al., ECCV 2018; KT-pFL code's CIFAR variant) ------------------------------

# stage output channels and the final 1x1 conv width per width multiplier (ShuffleNetV2 Table 5)
_SHUFFLE_WIDTHS = {
    0.5: (48, 96, 192, 1024),
    1.0: (116, 232, 464, 1024),
    1.5: (176, 352, 704, 1024),
    2.0: (244, 488, 976, 2048),
}
_SHUFFLE_UNITS = (4, 8, 4)  # units per stage; the first unit of each stage has stride 2


def _conv_bn(
    cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, relu: bool = True
) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups),
        nn.BatchNorm2d(cout),
    ]
    if relu:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def channel_shuffle(x: Tensor, groups: int = 2) -> Tensor:
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class ShuffleUnit(nn.Module):
    """One ShuffleNetV2 unit.

    Stride 1 (same width): split the channels in half; one half passes through, the other goes
    through 1x1 conv-BN-ReLU, depthwise 3x3 conv-BN, 1x1 conv-BN-ReLU; concatenate, shuffle.
    Stride 2 (down-sampling): both branches see the whole input; the main branch is as above
    with a strided depthwise conv, the projection branch is depthwise 3x3 (strided) conv-BN,
    1x1 conv-BN-ReLU; each gives half of the output channels; concatenate, shuffle.
    """

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.down = stride != 1 or cin != cout
        half = cout // 2
        mid = cin if self.down else cin // 2
        self.main = nn.Sequential(
            _conv_bn(mid, mid, 1),
            _conv_bn(mid, mid, 3, stride=stride, groups=mid, relu=False),
            _conv_bn(mid, half, 1),
        )
        self.proj: nn.Module | None = None
        if self.down:
            self.proj = nn.Sequential(
                _conv_bn(cin, cin, 3, stride=stride, groups=cin, relu=False),
                _conv_bn(cin, half, 1),
            )

    def forward(self, x: Tensor) -> Tensor:
        if self.proj is None:
            keep, work = x.chunk(2, dim=1)
        else:
            keep, work = self.proj(x), x
        return channel_shuffle(torch.cat([keep, self.main(work)], dim=1))


def shufflenetv2(
    input_shape: Sequence[int],
    num_classes: int,
    width: float = 1.0,
    stem_stride: int = 1,
    units: Sequence[int] = _SHUFFLE_UNITS,
) -> PFLModel:
    """ShuffleNetV2 as KT-pFL's code builds it (the common CIFAR variant): stem Conv(C->24, 3x3,
    pad 1) + BN (no ReLU, no max-pool); three stages of 4/8/4 units (:class:`ShuffleUnit`) with
    116/232/464 channels at ``width=1.0``, the first unit of each stage with stride 2; Conv 1x1
    (->1024) BN ReLU; global average pool [end of body, feature_dim 1024]; Linear(1024->C) head.
    Convolutions have biases, as in that code. PyTorch default init. About 1.27 M parameters at
    ``width=1.0`` with 10 classes.

    ``width`` is the ShuffleNetV2 multiplier: 0.5, 1.0 (default, the paper's "1.0x"), 1.5, 2.0.
    ``stem_stride=2`` makes the stem convolution strided (4x fewer positions everywhere after
    it); 1 is the code's. ``units`` sets the number of units per stage (the code's 4/8/4).
    The small CPU zoo uses ``width=0.5, stem_stride=2, units=[1, 2, 1]``.
    """
    name = "shufflenetv2"
    if isinstance(width, bool) or width not in _SHUFFLE_WIDTHS:
        raise option_error(name, "width", width, "one of 0.5, 1.0, 1.5, 2.0")
    stem_stride = positive_int(name, "stem_stride", stem_stride)
    if isinstance(units, str) or not isinstance(units, Sequence) or len(units) != 3:
        raise option_error(name, "units", units, "three positive integers, e.g. [4, 8, 4]")
    units = [positive_int(name, "units", u) for u in units]
    c, h, w = check_classes_and_image(name, input_shape, num_classes, 1)
    widths = _SHUFFLE_WIDTHS[float(width)]
    layers: list[tuple[str, nn.Module]] = [
        ("stem", _conv_bn(c, 24, 3, stride=stem_stride, relu=False))
    ]
    cin = 24
    for s, (cout, count) in enumerate(zip(widths[:3], units, strict=True), start=2):
        stage = [ShuffleUnit(cin, cout, 2)] + [ShuffleUnit(cout, cout, 1) for _ in range(count - 1)]
        layers.append((f"stage{s}", nn.Sequential(*stage)))
        cin = cout
    layers += [
        ("conv5", _conv_bn(cin, widths[3], 1)),
        ("avgpool", nn.AdaptiveAvgPool2d(1)),
        ("flatten", nn.Flatten()),
    ]
    return PFLModel(
        nn.Sequential(OrderedDict(layers)),
        nn.Linear(widths[3], num_classes),
        widths[3],
        name=name,
        input_shape=(c, h, w),
        num_classes=num_classes,
    )


# -- ResNet-8 (the small zoo's ResNet) -------------------------------------------------------------


def resnet8(
    input_shape: Sequence[int], num_classes: int, width: int = 16, stem_stride: int = 1
) -> PFLModel:
    """CIFAR-style ResNet-8 (He et al. 2016, 6n+2 with n = 1): Conv3x3(C->width, stride
    ``stem_stride``) BN ReLU, three stages of one :class:`~pflkit.models.resnet.BasicBlock`
    each with width/2x/4x channels (strides 1, 2, 2; projection shortcuts), global average pool
    [end of body, feature_dim 4 * width], Linear(4 * width -> C) head. PyTorch default init.

    The small CPU zoo's stand-in for KT-pFL's ResNet-18 (``width=16, stem_stride=2``: 78 k
    parameters); not a model of any of the five papers.
    """
    name = "resnet8"
    width = positive_int(name, "width", width)
    stem_stride = positive_int(name, "stem_stride", stem_stride)
    c, h, w = check_classes_and_image(name, input_shape, num_classes, 1)
    body = nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(c, width, 3, stride=stem_stride, padding=1, bias=False),
            bn1=nn.BatchNorm2d(width),
            relu=nn.ReLU(),
            layer1=BasicBlock(width, width, 1),
            layer2=BasicBlock(width, 2 * width, 2),
            layer3=BasicBlock(2 * width, 4 * width, 2),
            avgpool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
        )
    )
    return PFLModel(
        body,
        nn.Linear(4 * width, num_classes),
        4 * width,
        name=name,
        input_shape=(c, h, w),
        num_classes=num_classes,
    )


ENTRIES = [
    ModelInfo(
        "alexnet",
        "KT-pFL code's small-input AlexNet: 5 conv3x3 (64-192-384-256-256, first stride 2), "
        "FC 4096-4096 with dropout, linear head; options width, hidden, init",
        alexnet,
    ),
    ModelInfo(
        "shufflenetv2",
        "ShuffleNetV2 (KT-pFL code's CIFAR variant: 3x3 stem, no max-pool, 4/8/4 units, conv "
        "biases); option width 0.5/1.0/1.5/2.0 (default 1.0x)",
        shufflenetv2,
    ),
    ModelInfo(
        "resnet8",
        "CIFAR-style ResNet-8 (one BasicBlock per stage, width/2x/4x channels); options width "
        "(16), stem_stride (1); the small KT-pFL zoo's ResNet (no paper's model)",
        resnet8,
    ),
]
