"""MobileNetV2 (Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks", CVPR
2018) as torchvision builds ``mobilenet_v2()`` with width 1.0 (``torchvision/models/
mobilenetv2.py`` gives the layers, their names and the init): pFedSim's model for Tiny-ImageNet
and DomainNet (paper App. A.4, Table 9; specs/pfedsim.md §4.4), which FL-bench takes from
torchvision (``src/utils/models.py`` lines 363-380 at 06e658b; ``src/config/models.py``
``MobileNetV2`` at 9382b2c, ImageNet weights IMAGENET1K_V2).

Layers (torchvision is the ground truth where Table 9 differs: its stem has stride 2, its 1x1
projection convs have no activation; spec §4.4):

- stem: Conv 3x3 stride 2 (3 -> 32) + BN + ReLU6;
- 17 inverted residual blocks from the settings (t, c, n, s) = (1, 16, 1, 1), (6, 24, 2, 2),
  (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1): n blocks of
  output width c, the first with stride s; each is [1x1 expand to t * in + BN + ReLU6 (only
  when t != 1)], 3x3 depthwise (stride) + BN + ReLU6, 1x1 projection + BN (linear), plus the
  input when the stride is 1 and the width unchanged;
- Conv 1x1 (320 -> 1280) + BN + ReLU6, adaptive average pool to 1x1, flatten, Dropout(0.2)
  [end of body: FL-bench replaces torchvision's ``classifier[1]`` by ``Identity``, so the
  dropout belongs to the extractor], head Linear(1280 -> num_classes).

Inputs: 3 x H x W with H, W >= 32. Below 64 px the last blocks run at 1 x 1, where BatchNorm in
training mode fails on a one-sample batch (a client's last batch can have one sample; pflkit
does not skip it, FL-bench does); pFedSim's Tiny-ImageNet and DomainNet are 64 x 64.

Convolutions have no bias. Module names under ``body`` are torchvision's (``features.0.0`` is
the stem conv, ``features.1.conv.0.0`` the first depthwise conv, ``features.18.1`` the last
BN), so a torchvision state dict maps by one rule: ``features.*`` -> ``body.features.*``; its
``classifier.1.*`` (the 1000-class ImageNet head) is dropped. 3,504,872 parameters with 1000
classes, torchvision's published count.

Initialisation: torchvision's (Conv2d Kaiming-normal, fan_out; BN weight 1, bias 0; Linear
N(0, 0.01), bias 0). With option ``pretrained: PATH`` (a local file holding a torchvision
``mobilenet_v2`` state dict, e.g. IMAGENET1K_V2 saved with ``torch.save``; nothing is ever
downloaded) the body takes those weights and the head keeps PyTorch's default Linear init, as
FL-bench's freshly built ``nn.Linear`` head (``src/utils/models.py`` line 377). A relative PATH
is relative to the current folder.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from pflkit.errors import PflkitError
from pflkit.models.base import PFLModel, check_classes_and_image, option_error

NAME = "mobilenet_v2"
# (expansion t, output channels c, blocks n, first stride s): torchvision's, paper Table 2
SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
            (6, 160, 3, 2), (6, 320, 1, 1))  # fmt: skip
STEM = 32
LAST = 1280
DROPOUT = 0.2
MIN_SIDE = 32  # five stride-2 stages: 32 px reach the last conv as 1x1
IMAGENET_HEAD = ("classifier.1.weight", "classifier.1.bias")  # dropped when loading
SAVE_HINT = (
    "save one with torch.save(torchvision.models.mobilenet_v2(weights='IMAGENET1K_V2')"
    ".state_dict(), PATH) (docs/pfedsim.md)"
)


def _conv_bn_relu6(
    c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1
) -> nn.Sequential:
    """torchvision's ``Conv2dNormActivation``: conv (no bias) [0], BN [1], ReLU6 [2]."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """[1x1 expand + BN + ReLU6], 3x3 depthwise + BN + ReLU6, 1x1 linear projection + BN; the
    input is added when ``stride == 1`` and ``c_in == c_out``."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(_conv_bn_relu6(c_in, hidden, 1))
        layers += [
            _conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.conv(x) if self.residual else self.conv(x)
        return out


def _features() -> nn.Sequential:
    layers: list[nn.Module] = [_conv_bn_relu6(3, STEM, 3, stride=2)]
    c_in = STEM
    for t, c, n, s in SETTINGS:
        for i in range(n):
            layers.append(InvertedResidual(c_in, c, s if i == 0 else 1, t))
            c_in = c
    layers.append(_conv_bn_relu6(c_in, LAST, 1))
    return nn.Sequential(*layers)


def _torchvision_init(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            nn.init.zeros_(m.bias)


def _fail(path: Path, problem: str) -> PflkitError:
    return PflkitError(f"model '{NAME}' option 'pretrained': {path} {problem}")


def _read_state(path: Path) -> Mapping[str, Tensor]:
    if not path.is_file():
        raise _fail(path, f"does not exist; {SAVE_HINT}, or remove the option")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, EOFError, RuntimeError, ValueError, pickle.UnpicklingError) as e:
        raise _fail(
            path, f"cannot be read as a PyTorch state dict ({type(e).__name__}); {SAVE_HINT}"
        ) from None
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()
    ):
        raise _fail(path, f"holds a {type(state).__name__}, not a state dict; {SAVE_HINT}")
    return state


