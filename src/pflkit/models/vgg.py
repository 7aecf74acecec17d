"""VGG networks as in MAP's code (lxcnju/MAP, ``networks/basic_classify_nets.py``).

Conv3x3 (pad 1, with bias) [-> BatchNorm] -> ReLU per width, MaxPool2 at each "M", Flatten,
then a bias-free Linear head; no hidden FC layers. After the five max-pools a 32x32 input is
1x1, so the feature is 512-d, as in the code. Larger inputs give 512 * (H//32) * (W//32)
features (the code supports only 32x32). MAP init.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from pflkit.models.base import PFLModel, check_classes_and_image, map_init

CONFIGS: dict[int, tuple[int | str, ...]] = {
    8: (64, "M", 128, "M", 256, "M", 512, "M", 512, "M"),
    11: (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
}


def _vgg(name: str, depth: int, input_shape: Sequence[int], num_classes: int, bn: bool) -> PFLModel:
    cfg = CONFIGS[depth]
    pools = cfg.count("M")
    c, h, w = check_classes_and_image(name, input_shape, num_classes, 2**pools)
    layers: list[tuple[str, nn.Module]] = []
    in_c, i, p = c, 0, 0
    for v in cfg:
        if v == "M":
            p += 1
            layers.append((f"pool{p}", nn.MaxPool2d(2, 2)))
            continue
        assert isinstance(v, int)
        i += 1
        layers.append((f"conv{i}", nn.Conv2d(in_c, v, 3, padding=1)))
        if bn:
            layers.append((f"bn{i}", nn.BatchNorm2d(v)))
        layers.append((f"relu{i}", nn.ReLU()))
        in_c = v
    layers.append(("flatten", nn.Flatten()))
    dim = in_c * (h >> pools) * (w >> pools)
    model = PFLModel(
        nn.Sequential(OrderedDict(layers)),
        nn.Linear(dim, num_classes, bias=False),
        dim,
        name=name,
        input_shape=(c, h, w),
        num_classes=num_classes,
    )
    map_init(model)
    return model


def vgg8(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """MAP code's VGG8: 5 conv layers [64, M, 128, M, 256, M, 512, M, 512, M], no BN."""
    return _vgg("vgg8", 8, input_shape, num_classes, bn=False)


def vgg8_bn(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """MAP code's VGG8-BN: VGG8 with BatchNorm2d after every conv."""
    return _vgg("vgg8_bn", 8, input_shape, num_classes, bn=True)


def vgg11(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """MAP code's VGG11 (no BN): [64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M]."""
    return _vgg("vgg11", 11, input_shape, num_classes, bn=False)
