"""Feature maps of a finished run: every client's test features, projected together to 2-D
(GPFL paper, Sec. 4.2 "Learned Features", Fig. 2; specs/gpfl.md §7).

**What the paper shows.** Fig. 2 draws t-SNE maps (van der Maaten & Hinton 2008) of the
"feature vectors extracted by" FedPer, FedProto and GPFL on Fashion-MNIST, pathological label
skew, 10 clients, other settings at their defaults, coloured by class and marked by client
("cid"). Its findings are qualitative: FedPer's class boundaries are not discriminative,
FedProto's intersect (classes 0 and 1), GPFL's do not intersect and its features also separate
the clients. The paper does not say which split, how many samples, nor the t-SNE settings.

**What is drawn here.** For each chosen client, its features of (a seeded random choice of up
to ``per_client``) samples of its own local **test** split, computed by the model that the
run's evaluation scores for that client: the final state (the run's checkpoint of its last
round, :func:`~pflkit.engine.runner.load_finished`), the client's ``eval_view``,
``personal_model`` as in every evaluation
(:func:`~pflkit.engine.clients.scored_model`, fine-tuning included when ``eval.finetune_epochs``
is set), and the algorithm's :meth:`~pflkit.algorithms.Algorithm.features` of that module:
the body output phi(x) by default (FedPer, FedProto), GPFL's personalized route
f^P = CoV(phi(x), p_i), the input of its head (Sec. 3.2; the paper's "feature vectors" of GPFL
are not specified further). All clients' features are projected **together** by one t-SNE
(scikit-learn's ``TSNE``: 2 components, perplexity 30 or less than the number of points, PCA
initialisation, ``random_state`` = the seed) or UMAP (the ``umap-learn`` package, when
installed), so distances between clients mean the same as within one.

**The numbers behind the picture.** Silhouette scores (Rousseeuw 1987; Euclidean; in [-1, 1],
higher = better separated groups), each on the 2-D points and on the raw features: by class
(do classes form separate clusters?), by client (do clients?), by class within each client
(mean over clients: are a client's own classes apart, which its head needs?) and by client
within each class (mean over classes held by two or more clients: are clients that share a
class apart, GPFL's "distinguish the data distribution of each client"?). t-SNE keeps
neighbourhoods, not distances, so the raw-feature scores are the ones to compare between
algorithms; the map's scores say how the picture reads.

Deterministic given the seed: the sample choice is drawn from (seed, client), the projection
from the seed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pflkit.algorithms.context import ServerContext
from pflkit.engine.clients import EVALUATE, key_generator, round_context, scored_model
from pflkit.engine.folder import check_out, make_folder
from pflkit.engine.runner import load_finished
from pflkit.errors import PflkitError
from pflkit.primitives.training import predict
from pflkit.report.plots import plot_feature_map, setting_title

#: --method: (its name in titles, the module it needs, that module's package)
METHODS = {"tsne": ("t-SNE", "sklearn", "scikit-learn"), "umap": ("UMAP", "umap", "umap-learn")}
OUTPUTS = ("features.png", "features.csv", "features.npz", "features.json")
PERPLEXITY = 30.0  # scikit-learn's default; the paper gives none


# -- the numbers ------------------------------------------------------------------------------


def silhouette(points: np.ndarray, labels: np.ndarray) -> float | None:
    """Mean silhouette of ``points`` grouped by ``labels`` (Euclidean): per point
    (b - a) / max(a, b), a = its mean distance to the other points of its group, b = the
    smallest mean distance to another group; a point alone in its group scores 0. None when it
    is undefined: fewer than 2 groups, or every point a group of its own."""
    groups = len(np.unique(labels))
    if groups < 2 or groups >= len(labels):
        return None
    from sklearn.metrics import silhouette_score

    return float(silhouette_score(points, labels))


def _within(points: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> float | None:
    """The mean over ``groups`` of the silhouette by ``labels`` among each group's points
    (groups where it is undefined left out; None when it is undefined in all)."""
    values = [silhouette(points[groups == g], labels[groups == g]) for g in np.unique(groups)]
    defined = [v for v in values if v is not None]
    return float(np.mean(defined)) if defined else None


def separation(points: np.ndarray, classes: np.ndarray, clients: np.ndarray) -> dict[str, Any]:
    """The four silhouette scores of the module docstring for one set of points."""
    return {
        "by_class": silhouette(points, classes),
        "by_client": silhouette(points, clients),
        "class_within_client": _within(points, classes, clients),
        "client_within_class": _within(points, clients, classes),
    }


# -- features and projection ------------------------------------------------------------------


def client_features(sim, cid: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, logits) of client ``cid``'s test samples ``idx`` under the model the run's
    evaluation scores for it at the simulation's current round (module docstring)."""
    algo, env, cfg = sim.algo, sim.envs[cid], sim.cfg
    ctx = round_context(sim.senv.run, sim.round, EVALUATE)
    view = algo.eval_view(sim.senv, sim.server, cid, ServerContext(sim.round, EVALUATE, cfg.seed))
    state = sim.client_state(cid)
    model = scored_model(algo, env, view, state, ctx, finetune_epochs=cfg.eval.finetune_epochs)
    x, batch = env.data.test_x[idx.to(env.data.test_x.device)], cfg.eval.batch_size
    feats = predict(model, x, batch, forward=lambda b: algo.features(model, b))
    return feats.flatten(1), predict(model, x, batch)


