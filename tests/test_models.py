"""Model zoo: shapes, the body/head split, parameter counts, init, determinism, errors.

Parameter counts are written out by hand (and, where a spec prints one, match the spec), so a
wrong layer width, a missing bias or a mis-split head fails the count test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pflkit.errors import PflkitError
from pflkit.models import MODELS, ModelInfo, PFLModel, build_model, model_options

# name, input shape, classes, options, feature_dim, body params, head params, head has bias
CASES = [
    ("mlp", (60,), 10, {}, 200, 60 * 200 + 200 + 200 * 200 + 200, 2_010, True),
    ("mlp", (1, 28, 28), 10, {"hidden": [32]}, 32, 784 * 32 + 32, 330, True),
    ("mlp", (60,), 5, {"hidden": []}, 60, 0, 305, True),  # logistic regression
    ("map_mlpnet", (1, 28, 28), 10, {}, 128, 1_984_640, 1_280, False),
    ("map_lenet", (1, 28, 28), 10, {}, 256, 6_832, 2_560, False),
    ("map_lenet", (3, 32, 32), 10, {}, 400, 7_632, 4_000, False),
    # gpfl.md §4.3: body 576,896 at 28x28 and 873,408 at 32x32
    ("cnn4", (1, 28, 28), 10, {}, 512, 576_896, 5_130, True),
    ("cnn4", (3, 32, 32), 100, {}, 512, 873_408, 51_300, True),
    ("tfcnn", (3, 32, 32), 10, {}, 1024, 56_320, 10_240, False),
    ("tfcnn", (3, 16, 32), 10, {}, 512, 56_320, 5_120, False),  # non-square: 64 * 2 * 4
    ("vgg8", (3, 32, 32), 10, {}, 512, 3_910_784, 5_120, False),
    ("vgg8_bn", (3, 32, 32), 100, {}, 512, 3_913_728, 51_200, False),
    ("vgg11", (3, 32, 32), 100, {}, 512, 9_220_480, 51_200, False),
    ("resnet20", (3, 32, 32), 10, {}, 64, 271_824, 640, False),  # 0.27M
    ("resnet56", (3, 32, 32), 10, {}, 64, 855_120, 640, False),  # 0.86M
    # ktpfl.md §4: about 11.17M in total with 10 classes
    ("resnet18", (3, 32, 32), 10, {}, 512, 11_168_832, 5_130, True),
    # gpfl.md §4.3: torchvision resnet18, body about 11.18M
    ("resnet18", (3, 64, 64), 200, {"stem": "imagenet"}, 512, 11_176_512, 102_600, True),
    ("lenet5_bn", (3, 32, 32), 10, {}, 84, 61_200, 850, True),
    # torchvision's published 3,504,872 with 1000 classes, less its head (1,281,000)
    ("mobilenet_v2", (3, 64, 64), 20, {}, 1280, 2_223_872, 25_620, True),
    ("lenet5_bn", (1, 28, 28), 62, {"fc_relu": True}, 84, 43_620, 5_270, True),
    # ktpfl.md §4: 44,726 trainable parameters (3x28x28 input, 10 classes)
    ("lenet5", (3, 28, 28), 10, {}, 84, 43_876, 850, True),
    # KT-pFL zoo (ktpfl.md §4: about 20.1 M and 1.27 M parameters), and the small zoo's ResNet
    ("alexnet", (3, 28, 28), 10, {}, 4096, 20_085_568, 40_970, True),
    ("shufflenetv2", (3, 32, 32), 10, {}, 1024, 1_258_396, 10_250, True),
    ("resnet8", (1, 28, 28), 10, {"stem_stride": 2}, 64, 77_104, 650, True),
    ("femnist_cnn", (1, 28, 28), 62, {}, 1024, 52_096, 63_488, False),
    # pfedpm.md §4.3: about 21.8k (MNIST) and 849k (FEMNIST, 3x3 conv1, 128x128)
    ("fedproto_cnn", (1, 28, 28), 10, {}, 50, 21_330, 510, True),
    ("fedproto_cnn", (1, 28, 28), 10, {"channels": 22}, 50, 23_432, 510, True),
    ("fedproto_cnn", (1, 128, 128), 62, {"conv1_kernel": 3}, 50, 846_170, 3_162, True),
    # gpfl.md §4.3 (the code's split, body 21,120, is tested in test_tiny_har.py)
    ("har_cnn", (9, 1, 128), 6, {}, 512, 2_250_880, 3_078, True),
    ("amazon_mlp", (5000,), 2, {}, 100, 5_551_600, 202, True),
]
IDS = [f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}-{c[3]}" for c in CASES]
FIRST_CASE = {}
for _case in CASES:
    FIRST_CASE.setdefault(_case[0], _case)
MAP_MODELS = [
    "map_mlpnet",
    "map_lenet",
    "tfcnn",
    "vgg8",
    "vgg8_bn",
    "vgg11",
    "resnet20",
    "resnet56",
    "femnist_cnn",
]


def _build(name, shape, classes, options, seed=0) -> PFLModel:
    torch.manual_seed(seed)
    return build_model(name, shape, classes, **options)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


# models whose input is not a float tensor: their shapes and counts are tested in their own file
TESTED_ELSEWHERE = {
    "fasttext": "tests/test_text_data.py (token ids)",
    "gru_lm": "tests/eval/test_tasks.py (next-token prediction)",
}


def test_registry_entries_are_documented_and_tested():
    assert set(FIRST_CASE) | set(TESTED_ELSEWHERE) == set(MODELS)
    for name, info in MODELS.items():
        assert isinstance(info, ModelInfo) and info.name == name
        assert info.description and "\n" not in info.description
        assert "code" in info.description or "paper" in info.description, name


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_shapes_split_and_parameter_counts(case):
    name, shape, classes, options, feat_dim, body_params, head_params, head_bias = case
    model = _build(name, shape, classes, options)
    assert isinstance(model, PFLModel)
    assert model.feature_dim == feat_dim
    model.eval()
    x = torch.randn(3, *shape)
    with torch.no_grad():
        out = model(x)
        feats = model.features(x)
        assert out.shape == (3, classes)
        assert feats.shape == (3, feat_dim)
        assert torch.equal(out, model.head(feats))
        assert torch.equal(out, model.head(model.body(x)))

    keys = list(model.state_dict())
    assert all(k.startswith(("body.", "head.")) for k in keys)
    # The head is exactly the classifier: one Linear(feature_dim -> classes), nothing else
    # with parameters or buffers.
    (linear,) = _linears(model.head)
    assert (linear.in_features, linear.out_features) == (feat_dim, classes)
    assert (linear.bias is not None) == head_bias
    head_keys = {k for k in keys if k.startswith("head.")}
    linear_keys = {n for n, p in model.head.named_parameters()}
    assert head_keys == {f"head.{n}" for n in linear_keys}
    assert _count(model.head) == head_params
    assert _count(model.body) == body_params


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_parameter_is_used_in_training(case):
    name, shape, classes, options, *_ = case
    model = _build(name, shape, classes, options)
    model.train()
    x = torch.randn(4, *shape)
    y = torch.arange(4) % classes
    nn.functional.cross_entropy(model(x), y).backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert not unused


@pytest.mark.parametrize("name", sorted(FIRST_CASE))
def test_deterministic_under_manual_seed(name):
    _, shape, classes, options, *_ = FIRST_CASE[name]
    a = _build(name, shape, classes, options, seed=3).state_dict()
    b = _build(name, shape, classes, options, seed=3).state_dict()
    c = _build(name, shape, classes, options, seed=4).state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("name", sorted(FIRST_CASE))
def test_logits_do_not_depend_on_the_evaluation_batch_size(name):
    """``eval.batch_size`` is a speed setting: with one torch thread, ``predict`` gives every
    model's logits bit for bit at batch sizes 64 and 100 as in one batch of 130."""
    from pflkit.primitives.training import predict

    _, shape, classes, options, *_ = FIRST_CASE[name]
    model = _build(name, shape, classes, options)
    x = torch.randn(130, *shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            whole = predict(model, x, 130)
            for size in (64, 100):
                assert torch.equal(predict(model, x, size), whole), size
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", MAP_MODELS)
def test_map_models_use_map_init(name):
    _, shape, classes, options, *_ = FIRST_CASE[name]
    model = _build(name, shape, classes, options)
    assert model.head.bias is None  # MAP's classifiers are bias-free
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            fan_out = m.out_channels * m.kernel_size[0] * m.kernel_size[1]
            expected = (2.0 / fan_out) ** 0.5
            assert m.weight.std().item() == pytest.approx(expected, rel=0.25)
            assert m.bias is None or not m.bias.any()
        elif isinstance(m, nn.BatchNorm2d):
            assert torch.equal(m.weight, torch.ones_like(m.weight))
            assert not m.bias.any()
        elif isinstance(m, nn.Linear):
            assert m.weight.std().item() == pytest.approx(0.01, rel=0.25)
            assert m.bias is None or not m.bias.any()


def test_pytorch_default_init_where_the_source_uses_it():
    # cnn4 (PFLlib): default Linear init is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), biases nonzero
    model = _build("cnn4", (1, 28, 28), 10, {})
    bound = 512**-0.5
    assert model.head.weight.abs().max().item() <= bound
    assert model.head.weight.std().item() == pytest.approx(bound / 3**0.5, rel=0.1)
    assert model.head.bias.any()
    # resnet18: cifar stem keeps defaults (KT-pFL code), imagenet stem uses torchvision's init
    cifar = _build("resnet18", (3, 32, 32), 10, {})
    conv = cifar.body.conv1
    fan_in = 3 * 3 * 3
    assert conv.weight.std().item() == pytest.approx((1 / (3 * fan_in)) ** 0.5, rel=0.15)
    imagenet = _build("resnet18", (3, 32, 32), 10, {"stem": "imagenet"})
    w = imagenet.body.layer1[0].conv1.weight  # 64 -> 64, 3x3: fan_out 576
    assert w.std().item() == pytest.approx((2 / 576) ** 0.5, rel=0.1)


def test_resnet18_stems():
    cifar = _build("resnet18", (3, 32, 32), 10, {})
    imagenet = _build("resnet18", (3, 64, 64), 10, {"stem": "imagenet"})
    assert cifar.body.conv1.kernel_size == (3, 3) and cifar.body.conv1.stride == (1, 1)
    assert imagenet.body.conv1.kernel_size == (7, 7) and imagenet.body.conv1.stride == (2, 2)
    assert not any(isinstance(m, nn.MaxPool2d) for m in cifar.body.modules())
    assert any(isinstance(m, nn.MaxPool2d) for m in imagenet.body.modules())
    # layer4's map before pooling: 32 / 8 = 4 for cifar; 64 / 32 = 2 for imagenet
    with torch.no_grad():
        cifar.eval()
        imagenet.eval()
        assert cifar.body[:-2](torch.randn(1, 3, 32, 32)).shape == (1, 512, 4, 4)
        assert imagenet.body[:-2](torch.randn(1, 3, 64, 64)).shape == (1, 512, 2, 2)


def test_residual_shortcuts():
    model = _build("resnet20", (3, 32, 32), 10, {})
    blocks = [b for stage in ("layer1", "layer2", "layer3") for b in getattr(model.body, stage)]
    assert len(blocks) == 9
    # projection (1x1 conv + BN) only where the shape changes: first block of stages 2 and 3
    assert [b.shortcut is not None for b in blocks] == [False] * 3 + [True, False, False] * 2


def test_feature_activations():
    x = torch.randn(16, 3, 32, 32)
    with torch.no_grad():
        plain = _build("lenet5_bn", (3, 32, 32), 10, {}).eval().features(x)
        relu = _build("lenet5_bn", (3, 32, 32), 10, {"fc_relu": True}).eval().features(x)
        cnn4 = _build("cnn4", (3, 32, 32), 10, {}).eval().features(x)
    assert (plain < 0).any()  # 2023 code: no activation after FC(84)
    assert (relu >= 0).all() and (cnn4 >= 0).all()


def test_fedproto_head_is_dropout_then_linear():
    model = _build("fedproto_cnn", (1, 28, 28), 10, {})
    assert isinstance(model.head[0], nn.Dropout) and model.head[0].p == 0.5
    assert model.body.conv2.out_channels == 20 and model.body.conv1.kernel_size == (5, 5)


@pytest.mark.parametrize(
    "name, channels, smallest",
    [
        ("map_lenet", 1, 16),
        ("cnn4", 1, 16),
        ("lenet5_bn", 3, 16),
        ("lenet5", 3, 16),
        ("fedproto_cnn", 1, 16),
        ("tfcnn", 3, 8),
        ("vgg8", 3, 32),
        ("femnist_cnn", 1, 2),
        ("alexnet", 3, 15),
    ],
)
def test_smallest_image_fits_and_one_less_is_refused(name, channels, smallest):
    model = _build(name, (channels, smallest, smallest), 10, {}).eval()
    with torch.no_grad():
        assert model(torch.randn(2, channels, smallest, smallest)).shape == (2, 10)
    with pytest.raises(PflkitError, match=f"H, W >= {smallest}"):
        build_model(name, (channels, smallest - 1, smallest), 10)


def test_input_shape_accepts_list_and_size():
    a = _build("cnn4", [1, 28, 28], 10, {})
    b = _build("cnn4", torch.Size([1, 28, 28]), 10, {})
    assert a.input_shape == b.input_shape == (1, 28, 28)


def test_model_options():
    assert model_options("resnet18") == {"stem": "cifar"}
    assert model_options("lenet5_bn") == {"fc_relu": False}
    assert model_options("cnn4") == {}


def test_unknown_model_suggests_the_closest():
    with pytest.raises(PflkitError, match="unknown model 'cnn5'.*'cnn4'"):
        build_model("cnn5", (1, 28, 28), 10)
    with pytest.raises(PflkitError, match="'resnet18'"):
        model_options("resnet-18")


@pytest.mark.parametrize("name", ["lenet5_bn", "cnn4", "resnet18", "vgg11"])
def test_vector_input_is_refused_by_image_models(name):
    with pytest.raises(PflkitError, match=rf"'{name}' needs image input \[C, H, W\].*\(60,\)"):
        build_model(name, (60,), 10)
    with pytest.raises(PflkitError, match="needs image input"):
        MODELS[name].factory((60,), 10)  # the factories check too


@pytest.mark.parametrize("bad", [(0, 28, 28), (), 60, "abc", (1, -28, 28)])
def test_malformed_input_shape(bad):
    with pytest.raises(PflkitError, match="input shape"):
        build_model("mlp", bad, 10)


@pytest.mark.parametrize("classes", [1, 0, -3, 2.5, True])
def test_num_classes_must_be_at_least_two(classes):
    with pytest.raises(PflkitError, match="num_classes"):
        build_model("cnn4", (1, 28, 28), classes)
    with pytest.raises(PflkitError, match="num_classes"):
        MODELS["mlp"].factory((60,), classes)


def test_unknown_and_bad_options():
    with pytest.raises(PflkitError, match="'cnn4' has no option 'hidden'; it takes no options"):
        build_model("cnn4", (1, 28, 28), 10, hidden=[10])
    with pytest.raises(PflkitError, match="no option 'hiden'; its options are: hidden"):
        build_model("mlp", (60,), 10, hiden=[10])
    bad = [
        ("resnet18", (3, 32, 32), {"stem": "tiny"}, "stem.*'cifar' or 'imagenet'"),
        ("mlp", (60,), {"hidden": [0]}, "hidden"),
        ("mlp", (60,), {"hidden": "200"}, "hidden"),
        ("lenet5_bn", (3, 32, 32), {"fc_relu": "yes"}, "fc_relu"),
        ("fedproto_cnn", (1, 28, 28), {"channels": 0}, "channels"),
    ]
    for name, shape, options, match in bad:
        with pytest.raises(PflkitError, match=match):
            build_model(name, shape, 10, **options)


def test_mlp_hidden_option():
    model = _build("mlp", (1, 8, 8), 3, {"hidden": [16, 8, 4]})
    assert [(m.in_features, m.out_features) for m in _linears(model.body)] == [
        (64, 16),
        (16, 8),
        (8, 4),
    ]
    assert model.feature_dim == 4
