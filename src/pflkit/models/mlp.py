"""Fully connected models: a generic MLP and MAP's MLPNet."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from pflkit.models.base import (
    PFLModel,
    check_num_classes,
    check_shape,
    map_init,
    numel,
    option_error,
)


def _hidden_sizes(name: str, hidden: object) -> list[int]:
    if isinstance(hidden, int) and not isinstance(hidden, bool):
        hidden = [hidden]
    if not isinstance(hidden, Sequence) or isinstance(hidden, str):
        raise option_error(name, "hidden", hidden, "a list of positive integers, e.g. [200, 200]")
    sizes = list(hidden)
    if not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in sizes):
        raise option_error(name, "hidden", hidden, "a list of positive integers, e.g. [200, 200]")
    return sizes


def mlp(
    input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (200, 200)
) -> PFLModel:
    """Flatten -> [Linear -> ReLU] per hidden width -> Linear head. PyTorch default init.

    The default (200, 200) is FedAvg's "2NN" (McMahan et al. 2017). ``hidden=[]`` gives
    multinomial logistic regression (FedProx's model for Synthetic(α, β)): the body is only the
    flatten and ``feature_dim`` is the input size.
    """
    name = "mlp"
    shape = check_shape(name, input_shape)
    check_num_classes(name, num_classes)
    sizes = _hidden_sizes(name, hidden)
    layers: list[nn.Module] = [nn.Flatten()]
    width = numel(shape)
    for h in sizes:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    head = nn.Linear(width, num_classes)
    return PFLModel(
        nn.Sequential(*layers),
        head,
        width,
        name=name,
        input_shape=shape,
        num_classes=num_classes,
    )


def map_mlpnet(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """MAP code's ``MLPNet``: Flatten -> 1024 -> ReLU -> 1024 -> ReLU -> 128 -> ReLU, then a
    bias-free Linear(128, C) head; MAP's init (Linear N(0, 0.01)).

    The paper says "two hidden layers of 512 units"; the released code (which produced the
    tables) has 1024-1024-128, which is what is built here.
    """
    name = "map_mlpnet"
    shape = check_shape(name, input_shape)
    check_num_classes(name, num_classes)
    body = nn.Sequential(
        nn.Flatten(),
        nn.Linear(numel(shape), 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 128),
        nn.ReLU(),
    )
    head = nn.Linear(128, num_classes, bias=False)
    model = PFLModel(body, head, 128, name=name, input_shape=shape, num_classes=num_classes)
    map_init(model)
    return model
