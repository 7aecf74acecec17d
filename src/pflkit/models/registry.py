"""The model registry: name -> :class:`ModelInfo`, and :func:`build_model`."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from pflkit.errors import PflkitError
from pflkit.models.base import ModelInfo, PFLModel, check_num_classes, check_shape
from pflkit.models.cnn import cnn4, fedproto_cnn, femnist_cnn, lenet5, lenet5_bn, map_lenet, tfcnn
from pflkit.models.har import har_cnn
from pflkit.models.hetero import ENTRIES as HETERO_ENTRIES
from pflkit.models.lm import gru_lm
from pflkit.models.mlp import map_mlpnet, mlp
from pflkit.models.mobilenet import mobilenet_v2
from pflkit.models.resnet import resnet18, resnet20, resnet56
from pflkit.models.text import amazon_mlp, fasttext
from pflkit.models.vgg import vgg8, vgg8_bn, vgg11
from pflkit.registry import Registry

_ENTRIES = [
    ModelInfo(
        "mlp",
        "generic MLP: flatten -> hidden ReLU layers (option hidden, default [200, 200] = "
        "FedAvg paper's 2NN; [] = logistic regression) -> linear head; any input",
        mlp,
    ),
    ModelInfo(
        "map_mlpnet",
        "MAP code's MLPNet: 784-1024-1024-128 ReLU + bias-free head (the code's version, not "
        "the paper's 'two hidden layers of 512')",
        map_mlpnet,
    ),
    ModelInfo(
        "map_lenet",
        "MAP code's LeNet: conv 16-16 5x5 + bias-free head, no FC hidden layers (code version; "
        "the paper says 'original LeNet')",
        map_lenet,
    ),
    ModelInfo(
        "cnn4",
        "PFLlib code's FedAvgCNN (GPFL's 4-layer CNN): conv 32-64 5x5, FC 512 (feature), "
        "linear head",
        cnn4,
    ),
    ModelInfo(
        "tfcnn",
        "MAP code's TFCNN: 3 x conv3x3 (32-64-64) + pool, bias-free head (code version; the "
        "paper says 'the CNN of FedAvg')",
        tfcnn,
    ),
    ModelInfo(
        "vgg8",
        "MAP code's VGG8: 5 conv3x3 (64-128-256-512-512), no BN, no FC hidden, bias-free head",
        vgg8,
    ),
    ModelInfo(
        "vgg8_bn",
        "MAP code's VGG8-BN: VGG8 with BatchNorm after every conv, bias-free head",
        vgg8_bn,
    ),
    ModelInfo(
        "vgg11",
        "MAP code's VGG11: 8 conv3x3, no BN, no FC hidden, bias-free head",
        vgg11,
    ),
    ModelInfo(
        "resnet20",
        "MAP code's CIFAR-style ResNet20 (16/32/64, projection shortcuts), bias-free head",
        resnet20,
    ),
    ModelInfo(
        "resnet56",
        "MAP code's CIFAR-style ResNet56 (16/32/64, projection shortcuts), bias-free head",
        resnet56,
    ),
    ModelInfo(
        "resnet18",
        "ResNet-18; option stem: 'cifar' (3x3, no max-pool, KT-pFL code, default) or "
        "'imagenet' (torchvision's 7x7 + max-pool, as GPFL)",
        resnet18,
    ),
    ModelInfo(
        "lenet5_bn",
        "pFedSim's LeNet5 with BN (paper Table 5 / FL-bench 2023 code); option fc_relu adds "
        "FL-bench's 2024 ReLU after FC 84",
        lenet5_bn,
    ),
    ModelInfo(
        "mobilenet_v2",
        "torchvision's MobileNetV2 (pFedSim paper Table 9 / FL-bench code): inverted residuals "
        "to 1280, pool, dropout 0.2 (feature), linear head; option pretrained: a local "
        "torchvision state dict file (ImageNet weights)",
        mobilenet_v2,
    ),
    ModelInfo(
        "lenet5",
        "KT-pFL code's LeNet (classic LeNet-5, no BN: conv 6-16, FC 120-84, linear head)",
        lenet5,
    ),
    ModelInfo(
        "femnist_cnn",
        "MAP code's FeMnistNet: conv 32-64 5x5, adaptive avg-pool 4x4, bias-free head (code "
        "version of the paper's 'two conv layers and one FC layer')",
        femnist_cnn,
    ),
    ModelInfo(
        "fedproto_cnn",
        "FedProto code's CNNMnist/CNNFemnist as used by pFedPM: conv 10-c, FC 50 (feature), "
        "dropout + linear head; options channels, conv1_kernel",
        fedproto_cnn,
    ),
    ModelInfo(
        "fasttext",
        "GPFL code's fastText for token ids: embedding (vocab_size x hidden 32, padding 0) mean "
        "over all positions, Linear hidden (feature, no activation), linear head; variant pfllib",
        fasttext,
    ),
    ModelInfo(
        "amazon_mlp",
        "KD3A code's AmazonMLP (GPFL's 3-layer MLP for Amazon Review): in-1000-500-100 ReLU "
        "(feature 100), linear head",
        amazon_mlp,
    ),
    ModelInfo(
        "har_cnn",
        "GPFL/PFLlib code's HAR-CNN for 9x1x128 windows: conv 32-64 (1x9), FC 1024-512-C; "
        "option split: 'last' (head = last FC, default) or 'code' (head = 3 FC, feature 1664)",
        har_cnn,
    ),
    ModelInfo(
        "gru_lm",
        "pflkit's own small GRU language model (no paper's code) for next-token prediction: "
        "embedding (vocab x embed 64), 1-layer GRU (hidden 128, the body), per-position head",
        gru_lm,
    ),
]

_ENTRIES += HETERO_ENTRIES  # alexnet, shufflenetv2 (KT-pFL), resnet8 (models/hetero.py)

MODELS: Registry[ModelInfo] = Registry("model", ModelInfo, _ENTRIES)


def model_options(name: str) -> dict[str, Any]:
    """The options model ``name`` accepts, with their defaults."""
    params = list(inspect.signature(MODELS.lookup(name).factory).parameters.values())[2:]
    return {p.name: p.default for p in params}


def build_model(
    name: str, input_shape: Sequence[int], num_classes: int, **options: Any
) -> PFLModel:
    """Build model ``name`` for per-sample ``input_shape`` (e.g. ``(1, 28, 28)`` or ``(60,)``)
    and ``num_classes`` outputs; ``options`` are the model's own (see :func:`model_options`).

    Initialisation draws from torch's global RNG, so ``torch.manual_seed`` before this call
    makes the weights reproducible.
    """
    known = model_options(name)
    for option in options:
        if option not in known:
            fix = f"its options are: {', '.join(sorted(known))}" if known else "it takes no options"
            raise PflkitError(f"model '{name}' has no option '{option}'; {fix}")
    check_shape(name, input_shape)
    check_num_classes(name, num_classes)
    try:
        return MODELS[name].factory(tuple(input_shape), num_classes, **options)
    except (MemoryError, OverflowError, RuntimeError) as err:  # e.g. hidden: [1000000000]
        if isinstance(err, RuntimeError) and "alloc" not in str(err).lower():
            raise
        raise PflkitError(
            f"model '{name}' with options {options} is too large to build here "
            f"({type(err).__name__}): use smaller options"
        ) from None