def sample(n: int, k: int | None, seed: int, cid: int) -> torch.Tensor:
    """Up to ``k`` of ``n`` indices (all for None), a random choice seeded by (seed, client),
    in increasing order."""
    if k is None or k >= n:
        return torch.arange(n)
    return torch.randperm(n, generator=key_generator(seed, cid, 0xFE))[:k].sort().values


def project(features: np.ndarray, method: str, seed: int) -> tuple[np.ndarray, dict[str, Any]]:
    """2-D points of ``features`` ([n, K]) by ``method`` and the settings used."""
    n = len(features)
    if method == "tsne":
        from sklearn import __version__
        from sklearn.manifold import TSNE

        settings = {"perplexity": min(PERPLEXITY, n - 1.0), "init": "pca", "random_state": seed}
        points = TSNE(n_components=2, **settings).fit_transform(features)
        return points, settings | {"library": f"scikit-learn {__version__}"}
    import umap

    settings = {"n_neighbors": min(15, n - 1), "random_state": seed}
    points = umap.UMAP(n_components=2, **settings).fit_transform(features)
    return np.asarray(points), settings | {"library": f"umap-learn {umap.__version__}"}


# -- the study --------------------------------------------------------------------------------


def _check_method(method: str) -> None:
    """The method is known and its library (and scikit-learn, for the scores) importable."""
    import importlib.util

    if method not in METHODS:
        raise PflkitError(f"unknown --method '{method}': use tsne or umap")
    for _, module, package in {METHODS["tsne"], METHODS[method]}:
        if importlib.util.find_spec(module) is None:
            raise PflkitError(
                f"--method {method} needs the {package} package, which is not installed: "
                f"pip install {package}" + (" (or use --method tsne)" if method == "umap" else "")
            )


def _clients(chosen: int | Sequence[int] | None, n: int) -> list[int]:
    """All clients (None), the first N, or the given ids (checked; each once)."""
    if chosen is None:
        return list(range(n))
    if not isinstance(chosen, int) and not chosen:
        raise PflkitError("--clients names no client: give a count or ids, e.g. --clients 0,3,7")
    if isinstance(chosen, int):
        if not 1 <= chosen <= n:
            raise PflkitError(f"--clients {chosen} must be from 1 to the run's {n} clients")
        return list(range(chosen))
    for c in chosen:
        if not 0 <= c < n:
            raise PflkitError(f"--clients {c} is not a client: give ids between 0 and {n - 1}")
    return list(dict.fromkeys(chosen))


