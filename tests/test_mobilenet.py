"""MobileNetV2 (pFedSim Table 9, specs/pfedsim.md §4.4): torchvision's architecture, checked
against numbers published or derived here independently of the implementation, and the
``pretrained`` option that loads a torchvision state dict file (no torchvision needed)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import yaml
from torch import nn

from conftest import tiny_config
from domainnet_helpers import write_domainnet
from pflkit.errors import PflkitError
from pflkit.models import build_model, model_options
from pflkit.models.mobilenet import InvertedResidual

pytestmark = pytest.mark.usefixtures("one_thread")

# torchvision's key names and shapes for landmark layers of mobilenet_v2 (its source:
# Conv2dNormActivation = [conv, BN, ReLU6]; InvertedResidual.conv = [expand, depthwise,
# projection conv, BN], without the expand block when t = 1)
TORCHVISION_LANDMARKS = {
    "features.0.0.weight": (32, 3, 3, 3),  # stem conv
    "features.0.1.running_mean": (32,),
    "features.1.conv.0.0.weight": (32, 1, 3, 3),  # block 1 (t = 1): depthwise
    "features.1.conv.1.weight": (16, 32, 1, 1),  # its projection
    "features.1.conv.2.bias": (16,),
    "features.2.conv.0.0.weight": (96, 16, 1, 1),  # block 2 (t = 6): expand 16 -> 96
    "features.2.conv.1.0.weight": (96, 1, 3, 3),
    "features.2.conv.2.weight": (24, 96, 1, 1),
    "features.17.conv.2.weight": (320, 960, 1, 1),  # last block: 160 * 6 -> 320
    "features.18.0.weight": (1280, 320, 1, 1),  # last 1x1 conv
    "features.18.1.running_var": (1280,),
    "features.18.1.num_batches_tracked": (),
}
IMAGENET_HEAD = {"classifier.1.weight": (1000, 1280), "classifier.1.bias": (1000,)}
# features.* keys of torchvision's state dict, from the architecture: a conv has 1 key (no
# bias), a BN 5 (weight, bias, running_mean, running_var, num_batches_tracked). Stem and last
# conv: conv + BN = 6 each; block 1 (t = 1): 2 convs + 2 BN = 12; blocks 2-17 (16 blocks of
# t = 6): 3 convs + 3 BN = 18 each. 6 + 12 + 16 * 18 + 6 = 312 (+ 2 classifier keys = 314).
FEATURE_KEYS = 6 + 12 + 16 * 18 + 6
TORCHVISION_PARAMS = 3_504_872  # torchvision's published count for mobilenet_v2 (1000 classes)


def renamed(model) -> dict[str, torch.Tensor]:
    """The body's state dict under torchvision's names (body.features.* -> features.*)."""
    return {k.removeprefix("body."): v for k, v in model.state_dict().items() if k[:5] == "body."}


def test_shapes_and_split_at_64px_20_classes():
    torch.manual_seed(0)
    model = build_model("mobilenet_v2", (3, 64, 64), 20)
    assert model_options("mobilenet_v2") == {"pretrained": None}
    assert model.feature_dim == 1280 and isinstance(model.head, nn.Linear)
    assert (model.head.in_features, model.head.out_features) == (1280, 20)
    x = torch.randn(2, 3, 64, 64)
    model.eval()
    with torch.no_grad():
        assert model.body.features(x).shape == (2, 1280, 2, 2)  # five stride-2 stages: 64 / 32
        assert model.features(x).shape == (2, 1280) and model(x).shape == (2, 20)
        assert model.body.features[0](x).shape == (2, 32, 32, 32)  # the stem has stride 2
    assert isinstance(model.body[-1], nn.Dropout) and model.body[-1].p == 0.2  # last body layer
    model.train()  # the dropout is active in training
    assert not torch.equal(model.features(x), model.features(x))


def test_parameter_count_is_torchvisions():
    model = build_model("mobilenet_v2", (3, 224, 224), 1000)
    assert sum(p.numel() for p in model.parameters()) == TORCHVISION_PARAMS
    assert sum(p.numel() for p in model.head.parameters()) == 1280 * 1000 + 1000


def test_torchvision_key_names_and_shapes():
    state = renamed(build_model("mobilenet_v2", (3, 64, 64), 20))
    for key, shape in TORCHVISION_LANDMARKS.items():
        assert tuple(state[key].shape) == shape, key
    assert FEATURE_KEYS == 312
    assert len(state) == FEATURE_KEYS and all(k.startswith("features.") for k in state)


def test_activations_and_residuals():
    model = build_model("mobilenet_v2", (3, 64, 64), 20)
    feats = model.body.features
    # ReLU6 after the stem, block 1's depthwise, blocks 2-17's expand and depthwise, last conv;
    # none after a projection
    assert sum(isinstance(m, nn.ReLU6) for m in feats.modules()) == 1 + 1 + 16 * 2 + 1
    assert not any(isinstance(m, nn.ReLU | nn.ReLU6) for b in feats[1:18] for m in b.conv[-2:])
    # the input is added where the stride is 1 and the width unchanged (paper Fig. 4)
    residual = {3, 5, 6, 8, 9, 10, 12, 13, 15, 16}
    model.eval()
    with torch.no_grad():
        h = feats[0](torch.randn(2, 3, 32, 32))
        for i in range(1, 18):
            block = feats[i]
            assert isinstance(block, InvertedResidual)
            out = block(h)
            want = block.conv(h) + h if i in residual else block.conv(h)
            assert torch.equal(out, want), i
            h = out


def test_torchvision_init():
    torch.manual_seed(0)
    model = build_model("mobilenet_v2", (3, 64, 64), 20)
    conv = model.body.features[18][0]  # Kaiming-normal, fan_out = 1280: std sqrt(2 / 1280)
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2 / 1280), rel=0.05)
    assert model.head.weight.std().item() == pytest.approx(0.01, rel=0.05)
    assert torch.equal(model.head.bias, torch.zeros(20))
    bn = model.body.features[18][1]
    assert torch.equal(bn.weight, torch.ones(1280)) and torch.equal(bn.bias, torch.zeros(1280))


def test_input_checks():
    with pytest.raises(PflkitError, match=r"'mobilenet_v2' needs 3-channel \(RGB\) images, got 1"):
        build_model("mobilenet_v2", (1, 64, 64), 10)
    with pytest.raises(PflkitError, match=r"'mobilenet_v2' needs image input .*H, W >= 32"):
        build_model("mobilenet_v2", (3, 28, 28), 10)
    with pytest.raises(PflkitError, match="option 'pretrained' must be a path to a state dict"):
        build_model("mobilenet_v2", (3, 64, 64), 10, pretrained=5)


# ------------------------------------------------------------------------------------------
# pretrained: a torchvision state dict file
# ------------------------------------------------------------------------------------------


def torchvision_file(tmp_path, seed: int = 5) -> tuple:
    """A file as torch.save(torchvision.models.mobilenet_v2().state_dict()) writes it: every
    features.* tensor (distinct values) and the 1000-class classifier.1.*."""
    torch.manual_seed(seed)
    state = {k: torch.randn(v.shape) if v.is_floating_point() else torch.tensor(7)
             for k, v in renamed(build_model("mobilenet_v2", (3, 64, 64), 2)).items()}  # fmt: skip
    for key, shape in IMAGENET_HEAD.items():
        state[key] = torch.randn(shape)
    path = tmp_path / "mobilenet_v2-imagenet.pt"
    torch.save(state, path)
    return path, state


def test_pretrained_file_sets_the_body_and_drops_the_imagenet_head(tmp_path):
    path, state = torchvision_file(tmp_path)
    model = build_model("mobilenet_v2", (3, 64, 64), 20, pretrained=str(path))
    mine = model.state_dict()
    for key, value in state.items():
        if key.startswith("features."):
            assert torch.equal(mine[f"body.{key}"], value), key
    assert model.head.weight.shape == (20, 1280)
    # the head keeps PyTorch's default Linear init (FL-bench's fresh nn.Linear): uniform in
    # +-1/sqrt(1280), not torchvision's N(0, 0.01)
    bound = 1 / math.sqrt(1280)
    assert model.head.weight.abs().max().item() <= bound
    assert model.head.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    # a file without the classifier loads too
    del state["classifier.1.weight"], state["classifier.1.bias"]
    torch.save(state, tmp_path / "features.pt")
    again = build_model("mobilenet_v2", (3, 64, 64), 20, pretrained=str(tmp_path / "features.pt"))
    assert torch.equal(again.body.features[18][0].weight, mine["body.features.18.0.weight"])


def _bad_files(tmp_path):
    path, state = torchvision_file(tmp_path)
    yield tmp_path / "nowhere.pt", r"nowhere\.pt does not exist; save one with torch\.save\("
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    yield junk, r"junk\.pt cannot be read as a PyTorch state dict \(\w+\); save one with"
    listed = tmp_path / "list.pt"
    torch.save([1, 2], listed)
    yield listed, r"list\.pt holds a list, not a state dict; save one with"
    lacking = tmp_path / "lacking.pt"
    torch.save({k: v for k, v in state.items() if k != "features.7.conv.1.1.bias"}, lacking)
    yield (
        lacking,
        (
            r"lacking\.pt lacks 1 of torchvision mobilenet_v2's 312 feature keys \(first: "
            r"'features\.7\.conv\.1\.1\.bias'\)"
        ),
    )
    extra = tmp_path / "extra.pt"
    torch.save({**state, "features.19.0.weight": torch.zeros(1)}, extra)
    yield extra, r"extra\.pt has 1 keys that torchvision's mobilenet_v2 does not \(first: "
    wide = tmp_path / "wide.pt"
    torch.save({**state, "features.18.0.weight": torch.zeros(1000, 320, 1, 1)}, wide)
    yield (
        wide,
        (
            r"wide\.pt holds 'features\.18\.0\.weight' of shape \[1000, 320, 1, 1\], but "
            r"mobilenet_v2 \(width 1\.0\) has \[1280, 320, 1, 1\]"
        ),
    )


def test_bad_pretrained_files_are_one_sentence_each(tmp_path):
    for path, pattern in _bad_files(tmp_path):
        with pytest.raises(PflkitError, match=r"model 'mobilenet_v2' option 'pretrained': .*"):
            build_model("mobilenet_v2", (3, 64, 64), 20, pretrained=str(path))
        with pytest.raises(PflkitError, match=pattern):
            build_model("mobilenet_v2", (3, 64, 64), 20, pretrained=str(path))


def test_bad_pretrained_file_through_the_cli_exits_2(cli, tmp_path):
    """A run whose pretrained file is missing stops before training, with one sentence."""
    write_domainnet(tmp_path / "data" / "domainnet")
    cfg = tiny_config(
        data={
            "dataset": "domainnet",
            "root": str(tmp_path / "data"),
            "num_clients": 6,
            "partition": {"name": "natural"},
            "options": {"classes": 3, "image_size": 32},
        },
        model={"name": "mobilenet_v2", "options": {"pretrained": "weights/missing.pt"}},
        train={"rounds": 1, "batch_size": 4},
    )
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    for path, pattern in [(None, r"weights/missing\.pt does not exist"), *_bad_files(tmp_path)]:
        if path is not None:
            cfg["model"]["options"]["pretrained"] = str(path)
            (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        r = cli("run", "c.yaml", "--out", "run", cwd=tmp_path)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "error: model 'mobilenet_v2' option 'pretrained': " in r.stderr
        assert re.search(pattern, r.stderr), r.stderr
        assert not (tmp_path / "run").exists()
