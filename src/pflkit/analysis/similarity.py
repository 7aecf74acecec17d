"""pFedSim's measurement study (paper §3, Fig. 2 and Table 2): which similarity between two
clients' models tracks the similarity of their data?

For a config's partition, every client trains its own copy of one shared initial model ("four
LeNet5 models ... under the same random seed", then "SGD ... for 20 iterations"): ``steps``
mini-batch steps of local SGD with the config's optimiser settings. Then, for every pair of
clients (i, j):

- **data similarity** (Eq. 1): 1 - dist(D_i, D_j), the fraction of D_i u D_j whose label both
  clients hold;
- **CS** (Eq. 2): the mean over classes of the cosine of the two classifiers' class rows;
- **CS-log**: pFedSim's Eq. 3 on the same rows (the weight its aggregation uses);
- **MDB** (model-difference based, clustered FL, Sattler et al.): the cosine of the two model
  updates theta_i - theta_0 over all parameters;
- **LDB** (loss based, FedFomo Eq. 5): (L_i(theta_i) - L_i(theta_j)) / ||theta_j - theta_i||
  with L_i the loss on i's training split, averaged over the two directions;
- **WDB** (Wasserstein distance of BN statistics, FedAP): the sum over BN layers of the
  2-Wasserstein distance of the per-channel Gaussians at each BN input, each model on its own
  data (a distance: lower means more similar; only for models with BatchNorm).

Each metric is scored by its rank correlation with data similarity over all pairs (Spearman
and Kendall; for WDB, a distance, of its negative). Outputs: ``similarity.json`` (every pair),
``similarity.md`` (the scores and the pairs) and ``similarity.png`` (one heatmap per metric).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pflkit.algorithms.base import RoundContext, train_from
from pflkit.algorithms.fedap import bn_wasserstein, feature_stats
from pflkit.algorithms.pfedsim import class_cosines, class_rows, classifier_similarity
from pflkit.config import ExperimentConfig
from pflkit.data.federated import build_federated
from pflkit.engine.clients import seed_torch
from pflkit.engine.envs import make_envs
from pflkit.engine.folder import check_out, make_folder
from pflkit.errors import PflkitError
from pflkit.primitives.bn import bn_modules
from pflkit.primitives.training import Weights, predict, set_weights

METRICS = {  # name: (label, higher means more similar)
    "data_similarity": ("data similarity (Eq. 1)", True),
    "cs": ("CS: classifier cosine (Eq. 2)", True),
    "cs_log": ("CS-log: pFedSim Eq. 3", True),
    "mdb": ("MDB: cosine of model updates (CFL)", True),
    "ldb": ("LDB: loss-based (FedFomo)", True),
    "wdb": ("WDB: Wasserstein of BN stats (FedAP), a distance", False),
}


def data_similarity(counts_i: np.ndarray, counts_j: np.ndarray) -> float:
    """1 - dist(D_i, D_j) (Eq. 1) from the two clients' per-class sample counts."""
    both = (counts_i > 0) & (counts_j > 0)
    total = counts_i.sum() + counts_j.sum()
    return float((counts_i[both].sum() + counts_j[both].sum()) / total) if total else 0.0


def _flat(w: Weights, keys: list[str]) -> torch.Tensor:
    return torch.cat([w[k].double().flatten() for k in keys])


def _loss(model, w: Weights, x, y) -> float:
    set_weights(model, w)
    return float(F.cross_entropy(predict(model, x), y))


def similarity_study(
    cfg: ExperimentConfig, out: Path, steps: int = 20, clients: int | None = None
) -> dict[str, Any]:
    """Train, measure and write the study for ``cfg`` into ``out``; returns the JSON dict."""
    if steps < 1:
        raise PflkitError(f"--steps must be at least 1, got {steps}")
    out = Path(out)
    check_out(out, OUTPUTS)
    data = build_federated(cfg.data)
    senv, envs = make_envs(cfg, data)
    if len(set(senv.archs)) > 1:
        raise PflkitError("the similarity study compares one architecture: remove model.per_client")
    ids = [c for c in range(data.num_clients) if len(data.clients[c].train_y) > 0]
    if clients is not None:
        if clients < 2:
            raise PflkitError(f"--clients must be at least 2, got {clients}")
        ids = ids[:clients]
    if len(ids) < 2:
        raise PflkitError("the similarity study needs at least two clients with training data")
    seed_torch(cfg.seed, 0, 0xD0)
    init = senv.init_weights()  # one shared initial model
    model = senv.model(slot="analysis")
    params = [k for k, _ in model.named_parameters()]
    head = model.group_keys("head")
    has_bn = bool(bn_modules(model))
    trained: dict[int, Weights] = {}
    plain = RoundContext(0, "similarity", cfg.seed)  # plain SGD at train.lr, every batch
    for c in ids:
        seed_torch(cfg.seed, 0, 0x51, c)
        trained[c], _ = train_from(envs[c], init, plain, steps=steps)
    counts = data.class_table("train")
    init_flat = _flat(init, params)
    upd = {c: _flat(trained[c], params) - init_flat for c in ids}
    own_loss = {
        c: _loss(model, trained[c], envs[c].data.train_x, envs[c].data.train_y) for c in ids
    }
    stats = {}
    if has_bn:
        for c in ids:
            set_weights(model, trained[c])
            stats[c] = feature_stats(model, envs[c].data.train_x)
    rows = {c: class_rows({k: trained[c][k] for k in head}) for c in ids}

    def ldb(i: int, j: int) -> float:
        d = float((upd[j] - upd[i]).norm())
        lij = _loss(model, trained[j], envs[i].data.train_x, envs[i].data.train_y)
        return (own_loss[i] - lij) / d if d > 0 else 0.0

    pairs = []
    for a, i in enumerate(ids):
        for j in ids[a + 1 :]:
            pair = {
                "clients": [i, j],
                "data_similarity": data_similarity(counts[i], counts[j]),
                "cs": float(class_cosines(rows[i], rows[j], cos_max=1.0).mean()),
                "cs_log": classifier_similarity(rows[i], rows[j], "per_class_log"),
                "mdb": float(F.cosine_similarity(upd[i], upd[j], dim=0)),
                "ldb": 0.5 * (ldb(i, j) + ldb(j, i)),
            }
            if has_bn:
                pair["wdb"] = bn_wasserstein(stats[i], stats[j])
            pairs.append(pair)
    result = {
        "config": cfg.name,
        "dataset": cfg.data.dataset,
        "partition": cfg.data.partition,
        "model": cfg.model.name,
        "steps": steps,
        "clients": ids,
        "scores": _scores(pairs),
        "pairs": pairs,
    }
    make_folder(out, "output folder")
    try:
        (out / "similarity.json").write_text(json.dumps(result, indent=2, default=str))
        (out / "similarity.md").write_text(_markdown(result))
        _heatmaps(result, out / "similarity.png")
    except OSError as err:
        raise PflkitError(
            f"cannot write the study into '{out}' ({err.strerror or err}): choose another --out"
        ) from None
    return result


