"""DomainNet (pFedSim Table 8, specs/pfedsim.md §4.3) on a small official layout written by the
test: FL-bench's sampling checked against a re-implementation written here from
data/domain/preprocess.py's description, the natural partition, the official split, the cache,
and every bad option or missing file through the command line (exit 2, one sentence)."""

from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import tiny_config
from domainnet_helpers import CLASSES, DOMAINS, MEAN, STD, count, write_domainnet
from pflkit.config import DataConfig
from pflkit.data.federated import build_federated
from pflkit.data.sources import SOURCES, clear_cache, domainnet, load_source
from pflkit.errors import PflkitError

Image = pytest.importorskip("PIL.Image")


pytestmark = pytest.mark.usefixtures("fresh_source_cache")


@pytest.fixture
def data_root(tmp_path) -> Path:
    write_domainnet(tmp_path / "domainnet")
    return tmp_path


def listed_names(home: Path, domain: str, cls: str, part: str) -> list[str]:
    """The image names of class ``cls`` in the official ``<domain>_<part>.txt``."""
    words = (home / f"{domain}_{part}.txt").read_text().split()  # path, label, path, ...
    return [p.split("/")[2] for p in words[0::2] if p.split("/")[1] == cls]


def flbench(home, domains, classes, seed, fraction, per_domain, official=False):
    """FL-bench's preprocess.py, re-implemented: the global ``random`` seeded once; class
    names from the first domain's folder; per domain, per class, the sorted names (or the
    names in the official train / test lists) and, for 0 < fraction < 1, a random sample of
    int(n * fraction) of them in drawn order; then the domain's indices drawn into clients,
    each draw followed by a set difference, the rest to the domain's last client.
    Returns (classes, train [(path, label)], clients [[index]], test [(path, label)])."""
    state = random.getstate()
    random.seed(seed)
    try:
        picked = sorted(random.sample(sorted(os.listdir(home / domains[0])), classes))
        train, test, clients = [], [], []
        for domain in domains:
            start = len(train)
            for label, cls in enumerate(picked):
                parts = ["train", "test"] if official else ["train"]
                for part in parts:
                    if official:
                        names = sorted(listed_names(home, domain, cls, part))
                    else:
                        names = sorted(os.listdir(home / domain / cls))
                    if 0 < fraction < 1:
                        names = random.sample(names, int(len(names) * fraction))
                    out = train if part == "train" else test
                    out += [(home / domain / cls / n, label) for n in names]
            left = list(range(start, len(train)))
            share = len(left) // per_domain
            mine = []
            for _ in range(per_domain):
                got = random.sample(left, share)
                left = list(set(left) - set(got))
                mine.append(got)
            mine[-1] += left
            clients += mine
    finally:
        random.setstate(state)
    return picked, train, clients, test


def pixels(paths, side: int) -> torch.Tensor:
    """What FL-bench feeds the model: the RGB image resized to side x side (torchvision's
    Resize calls Pillow's bilinear resize on a PIL image), ToTensor, Normalize(mean, std)."""
    mean = np.array(MEAN, np.float32)[:, None, None]
    std = np.array(STD, np.float32)[:, None, None]
    out = []
    for p in paths:
        with Image.open(p) as im:
            a = np.asarray(im.convert("RGB").resize((side, side), Image.BILINEAR), np.float32)
        out.append((a.transpose(2, 0, 1) / 255 - mean) / std)
    return torch.from_numpy(np.stack(out))


@pytest.mark.parametrize(
    "opts",
    [
        {"classes": 4, "class_seed": 7, "fraction": 0.5, "clients_per_domain": 2},
        {"classes": 3, "fraction": 0.6, "clients_per_domain": 3, "image_size": 16},
        {"classes": 6, "clients_per_domain": 1},  # fraction 1: no sample, the k = 1 draw stays
        {"classes": 2, "class_seed": 3, "domains": ["sketch", "real"], "clients_per_domain": 2},
    ],
    ids=["frac0.5-k2", "frac0.6-k3", "all-k1", "two-domains"],
)
def test_pool_sampling_is_flbench(data_root, opts):
    home = data_root / "domainnet"
    src = load_source("domainnet", root=data_root, download=False, **opts)
    domains = [d for d in DOMAINS if d in opts.get("domains", DOMAINS)]  # FL-bench's order
    k = opts["clients_per_domain"]
    picked, train, clients, _ = flbench(
        home, domains, opts["classes"], opts.get("class_seed", 42), opts.get("fraction", 1.0), k
    )
    assert src.class_names == picked and src.num_classes == opts["classes"]
    assert src.test_x is None and src.test_y is None
    assert src.train_y.tolist() == [label for _, label in train]
    side = opts.get("image_size", 64)
    assert src.train_x.shape == (len(train), 3, side, side)
    torch.testing.assert_close(src.train_x, pixels([p for p, _ in train], side))
    want = np.full(len(train), -1)
    for c, members in enumerate(clients):
        want[members] = c
    assert src.train_groups.tolist() == want.tolist()
    assert src.group_names == [f"{d}/{j}" for d in domains for j in range(k)]
    assert src.mean == MEAN and src.std == STD
    if opts.get("fraction", 1.0) < 1:  # the fraction is int(n * fraction) of each class
        for domain in domains:
            for label, cls in enumerate(picked):
                n = sum(1 for p, y in train if y == label and p.parent.parent.name == domain)
                assert n == int(count(DOMAINS.index(domain), CLASSES.index(cls)) * opts["fraction"])