def load_torchvision_weights(model: PFLModel, path: str | Path) -> None:
    """Load a torchvision ``mobilenet_v2`` state dict file into ``model.body``: key
    ``features.*`` -> ``body.features.*``; ``classifier.1.*`` (ImageNet's head) is dropped.
    Any other difference (a missing or unknown key, a shape) is one :class:`PflkitError`."""
    path = Path(path).expanduser()
    state = _read_state(path)
    want = model.body.state_dict()
    missing = [k for k in want if k not in state]
    if missing:
        raise _fail(
            path,
            f"lacks {len(missing)} of torchvision mobilenet_v2's {len(want)} feature keys "
            f"(first: '{missing[0]}'); {SAVE_HINT}",
        )
    unknown = [k for k in state if k not in want and k not in IMAGENET_HEAD]
    if unknown:
        raise _fail(
            path,
            f"has {len(unknown)} keys that torchvision's mobilenet_v2 does not (first: "
            f"'{unknown[0]}'); {SAVE_HINT}",
        )
    for key, value in want.items():
        if state[key].shape != value.shape:
            raise _fail(
                path,
                f"holds '{key}' of shape {list(state[key].shape)}, but mobilenet_v2 (width 1.0) "
                f"has {list(value.shape)}; {SAVE_HINT}",
            )
    model.body.load_state_dict({k: state[k] for k in want})


def mobilenet_v2(
    input_shape: Sequence[int], num_classes: int, pretrained: str | None = None
) -> PFLModel:
    """torchvision's MobileNetV2 (width 1.0) split as FL-bench: body = ``features`` + pool +
    flatten + Dropout(0.2) (feature_dim 1280), head = Linear(1280 -> C); see the module
    docstring. ``pretrained``: a torchvision state dict file for the body."""
    c, h, w = check_classes_and_image(NAME, input_shape, num_classes, MIN_SIDE)
    if c != 3:
        raise PflkitError(
            f"model '{NAME}' needs 3-channel (RGB) images, got {c} channels; use a colour "
            "dataset or another model"
        )
    if pretrained is not None and (not isinstance(pretrained, str) or not pretrained):
        raise option_error(NAME, "pretrained", pretrained, "a path to a state dict file")
    body = nn.Sequential(
        OrderedDict(
            features=_features(),
            avgpool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
            dropout=nn.Dropout(DROPOUT),
        )
    )
    head = nn.Linear(LAST, num_classes)
    model = PFLModel(body, head, LAST, name=NAME, input_shape=(c, h, w), num_classes=num_classes)
    if pretrained is None:
        _torchvision_init(model)
    else:  # every body tensor comes from the file; the head keeps PyTorch's init (FL-bench)
        load_torchvision_weights(model, pretrained)
    return model
