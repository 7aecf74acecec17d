"""``pflkit analyze features`` (issue 39, item 3): each client's test features under its own
evaluated model, projected to 2-D (GPFL §4.2, Fig. 2; src/pflkit/analysis/features.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_config
from pflkit.algorithms import build_algorithm
from pflkit.algorithms.fedproto import NearestPrototype
from pflkit.algorithms.gpfl import TABLE
from pflkit.analysis.features import OUTPUTS, feature_map, separation, silhouette
from pflkit.engine.checkpoint import load_checkpoint, save_checkpoint
from pflkit.engine.runner import CHECKPOINT, load_finished, run_experiment
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.models import build_model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Finished 2-round tiny runs (4 clients, digits, MLP body Flatten-Linear(64, 32)-ReLU)
    that keep their final state (output.checkpoint_every 1): ``local`` (every client its own
    body) and ``gpfl``; and ``plain``, a copy of ``local`` without its checkpoint."""
    base = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PFLKIT_DATA", str(tmp_path_factory.getbasetemp() / "data"))
        for name in ("local", "gpfl"):
            cfg = tiny_config(
                algorithm={"name": name}, train={"rounds": 2}, output={"checkpoint_every": 1}
            )
            run_experiment(validate(cfg), out=base / name)
    shutil.copytree(base / "local", base / "plain")
    (base / "plain" / CHECKPOINT).unlink()
    return base


# -- the scores ---------------------------------------------------------------------------------


def test_silhouette_by_hand():
    """Points 0, 1 | 4, 5 on a line: a = 1 for every point; b = 4.5, 3.5, 3.5, 4.5; so the
    scores are 7/9, 5/7, 5/7, 7/9 with mean 47/63. A point alone in its group scores 0."""
    line = np.array([[0.0], [1.0], [4.0], [5.0]])
    assert silhouette(line, np.array([0, 0, 1, 1])) == pytest.approx(47 / 63)
    alone = np.array([[0.0], [1.0], [10.0]])  # 0: (10 - 1) / 10, 1: (9 - 1) / 9, 10: 0
    assert silhouette(alone, np.array([0, 0, 1])) == pytest.approx((0.9 + 8 / 9) / 3)
    assert silhouette(line, np.zeros(4)) is None  # one group
    assert silhouette(line, np.arange(4)) is None  # every point its own group


def test_separation_within_groups_by_hand():
    """Client 0 has class 0 at 0, 1 and class 1 at 4, 5; client 1 the same shifted by 100.
    Within each client the classes score 47/63; within each class the clients score
    (99.5/100.5 + 98.5/99.5) / 2 (a = 1, b = 100.5 or 99.5)."""
    x = np.array([0, 1, 4, 5, 100, 101, 104, 105], dtype=float)[:, None]
    classes = np.array([0, 0, 1, 1, 0, 0, 1, 1])
    clients = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    s = separation(x, classes, clients)
    assert s["class_within_client"] == pytest.approx(47 / 63)
    assert s["client_within_class"] == pytest.approx((99.5 / 100.5 + 98.5 / 99.5) / 2)
    assert s["by_client"] > 0.9 and s["by_class"] < 0


# -- the features: the model that evaluation scores, per client ----------------------------------


def by_hand(sim, cid: int, x: torch.Tensor) -> torch.Tensor:
    """The client's features applied by hand from the run's final state: ``local``: its own
    body relu(W x + b); ``gpfl``: the personalized route relu((1 + gamma) f + beta) with
    f = the shared body's output and gamma, beta = LN(relu(A p + a)) of p = alpha_i C."""
    x = x.flatten(1)
    if sim.algo.name == "local":
        w = sim.clients[cid]["weights"]
        return F.relu(x @ w["body.1.weight"].T + w["body.1.bias"])
    shared = sim.server["shared"]
    f = F.relu(x @ shared["body.1.weight"].T + shared["body.1.bias"])
    p = sim.clients[cid]["alpha"].float() @ shared[TABLE]

    def h(r: str) -> torch.Tensor:
        u = F.relu(shared[f"cov.{r}.linear.weight"] @ p + shared[f"cov.{r}.linear.bias"])
        norm = (u - u.mean()) / torch.sqrt(u.var(unbiased=False) + 1e-5)
        return norm * shared[f"cov.{r}.ln.weight"] + shared[f"cov.{r}.ln.bias"]

    return F.relu((1 + h("gamma")) * f + h("beta"))