def test_natural_partition_gives_one_client_per_domain_share(data_root):
    k = 2
    options = {"classes": 4, "fraction": 0.8, "clients_per_domain": k, "image_size": 32}
    cfg = DataConfig(
        dataset="domainnet",
        root=str(data_root),
        num_clients=6 * k,
        partition={"name": "natural"},
        test_fraction=0.5,
        options=options,
        cache=False,
    )
    fed = build_federated(cfg)
    src = load_source("domainnet", root=data_root, **options)
    _, train, clients, _ = flbench(data_root / "domainnet", DOMAINS, 4, 42, 0.8, k)
    assert fed.num_clients == 12 and fed.input_shape == (3, 32, 32)
    for c in range(12):
        idx = np.concatenate([fed.train_indices[c], fed.test_indices[c]])
        assert sorted(idx.tolist()) == sorted(clients[c])  # FL-bench's client c
        domain = src.group_names[c].split("/")[0]  # the documented way to a client's domain
        assert domain == DOMAINS[c // k]
        assert {train[i][0].parent.parent.name for i in idx} == {domain}
        assert len(fed.test_indices[c]) in (len(idx) // 2, (len(idx) + 1) // 2)
    assert len(fed.test_y) == sum(len(c.test_y) for c in fed.clients)  # no official test set


def test_official_split_reads_the_split_files(data_root):
    opts = {"classes": 5, "class_seed": 1, "fraction": 0.5, "clients_per_domain": 2}
    src = load_source("domainnet", root=data_root, split="official", image_size=8, **opts)
    picked, train, clients, test = flbench(
        data_root / "domainnet", DOMAINS, 5, 1, 0.5, 2, official=True
    )
    assert src.class_names == picked
    assert src.train_y.tolist() == [y for _, y in train]
    assert src.test_y.tolist() == [y for _, y in test]
    torch.testing.assert_close(src.train_x, pixels([p for p, _ in train], 8))
    torch.testing.assert_close(src.test_x, pixels([p for p, _ in test], 8))
    assert all(int(p.stem[-6:]) % 3 == 2 for p, _ in test)  # the test list's images only
    assert all(int(p.stem[-6:]) % 3 != 2 for p, _ in train)
    want = np.full(len(train), -1)
    for c, members in enumerate(clients):
        want[members] = c
    assert src.train_groups.tolist() == want.tolist()


def test_cache_is_reused_refreshed_and_optional(data_root, monkeypatch):
    home = data_root / "domainnet"
    first = load_source("domainnet", root=data_root, classes=3, image_size=16)
    cache = home / "cache"
    (entry,) = cache.iterdir()
    assert entry.name.startswith("train-16px-") and entry.suffix == ".npz"

    real = domainnet._decode_images
    calls = []

    def counting(files, *args):
        calls.append(len(files))
        return real(files, *args)

    monkeypatch.setattr(domainnet, "_decode_images", counting)
    clear_cache()
    again = load_source("domainnet", root=data_root, classes=3, image_size=16)
    assert calls == [] and torch.equal(again.train_x, first.train_x)

    # another selection is another entry; the first stays
    clear_cache()
    load_source("domainnet", root=data_root, classes=2, image_size=16)
    assert len(calls) == 1 and len(list(cache.iterdir())) == 2

    # an image written again makes the entry stale, even at the same size (JPEG readers
    # ignore bytes after the end marker: only the modification time tells)
    changed = sorted((home / "real" / first.class_names[0]).iterdir())[0]
    old = changed.stat()
    Image.fromarray(np.full((9, 9, 3), 250, np.uint8)).save(changed, format="JPEG")
    data = changed.read_bytes()
    assert len(data) < old.st_size
    changed.write_bytes(data + b"\0" * (old.st_size - len(data)))
    os.utime(changed, ns=(old.st_atime_ns, old.st_mtime_ns + 10**9))
    clear_cache()
    new = load_source("domainnet", root=data_root, classes=3, image_size=16)
    assert calls[-1] == first.num_train and not torch.equal(new.train_x, first.train_x)

    stamp = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    clear_cache()
    load_source("domainnet", root=data_root, classes=3, image_size=16, cache=False)
    assert calls[-1] == first.num_train and len(calls) == 3
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamp


def test_registry_entry():
    assert SOURCES["domainnet"].options == {
        "classes": 20,
        "class_seed": 42,
        "fraction": 1.0,
        "image_size": 64,
        "domains": tuple(DOMAINS),
        "clients_per_domain": 1,
        "split": "pool",
        "cache": True,
    }
    with pytest.raises(PflkitError, match="'domainnet' has no option 'ratio'"):
        load_source("domainnet", ratio=0.3)


# ------------------------------------------------------------------------------------------
# Bad options and missing files, through the command line
# ------------------------------------------------------------------------------------------


def rm(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    path.rmdir() if path.is_dir() else path.unlink()


BAD_OPTIONS = [
    ({"classes": 0}, r"option 'classes' of dataset 'domainnet' must be an integer in 1\.\.345 "
     r"\(how many of DomainNet's classes to sample\), got 0"),
    ({"classes": 346}, r"must be an integer in 1\.\.345 .*got 346"),
    ({"classes": 7}, r"option 'classes' of dataset 'domainnet' is 7 but .*domainnet/clipart has 6 "
     r"class folders: set it to at most 6"),
    ({"class_seed": -1}, r"option 'class_seed' of dataset 'domainnet' must be an integer >= 0, "
     r"got -1"),
    ({"fraction": 0}, r"option 'fraction' of dataset 'domainnet' must be a number in \(0, 1\] "
     r"\(the share of each class's images kept; pFedSim's paper keeps 0\.3\), got 0"),
    ({"fraction": 30}, r"option 'fraction' .*must be a number in \(0, 1\] .*got 30"),
    ({"image_size": 0}, r"option 'image_size' of dataset 'domainnet' must be an integer >= 1"),
    ({"domains": ["photo"]}, r"option 'domains' of dataset 'domainnet' must be a list of distinct "
     r"domains from clipart, infograph, painting, quickdraw, real, sketch, got \['photo'\]"),
    ({"domains": ["real", "real"]}, r"option 'domains' .*must be a list of distinct domains"),
    ({"domains": []}, r"option 'domains' .*must be a list of distinct domains .*got \[\]"),
    ({"clients_per_domain": 0}, r"option 'clients_per_domain' of dataset 'domainnet' must be an "
     r"integer >= 1, got 0"),
    ({"split": "test"}, r"option 'split' of dataset 'domainnet' must be 'pool' .*or 'official' "
     r".*got 'test'"),
    ({"cache": "yes"}, r"option 'cache' of dataset 'domainnet' must be true or false, got 'yes'"),
    ({"fraction": 0.2, "clients_per_domain": 4}, r"DomainNet domain 'clipart' keeps too few images "
     r"\(1\) for 4 clients: lower option 'clients_per_domain' or raise 'fraction' or 'classes'"),
]  # fmt: skip

BAD_FILES = [
    (lambda h: rm(h), {}, r"DomainNet files not found in .*domainnet; put the domain folders "
     r"\(clipart/, .*sketch/, unzipped from http://csr\.bu\.edu/\S*<domain>\.zip\) there; "
     r"pflkit does not download DomainNet"),
    (lambda h: rm(h / "painting"), {}, r"DomainNet folder .*domainnet/painting is missing; unzip "
     r"http://csr\.bu\.edu/ftp/visda/2019/multi-source/painting\.zip in .*or leave the domain "
     r"out with option 'domains'"),
    (lambda h: rm(h / "sketch" / "bee"), {"classes": 6}, r"DomainNet folder .*sketch/bee is "
     r"missing; every domain folder must hold the class folders of the first domain"),
    (lambda h: (h / "real_test.txt").unlink(), {"split": "official"}, r"DomainNet split file "
     r".*real_test\.txt is missing; put the official real_train\.txt and real_test\.txt"),
    (lambda h: (h / "quickdraw_train.txt").write_text("quickdraw/ant\n"), {"split": "official"},
     r"quickdraw_train\.txt is corrupt .*line 1 is not 'quickdraw/<class>/<image> <label>'"),
    (lambda h: next((h / "infograph" / "eel").iterdir()).write_bytes(b"\xff\xd8junk"),
     {"classes": 6}, r"infograph_002_\d+\.jpg is corrupt or truncated \(cannot decode JPEG"),
    (lambda h: next((h / "real" / "eel").iterdir()).unlink(), {"classes": 6, "split": "official"},
     r"DomainNet image .*real/eel/real_002_\d+\.jpg is missing; unzip its domain's zip again"),
]  # fmt: skip

FINE_FILES = [  # files a load does not need
    (lambda h: rm(h / "painting"), {"domains": ["clipart", "real"]}),
    (lambda h: (h / "real_test.txt").unlink(), {}),  # split: pool reads no split file
]


def write_config(tmp_path: Path, root: Path, options: dict) -> Path:
    cfg = tiny_config(
        data={
            "dataset": "domainnet",
            "root": str(root),
            "num_clients": max(1, len(options.get("domains", DOMAINS))),
            "partition": {"name": "natural"},
            "test_fraction": 0.5,
            "options": {"image_size": 8, "classes": 3, "cache": False, **options},
        }
    )
    path = tmp_path / "dn.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def partition_cli(cli, tmp_path: Path, root: Path, options: dict):
    config = write_config(tmp_path, root, options)
    return cli("partition", str(config), "--out", "p.png", cwd=tmp_path)


def assert_one_sentence(r, pattern: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.search(pattern, r.stderr), r.stderr


@pytest.mark.parametrize("options, pattern", BAD_OPTIONS, ids=[str(o) for o, _ in BAD_OPTIONS])
def test_bad_options_exit_2_with_one_sentence(cli, data_root, tmp_path, options, pattern):
    assert_one_sentence(partition_cli(cli, tmp_path, data_root, options), pattern)


@pytest.mark.parametrize("case", range(len(BAD_FILES)))
def test_missing_and_damaged_files_exit_2_with_one_sentence(cli, data_root, tmp_path, case):
    edit, options, pattern = BAD_FILES[case]
    edit(data_root / "domainnet")
    assert_one_sentence(partition_cli(cli, tmp_path, data_root, options), pattern)


@pytest.mark.parametrize("case", range(len(FINE_FILES)))
def test_files_a_load_does_not_need_may_be_missing(cli, data_root, tmp_path, case):
    edit, options = FINE_FILES[case]
    edit(data_root / "domainnet")
    r = partition_cli(cli, tmp_path, data_root, options)
    assert r.returncode == 0, r.stderr


def test_missing_pillow_is_one_sentence(cli, data_root, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import Image` raises ImportError
    r = partition_cli(cli, tmp_path, data_root, {})
    assert r.returncode == 2 and r.stderr == (
        "error: dataset 'domainnet' needs Pillow to read its JPEG files, which is not "
        "installed; run `pip install pillow`\n"
    ), r.stderr


def test_table8_config_states_the_papers_setting():
    """configs/pfedsim/domainnet.yaml (not run): App. B.3's data and model, 12 methods x 5
    seeds; natural clients = 6 domains x clients_per_domain."""
    from pflkit.engine.compare import compare_plan
    from pflkit.experiment import load_config

    cfg = load_config(Path(__file__).parents[1] / "configs" / "pfedsim" / "domainnet.yaml")
    opts = cfg.data.options
    assert cfg.data.dataset == "domainnet" and cfg.data.partition == {"name": "natural"}
    assert (opts["classes"], opts["fraction"], opts["image_size"]) == (20, 0.3, 64)
    assert opts["class_seed"] == 42 and opts["split"] == "pool"
    assert cfg.data.num_clients == len(DOMAINS) * opts["clients_per_domain"] == 120
    assert cfg.data.test_fraction == 0.5
    assert cfg.model.name == "mobilenet_v2" and cfg.model.options["pretrained"]
    t = cfg.train
    assert (t.rounds, t.client_fraction, t.local_epochs, t.batch_size, t.lr) == (
        200, 0.1, 5, 32, 0.01
    )  # fmt: skip
    assert cfg.compare.seeds == [0, 1, 2, 3, 4] and len(compare_plan(cfg)) == 12