def feature_map(
    run_dir: Path,
    out: Path,
    *,
    clients: int | Sequence[int] | None = None,
    method: str = "tsne",
    per_client: int | None = 200,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Project the test features of ``clients`` (default all; a count: the first N) of the
    finished run in ``run_dir``, each from its own evaluated model, to 2-D by ``method`` (tsne
    or umap) and write ``features.png`` (colour: class, marker: client), ``features.csv`` and
    ``features.npz`` (the points; the npz also the raw features) and ``features.json``
    (settings and the silhouette scores) into ``out``; returns the JSON dict. ``per_client``:
    samples per client (None: all its test samples). Every check runs before the run is
    loaded; ``out`` is written only at the end."""
    say = progress or (lambda line: None)
    _check_method(method)
    if per_client is not None and per_client < 1:
        raise PflkitError(f"--per-client must be at least 1, got {per_client}")
    out = Path(out)
    check_out(out, OUTPUTS)
    t0 = time.perf_counter()
    with load_finished(Path(run_dir)) as sim:
        cfg, data = sim.cfg, sim.data
        chosen = _clients(clients, data.num_clients)
        say(f"{cfg.algorithm['name']}, round {sim.round}: features of {len(chosen)} clients")
        feats, labels, owners, indices, accuracy = [], [], [], [], {}
        for cid in chosen:
            test_y = data.clients[cid].test_y
            idx = sample(len(test_y), per_client, seed, cid)
            f, logits = client_features(sim, cid, idx)
            y = test_y[idx.to(test_y.device)].cpu()
            feats.append(f.float().cpu())
            labels.append(y)
            owners.append(torch.full_like(idx, cid))
            indices.append(idx)
            hits = (logits.argmax(1).cpu() == y).float()
            accuracy[str(cid)] = float(hits.mean()) if len(y) else None
        rnd = sim.round
    features, classes = torch.cat(feats).numpy(), torch.cat(labels).numpy()
    clients_of = torch.cat(owners).numpy()
    if len(features) < 3:
        raise PflkitError(
            f"only {len(features)} test samples among the chosen clients: choose more clients "
            "(--clients) or more samples (--per-client)"
        )
    say(f"{METHODS[method][0]} of {len(features)} points of dimension {features.shape[1]}")
    points, settings = project(features, method, seed)
    result = {
        "run": str(run_dir),
        "config": cfg.name,
        "algorithm": cfg.algorithm,
        "run_seed": cfg.seed,
        "round": rnd,
        "dataset": cfg.data.dataset,
        "model": cfg.model.name,
        "split": "test",
        "feature_dim": features.shape[1],
        "method": method,
        "projection": settings,
        "seed": seed,
        "per_client": per_client,
        "clients": chosen,
        "samples": {str(c): len(i) for c, i in zip(chosen, indices, strict=True)},
        "accuracy": accuracy,
        "silhouette": {
            "map": separation(points, classes, clients_of),
            "features": separation(features, classes, clients_of),
        },
        "seconds": time.perf_counter() - t0,
    }
    title = (
        f"{cfg.algorithm['name']}: {METHODS[method][0]} of each client's test features under "
        f"its own model, round {rnd}\n{setting_title(cfg)}"
    )
    arrays = (points, features, classes, clients_of, torch.cat(indices).numpy())
    _write(out, result, arrays, title, data.class_names)
    return result


def _write(out: Path, result: dict, arrays, title: str, names: list[str] | None) -> None:
    """The four files of the study into ``out`` (``arrays``: points, features, classes,
    clients, indices)."""
    points, features, classes, owners, indices = arrays
    make_folder(out, "output folder")
    rows = [
        f"{c},{k},{i},{x!r},{y!r}"
        for c, k, i, (x, y) in zip(owners, classes, indices, points.tolist(), strict=True)
    ]
    try:
        (out / "features.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "features.csv").write_text("\n".join(["client,label,index,x,y", *rows]) + "\n")
        np.savez_compressed(
            out / "features.npz",
            points=points,
            features=features,
            labels=classes,
            clients=owners,
            indices=indices,
        )
        plot_feature_map(points, classes, owners, out / "features.png", title, names)
    except OSError as err:
        raise PflkitError(
            f"cannot write the feature map into '{out}' ({err.strerror or err}): choose another "
            "--out"
        ) from None