@pytest.mark.parametrize("algorithm", ["local", "gpfl"])
def test_each_client_s_features_come_from_its_own_model(runs, tmp_path, algorithm):
    """Through the written files: the features of client c's rows are client c's model applied
    by hand (local: its private body; GPFL: the personalized route with its own p_i), and
    they differ from client 0's model on the same samples (so the check can fail)."""
    feature_map(runs / algorithm, tmp_path / "fm", per_client=12)
    saved = np.load(tmp_path / "fm" / "features.npz")
    with load_finished(runs / algorithm) as sim:
        for cid in range(4):
            rows = saved["clients"] == cid
            x = sim.data.clients[cid].test_x[torch.as_tensor(saved["indices"][rows])]
            mine = by_hand(sim, cid, x).numpy()
            np.testing.assert_allclose(saved["features"][rows], mine, rtol=1e-5, atol=1e-6)
            if cid:
                assert not np.allclose(by_hand(sim, 0, x).numpy(), mine, atol=1e-3)


def test_gpfl_hook_is_the_personalized_route_not_the_body_or_the_global_route(runs):
    """GPFL's ``features`` of its scoring model is CoV(phi(x), p_i), by value; the body output
    and the global route CoV(phi(x), g) (g = mean of the table, Eq. 5) are different."""
    from pflkit.algorithms.gpfl import cov_apply, cov_params

    with load_finished(runs / "gpfl") as sim:
        algo, env, cid = sim.algo, sim.envs[2], 2
        weights = algo.personal_model(env, {"shared": sim.server["shared"]}, sim.clients[cid], None)
        model = weights
        x = sim.data.clients[cid].test_x[:7]
        with torch.no_grad():
            got = algo.features(model, x)
            torch.testing.assert_close(got, by_hand(sim, cid, x), rtol=1e-5, atol=1e-6)
            body = model.model.features(x)
            g = sim.server["shared"][TABLE].mean(0)
            global_route = cov_apply(body, *cov_params(sim.server["shared"], g))
        assert not torch.allclose(got, body, atol=1e-3)
        assert not torch.allclose(got, global_route, atol=1e-3)


def test_the_default_hook_is_the_body_of_the_scored_model_or_of_the_one_it_wraps():
    algo = build_algorithm({"name": "fedproto"})
    model = build_model("mlp", (1, 8, 8), 10, hidden=[16])
    x = torch.randn(3, 1, 8, 8)
    empty = {"classes": torch.zeros(0, dtype=torch.long), "protos": torch.zeros(0, 16)}
    wrapped = NearestPrototype(model, empty, 10, None)
    with torch.no_grad():
        torch.testing.assert_close(algo.features(model, x), model.body(x))
        torch.testing.assert_close(algo.features(wrapped, x), model.body(x))
    with pytest.raises(PflkitError, match="scores a Linear without a body"):
        algo.features(nn.Linear(64, 10), x)


def test_with_every_sample_the_accuracy_is_the_run_s_final_one(runs, tmp_path):
    """The models are those the run's evaluation scored at its last round: on every test
    sample, the mean of their accuracies is the run's final pers_acc_mean."""
    res = feature_map(runs / "gpfl", tmp_path / "fm", per_client=None)
    rows = (runs / "gpfl" / "metrics.jsonl").read_text().splitlines()
    final = json.loads(rows[-1])
    assert res["round"] == final["round"] == 2
    assert np.mean(list(res["accuracy"].values())) == pytest.approx(final["pers_acc_mean"])


# -- the files ---------------------------------------------------------------------------------


