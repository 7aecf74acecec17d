"""The model contract shared by every architecture in the zoo.

Every model is a :class:`PFLModel`: a ``body`` (feature extractor, output ``[B, feature_dim]``)
followed by a ``head`` (the classifier). Their state-dict keys therefore start with ``body.`` or
``head.``, which is how algorithms split shared and private parts (FedPer/FedRep/pFedSim share
the body, GPFL/FedProto/pFedPM read features, FedRoD/FedPHP use private heads...).

This module also holds the input checks and the weight initialisations the architectures use.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from pflkit.errors import PflkitError


class PFLModel(nn.Module):
    """A classifier split into ``body`` (features ``[B, feature_dim]``) and ``head``.

    ``forward(x) == head(body(x))`` exactly, and ``features(x) == body(x)``. Nothing else runs
    in ``forward``: the training loop pays only for the layers.
    """

    body: nn.Module
    head: nn.Module
    feature_dim: int

    def __init__(
        self,
        body: nn.Module,
        head: nn.Module,
        feature_dim: int,
        *,
        name: str = "",
        input_shape: tuple[int, ...] = (),
        num_classes: int = 0,
    ) -> None:
        super().__init__()
        self.body = body
        self.head = head
        self.feature_dim = int(feature_dim)
        # Plain attributes (not in the state dict): what the model was built for.
        self.name = name
        self.input_shape = tuple(input_shape)
        self.num_classes = int(num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.body(x))
        return out

    def features(self, x: Tensor) -> Tensor:
        """The body's output, flattened: ``[B, feature_dim]``."""
        out: Tensor = self.body(x)
        return out

    def group_keys(self, name: str) -> list[str]:
        """State-dict keys of the parameter group ``name``: ``"body"`` (feature extractor) or
        ``"head"`` (classifier)."""
        return [f"{name}.{k}" for k in self._group(name).state_dict()]

    def group_params(self, name: str) -> list[nn.Parameter]:
        """The trainable parameters of group ``name`` (``"body"`` or ``"head"``)."""
        return list(self._group(name).parameters())

    def _group(self, name: str) -> nn.Module:
        if name not in ("body", "head"):
            raise ValueError(f"unknown parameter group {name!r}: use 'body' or 'head'")
        return self.body if name == "body" else self.head

    def extra_repr(self) -> str:
        return (
            f"name={self.name!r}, input_shape={self.input_shape}, "
            f"num_classes={self.num_classes}, feature_dim={self.feature_dim}"
        )


@dataclass(frozen=True)
class ModelInfo:
    """A registry entry: ``factory(input_shape, num_classes, **options) -> PFLModel``."""

    name: str
    description: str  # one line for `pflkit list`; says which version (paper/code) is built
    factory: Callable[..., PFLModel]


# -- input checks ------------------------------------------------------------------------------


def check_shape(name: str, input_shape: Sequence[int]) -> tuple[int, ...]:
    """``input_shape`` as a tuple of positive ints, or a :class:`PflkitError`."""
    try:  # operator.index accepts Python, NumPy and torch integers, and rejects 28.0 or "28"
        shape = tuple(operator.index(d) for d in input_shape)
    except TypeError:
        shape = ()
    if not shape or min(shape) < 1:
        raise PflkitError(
            f"model '{name}' needs an input shape of positive integers (per sample, no batch "
            f"dimension, e.g. (1, 28, 28) or (60,)), got {input_shape!r}"
        )
    return shape


def check_num_classes(name: str, num_classes: int) -> int:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise PflkitError(
            f"model '{name}' needs num_classes to be an integer >= 2, got {num_classes!r}; "
            "check the dataset's label count"
        )
    return num_classes


def image_shape(name: str, input_shape: Sequence[int], min_hw: int) -> tuple[int, int, int]:
    """``(C, H, W)`` from ``input_shape``, or an error naming the smallest size that fits."""
    shape = check_shape(name, input_shape)
    if len(shape) != 3 or shape[1] < min_hw or shape[2] < min_hw:
        raise PflkitError(
            f"model '{name}' needs image input [C, H, W] with H, W >= {min_hw}, got {shape}; "
            "pick a model that fits the dataset (`mlp` takes any input)"
        )
    return shape[0], shape[1], shape[2]


def check_classes_and_image(
    name: str, input_shape: Sequence[int], num_classes: int, min_hw: int
) -> tuple[int, int, int]:
    check_num_classes(name, num_classes)
    return image_shape(name, input_shape, min_hw)


def option_error(name: str, option: str, value: object, expected: str) -> PflkitError:
    return PflkitError(f"model '{name}' option '{option}' must be {expected}, got {value!r}")


def positive_int(name: str, option: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise option_error(name, option, value, "a positive integer")
    return value


def boolean(name: str, option: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise option_error(name, option, value, "true or false")
    return value


# -- output sizes ------------------------------------------------------------------------------


def conv_out(n: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Spatial size after a convolution or pooling layer (floor mode)."""
    return (n + 2 * padding - kernel) // stride + 1


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


# -- initialisations ---------------------------------------------------------------------------


def map_init(module: nn.Module) -> None:
    """MAP/FedRepo code's ``weights_init`` (``utils.py``), applied to every submodule.

    Conv2d: Kaiming-normal (fan_out, relu), bias 0; BatchNorm2d: weight 1, bias 0;
    Linear: N(0, 0.01), bias 0.
    """
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def torchvision_resnet_init(module: nn.Module) -> None:
    """torchvision ResNet's init: Conv2d Kaiming-normal (fan_out, relu); BN weight 1, bias 0.

    Linear layers keep PyTorch's default init, as in torchvision.
    """
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d | nn.GroupNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
