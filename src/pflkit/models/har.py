"""HAR-CNN: GPFL's model for UCI HAR (Zhang et al., ICCV 2023; specs/gpfl.md §4.3).

The network of the GPFL/PFLlib code (``HARCNN``, after Zeng et al. 2014 via
jindongwang/Deep-learning-activity-recognition), for 9 x 1 x 128 inertial windows:

    Conv2d(C -> 32, kernel (1, 9)) -> ReLU -> MaxPool2d(kernel (1, 2), stride 2)
    Conv2d(32 -> 64, kernel (1, 9)) -> ReLU -> MaxPool2d(kernel (1, 2), stride 2)
    Flatten (64 * 26 = 1664 at 9 x 1 x 128)
    Linear(1664 -> 1024) -> ReLU -> Linear(1024 -> 512) -> ReLU -> Linear(512 -> num_classes)

PyTorch's default initialisation (as the code). The pooling stride 2 applies to both axes, as
``MaxPool2d(kernel_size=(1, 2), stride=2)`` in the code; with height 1 it leaves the height at 1.

Where the body ends (option ``split``):

- ``"last"`` (default): the split of every other pflkit model (the ``PFLModel`` contract that
  methods reading the classifier's rows rely on: pFedSim, FedAwS), head = the last Linear only,
  body up to the second ReLU: ``feature_dim`` = 512, 2,250,880 body parameters.
- ``"code"``: as GPFL's code, which replaces the whole ``fc`` Sequential by the head, so the
  head is all three Linear layers and the body (phi) is the two conv blocks: ``feature_dim`` =
  1664, 21,120 body parameters. The paper only says "last FC layers"; GPFL's HAR numbers come
  from this split (configs/gpfl/har.yaml sets it).

Both splits create the layers in the same order, so the same seed gives the same weights.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from pflkit.errors import PflkitError
from pflkit.models.base import PFLModel, check_num_classes, check_shape, conv_out, option_error

SPLITS = ("code", "last")


def _width(n: int) -> int:
    """Time axis after [conv (1, 9) -> max-pool (1, 2) stride 2] twice: 128 -> 26."""
    return conv_out(conv_out(conv_out(conv_out(n, 9), 2, 2), 9), 2, 2)


def _height(n: int) -> int:
    """Height after the two blocks: kernel height 1, pooling stride 2 (1 stays 1)."""
    return conv_out(conv_out(n, 1, 2), 1, 2)


_MIN_WIDTH = next(n for n in range(1, 4097) if _width(n) >= 1)  # 28


def har_cnn(input_shape: Sequence[int], num_classes: int, split: str = "last") -> PFLModel:
    """GPFL/PFLlib code's HAR-CNN (module docstring); ``split`` = ``"last"`` (head = the last
    Linear, feature_dim 512) or ``"code"`` (head = the three Linear layers, feature_dim 1664)."""
    name = "har_cnn"
    if split not in SPLITS:
        raise option_error(name, "split", split, "'code' or 'last'")
    shape = check_shape(name, input_shape)
    check_num_classes(name, num_classes)
    if len(shape) != 3 or shape[2] < _MIN_WIDTH:
        raise PflkitError(
            f"model '{name}' needs input [C, H, W] with W >= {_MIN_WIDTH} time steps (UCI HAR "
            f"windows are (9, 1, 128)), got {shape}; use the 'har' dataset or a model that "
            "fits the data"
        )
    c, h, w = shape
    dim = 64 * _height(h) * _width(w)
    convs: list[tuple[str, nn.Module]] = [
        ("conv1", nn.Conv2d(c, 32, kernel_size=(1, 9))),
        ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(kernel_size=(1, 2), stride=2)),
        ("conv2", nn.Conv2d(32, 64, kernel_size=(1, 9))),
        ("relu2", nn.ReLU()),
        ("pool2", nn.MaxPool2d(kernel_size=(1, 2), stride=2)),
        ("flatten", nn.Flatten()),
    ]
    fcs: list[tuple[str, nn.Module]] = [
        ("fc1", nn.Linear(dim, 1024)),
        ("relu3", nn.ReLU()),
        ("fc2", nn.Linear(1024, 512)),
        ("relu4", nn.ReLU()),
    ]
    last = nn.Linear(512, num_classes)
    if split == "code":
        body = nn.Sequential(OrderedDict(convs))
        head: nn.Module = nn.Sequential(OrderedDict([*fcs, ("fc3", last)]))
        feature_dim = dim
    else:
        body = nn.Sequential(OrderedDict(convs + fcs))
        head = last
        feature_dim = 512
    return PFLModel(body, head, feature_dim, name=name, input_shape=shape, num_classes=num_classes)