def test_the_files_have_the_points_and_are_deterministic(runs, tmp_path):
    res = feature_map(runs / "local", tmp_path / "a", clients=[3, 1], per_client=10, seed=5)
    out = tmp_path / "a"
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUTS)
    saved = np.load(out / "features.npz")
    assert saved["points"].shape == (20, 2) and saved["features"].shape == (20, 32)
    assert saved["clients"].tolist() == [3] * 10 + [1] * 10
    assert len(set(saved["indices"][:10])) == 10
    csv = (out / "features.csv").read_text().splitlines()
    assert csv[0] == "client,label,index,x,y" and len(csv) == 21
    first = csv[1].split(",")
    assert int(first[0]) == 3 and int(first[1]) == saved["labels"][0]
    assert float(first[3]) == saved["points"][0, 0]
    on_disk = json.loads((out / "features.json").read_text())
    assert on_disk["samples"] == {"3": 10, "1": 10} and on_disk["clients"] == [3, 1]
    assert on_disk["split"] == "test" and on_disk["projection"]["perplexity"] == 19
    assert set(on_disk["silhouette"]) == {"map", "features"}
    assert (out / "features.png").read_bytes()[:4] == b"\x89PNG"
    assert res["silhouette"] == on_disk["silhouette"]
    feature_map(runs / "local", tmp_path / "b", clients=[3, 1], per_client=10, seed=5)
    again = np.load(tmp_path / "b" / "features.npz")
    np.testing.assert_array_equal(again["points"], saved["points"])
    feature_map(runs / "local", tmp_path / "c", clients=[3, 1], per_client=10, seed=6)
    assert np.load(tmp_path / "c" / "features.npz")["indices"].tolist() != saved["indices"].tolist()


def test_the_command_prints_the_scores(cli, runs, tmp_path):
    r = cli("analyze", "features", str(runs / "gpfl"), "--clients", "2", "--per-client", "15",
            "--quiet", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "silhouette on the map: by_class" in r.stdout
    assert "silhouette on the features: by_class" in r.stdout
    assert (tmp_path / "features-gpfl" / "features.png").exists()  # the default --out
    assert np.load(tmp_path / "features-gpfl" / "features.npz")["points"].shape == (30, 2)


# -- bad input ---------------------------------------------------------------------------------


def a_compare_folder(tmp_path: Path, runs: Path) -> Path:
    folder = tmp_path / "cmp"
    (folder / "local-s0").mkdir(parents=True)
    (folder / "plan.json").write_text("{}")
    shutil.copy(runs / "local" / "config.yaml", folder / "local-s0")
    return folder


def unfinished(tmp_path: Path, runs: Path) -> Path:
    folder = Path(shutil.copytree(runs / "local", tmp_path / "unfinished"))
    (folder / "summary.json").unlink()
    return folder


def earlier_checkpoint(tmp_path: Path, runs: Path) -> Path:
    folder = Path(shutil.copytree(runs / "local", tmp_path / "earlier"))
    save_checkpoint(folder / CHECKPOINT, load_checkpoint(folder / CHECKPOINT) | {"round": 1})
    return folder


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (lambda t, r: t / "nope", [], "'{run}' does not exist: give the folder of a finished run"),
        (lambda t, r: t, [], "'{run}' is not a pflkit run folder (no config.yaml)"),
        (a_compare_folder, [], "'{run}' is a compare or sweep folder: give one of its run folders, e.g. {run}/local-s0"),
        (lambda t, r: r / "plain", [], "kept no final state (no checkpoints/latest.pt: output.checkpoint_every was 0): run it again with --set output.checkpoint_every=2"),
        (unfinished, [], "the run in '{run}' has not finished (no summary.json): finish it with pflkit run --resume {run}"),
        (earlier_checkpoint, [], "is of round 1, not of the run's last round 2"),
        (lambda t, r: r / "local", ["--method", "pca"], "unknown --method 'pca': use tsne or umap"),
        (lambda t, r: r / "local", ["--clients", "5"], "--clients 5 must be from 1 to the run's 4 clients"),
        (lambda t, r: r / "local", ["--clients", "1,4"], "--clients 4 is not a client: give ids between 0 and 3"),
        (lambda t, r: r / "local", ["--clients", "a,b"], "--clients 'a,b' is not a count or a list of client ids"),
        (lambda t, r: r / "local", ["--clients", ","], "--clients names no client: give a count or ids"),
        (lambda t, r: r / "local", ["--per-client", "0"], "--per-client must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_bad_input_is_one_sentence_and_writes_nothing(cli, runs, tmp_path, make, args, message):
    run = make(tmp_path, runs)
    r = cli("analyze", "features", str(run), *args, "--out", "fm", cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert message.format(run=run) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "fm").exists()


def test_umap_without_its_package_is_one_sentence(cli, runs, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "umap" else real(name, *a)
    )
    r = cli("analyze", "features", str(runs / "local"), "--method", "umap", cwd=tmp_path)
    assert r.returncode == 2
    assert "--method umap needs the umap-learn package, which is not installed" in r.stderr