#: what the study writes; a folder holding only these (an earlier study) is written over
OUTPUTS = ("similarity.json", "similarity.md", "similarity.png")


def _scores(pairs: list[dict]) -> dict[str, dict[str, float | None]]:
    from scipy.stats import kendalltau, spearmanr

    truth = np.array([p["data_similarity"] for p in pairs])
    out = {}
    for m, (_, higher) in METRICS.items():
        if m == "data_similarity" or m not in pairs[0]:
            continue
        v = np.array([p[m] for p in pairs]) * (1 if higher else -1)
        if len(pairs) < 2 or np.ptp(v) == 0 or np.ptp(truth) == 0:
            out[m] = {"spearman": None, "kendall": None}
            continue
        out[m] = {
            "spearman": float(spearmanr(truth, v).statistic),
            "kendall": float(kendalltau(truth, v).statistic),
        }
    return out


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3g}" if abs(v) < 1e-2 and v != 0 else f"{v:.3f}"


def _markdown(r: dict) -> str:
    lines = [
        f"# Similarity study: {r['config']}",
        "",
        f"{r['dataset']}, {r['partition']}, model {r['model']}, {len(r['clients'])} clients, "
        f"{r['steps']} local SGD steps each from one shared initial model (pFedSim §3).",
        "",
        "Rank correlation with data similarity over all client pairs (1 = same ordering; "
        "WDB is a distance, so its negative is ranked):",
        "",
        "| metric | Spearman | Kendall |",
        "|---|---|---|",
    ]
    for m, s in r["scores"].items():
        lines.append(f"| {METRICS[m][0]} | {_fmt(s['spearman'])} | {_fmt(s['kendall'])} |")
    cols = [m for m in METRICS if m in r["pairs"][0]]
    lines += [
        "",
        "Pairs (as in Table 2):",
        "",
        "| pair | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    shown = r["pairs"][:45]
    for p in shown:
        i, j = p["clients"]
        lines.append(f"| ({i}, {j}) | " + " | ".join(_fmt(p[m]) for m in cols) + " |")
    if len(r["pairs"]) > len(shown):
        lines.append(f"\n{len(r['pairs']) - len(shown)} more pairs in similarity.json.")
    return "\n".join(lines) + "\n"


def _heatmaps(r: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ids = r["clients"]
    pos = {c: k for k, c in enumerate(ids)}
    cols = [m for m in METRICS if m in r["pairs"][0]]
    n = len(ids)
    fig = Figure(figsize=(3.6 * len(cols), 3.6), dpi=100)
    FigureCanvasAgg(fig)
    for a, m in enumerate(cols):
        mat = np.full((n, n), np.nan)
        for p in r["pairs"]:
            i, j = (pos[c] for c in p["clients"])
            mat[i, j] = mat[j, i] = p[m]
        ax = fig.add_subplot(1, len(cols), a + 1)
        im = ax.imshow(
            mat, cmap="viridis" if METRICS[m][1] else "viridis_r", interpolation="nearest"
        )
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        score = r["scores"].get(m, {}).get("spearman")
        title = METRICS[m][0].split(":")[0] + ("" if score is None else f"\nSpearman {score:.2f}")
        ax.set_title(title, fontsize=9)
        if n <= 20:
            ax.set_xticks(range(n), [str(c) for c in ids], fontsize=7)
            ax.set_yticks(range(n), [str(c) for c in ids], fontsize=7)
        ax.set_xlabel("client")
    fig.suptitle(f"{r['config']}: pairwise similarity (diagonal blank)", fontsize=10)
    fig.savefig(path, format="png", bbox_inches="tight")
