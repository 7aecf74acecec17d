"""Membership and label inference against what a semi-honest server sees and against the
client's personalized model: the companion of the DLG study (:mod:`pflkit.analysis.privacy`)
behind ``pflkit analyze privacy --attack mia``.

**Membership inference.** Given a model and an example (x, y), decide whether (x, y) was in the
victim client's training split. Two scores (higher = "member"):

- ``loss``: the loss-threshold attack of Yeom, Giacomelli, Fredrikson & Jha ("Privacy Risk in
  Machine Learning: Analyzing the Connection to Overfitting", CSF 2018):
  ``score = -l_target(x, y)``; members tend to have lower loss.
- ``calibrated``: per-example difficulty calibration (Watson, Guo, Cormode & Sablayrolles, "On
  the Importance of Difficulty Calibration in Membership Inference Attacks", ICLR 2022):
  ``score = -(l_target(x, y) - mean_k l_ref_k(x, y))``: an example that is hard for models
  that never saw it is not taken for a non-member because the target finds it hard too.

``l`` is the per-example cross-entropy of what the model outputs (the logits that evaluation's
argmax reads; a class scored ``-inf``, e.g. one without a prototype, gives an infinite loss),
capped at :data:`LOSS_CAP` nats so that the calibration never subtracts infinities.

**Reference models (the attacker's knowledge).** The server is assumed to know the data of the
population's *other* clients, never the victim's. For each of ``references`` seeded pairs
(generator seeded by (seed, pair)), the clients with training data are shuffled and split into
two halves; one model is trained on the pooled training splits of each half, so every client
lies in exactly one half of each pair and each victim gets exactly ``references`` reference
models, one per pair, all from the half it is not in. A reference model is algorithm-free: it
starts from a fresh initialisation of the victim's architecture (seeded by (seed, pair, half))
and is trained with the client's training recipe (``env.train``: the run's optimiser, lr,
momentum, weight decay, batch size, augmentation, clipping, DP-SGD when ``privacy.sample_dp``
is on) for ``ref_epochs`` epochs over its pooled data (default: the attacked round times
``train.local_epochs``, the number of local epochs a victim that takes part in every round
makes over its own data). The reference models of a seed serve every algorithm and target of
that seed, so one call with several algorithms trains them once.

**Examples.** Members: the victim's training split; non-members: its local test split (the
same client distribution, never trained on by anyone). Balanced by subsampling: n = the
smaller split's size, n of each drawn without replacement (generator seeded by (seed,
victim)). Scores are pooled over victims and seeds for one ROC per (algorithm, target, attack)
(one global threshold, as an attacker without per-client tuning would use); the per-victim
AUCs are reported too.

**Targets.**

- ``upload``: what the server sees of the victim in the attacked round: the uploads the
  algorithm's ``aggregate`` receives (after client-level DP's clipping and noise when
  ``privacy.client_dp`` is on), read through the algorithm's release map (``Algorithm.release``).
  Every released upload key that updates a download key (``{"weights": "weights"}``,
  ``{"body": "body"}``, GPFL's ``{"shared": "shared"}``) contributes the model tensors it
  carries (state-dict keys of the victim's model; GPFL's CoV and GCE are not part of the plain
  model and are left out). Keys released as they are (statistics, SCAFFOLD's deltas) contribute
  no model. Parameters the upload does not carry are taken from the payload the server sent the
  victim in that round (its own state) when it holds them; those it does not hold either (the
  head of FedPer and FedRep, whose server keeps only the body; FedBN's BatchNorm layers) are
  **fitted by the attacker**: starting from a fresh initialisation (seeded by (seed, victim)),
  trained for ``fit_epochs`` epochs of the client's recipe on the pooled training splits of all
  other clients, with every released or sent tensor frozen (and restored afterwards, so
  BatchNorm statistics of the released layers are the released ones). The study records which
  of the three each target used. For FedAvg the upload is the whole trained model; for Ditto,
  its global-model update (the personal model never leaves); for FedRep/FedPer the uploaded
  body with an attacker-fitted head. With several exchanges in a round, the last one that
  releases model tensors is attacked.
- ``personal``: the model evaluation scores for the victim after the attacked round
  (:func:`~pflkit.engine.clients.scored_model`: ``eval_view`` and ``personal_model``,
  fine-tuning when ``eval.finetune_epochs`` is set).

An algorithm whose upload is a known statistic (prototypes: FedProto, pFedPM; soft predictions
on the public set: KT-pFL, FedMD, Sim-pFD, TopK-pFD) has no model upload: its ``upload`` target
is unavailable and its upload is attacked by label inference. An algorithm with no release map
whose upload is not one of those is refused (the study cannot tell what its upload reveals).

**Label inference** (attack ``label``): from the victim's upload of the attacked round, infer
which classes it holds (count > 0 in its training split) and its label distribution:

- prototypes (FedProto, pFedPM): the upload names the classes held (``classes``) and, with
  count weighting, their sample counts (``counts``): the held set is read off, the distribution
  is the counts normalised (uniform over the named classes without counts). Exact by
  construction: the row says that the upload discloses it;
- soft predictions on the public set (KT-pFL, FedMD, Sim-pFD, TopK-pFD): a model trained on a
  skewed label distribution predicts its own classes more often. The estimate is the mean
  predicted distribution over the public set; a class is inferred held when its mean predicted
  probability is at least half the uniform share, 1 / (2 K);
- a released model that holds the head's last bias (FedAvg, Ditto, ...): the bias moves up for
  classes the victim's data over-represents relative to what the received model predicts, and
  down for absent ones (the last-layer label leakage of gradient updates). Score: uploaded minus
  received bias; inferred held when it rose. No distribution estimate.

Metrics, over (seed, victim): the held-class AUC (pooled over (victim, class) pairs, score
against held / not held), the held-set accuracy (over (victim, class) decisions), whether the
most frequent class is the top score, and the total variation distance between the estimated
and the true label distribution. Baseline (guessing with the attacker's knowledge, no upload):
the label counts of the other clients: a class is guessed held when more than half of the other
clients hold it, its share of them scores the AUC, the pooled distribution of their labels is
the distribution and its top class the majority guess; ``1 / K`` is the chance of a random
majority guess.

Deterministic given the seeds: every draw is seeded from (seed, victim, pair, ...), the
simulations run in this process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pflkit.algorithms.base import ALGORITHMS, Algorithm
from pflkit.algorithms.blocks.distill import SoftTeacherKD
from pflkit.algorithms.context import ServerContext
from pflkit.algorithms.env import ClientEnv
from pflkit.algorithms.fedproto import FedProto
from pflkit.config import ExperimentConfig
from pflkit.data.federated import FederatedDataset, build_federated
from pflkit.engine.clients import (
    EVALUATE,
    InProcess,
    key_generator,
    key_seed,
    round_context,
    scored_model,
    seed_torch,
    system_draw,
)
from pflkit.engine.compare import plan_entries, run_config
from pflkit.engine.folder import check_out, make_folder
from pflkit.engine.population import held_out, training_clients
from pflkit.engine.simulation import Simulation, sample_clients
from pflkit.errors import PflkitError
from pflkit.primitives.training import get_weights, predict, set_weights

#: the attacks of this study; ``mia`` (the CLI's --attack) runs all three
ATTACKS = {
    "loss": "loss threshold (Yeom et al. 2018): score = -loss",
    "calibrated": "difficulty calibration (Watson et al. 2022): score = -(loss - mean reference loss)",
    "label": "label inference from the upload's statistics",
}
MIA = ("loss", "calibrated")
TARGETS = {
    "upload": "what the server sees: the victim's upload, read through the release map",
    "personal": "the victim's personalized model (what evaluation scores)",
}
OUTPUTS = ("membership.json", "membership.md", "membership.png")
LOSS_CAP = 100.0  # nats: an infinite loss (a class scored -inf) counts as this
FPR_AT = 0.01


# -- the scores and their metrics (tested by hand on tiny lists) ----------------------------------


def roc_curve(
    members: Sequence[float], nonmembers: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) of the rule "member iff score >= t" at every distinct score t, from (0, 0)
    (no example called a member) to (1, 1); tied scores cross the threshold together."""
    m = np.asarray(members, dtype=float)
    n = np.asarray(nonmembers, dtype=float)
    if not len(m) or not len(n):
        raise ValueError("an ROC needs at least one member and one non-member score")
    thresholds = np.unique(np.concatenate([m, n]))[::-1]
    ms, ns = np.sort(m), np.sort(n)
    tpr = (len(m) - np.searchsorted(ms, thresholds, side="left")) / len(m)
    fpr = (len(n) - np.searchsorted(ns, thresholds, side="left")) / len(n)
    return np.concatenate([[0.0], fpr]), np.concatenate([[0.0], tpr])


def roc_auc(members: Sequence[float], nonmembers: Sequence[float]) -> float:
    """Area under the ROC: the probability that a random member scores above a random
    non-member, ties counting one half (the Mann-Whitney U statistic over n_m n_n)."""
    m = np.asarray(members, dtype=float)
    n = np.asarray(nonmembers, dtype=float)
    if not len(m) or not len(n):
        raise ValueError("an AUC needs at least one member and one non-member score")
    ns = np.sort(n)
    below = np.searchsorted(ns, m, side="left")
    ties = np.searchsorted(ns, m, side="right") - below
    return float((below.sum() + 0.5 * ties.sum()) / (len(m) * len(n)))


def tpr_at_fpr(members: Sequence[float], nonmembers: Sequence[float], fpr: float = FPR_AT) -> float:
    """The highest TPR of any threshold whose FPR is at most ``fpr`` (no interpolation: with
    100 non-members, 1% FPR allows one of them above the threshold)."""
    f, t = roc_curve(members, nonmembers)
    return float(t[f <= fpr + 1e-12].max())


def example_losses(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 250) -> np.ndarray:
    """Per-example cross-entropy of ``model``'s outputs (eval mode), computed in float64 (in
    float32 the losses of well-fitted examples round to exactly 0 and tie), capped at
    :data:`LOSS_CAP` (an infinite or undefined loss counts as the cap)."""
    logits = predict(model, x, batch_size).double()  # float64: members' losses near 0 stay apart
    loss = F.cross_entropy(logits, y, reduction="none")
    loss = torch.nan_to_num(loss, nan=LOSS_CAP, posinf=LOSS_CAP).clamp(0.0, LOSS_CAP)
    return loss.detach().cpu().double().numpy()


def loss_scores(target: np.ndarray) -> np.ndarray:
    """Yeom et al.: the score of an example is minus its loss under the target."""
    return -np.asarray(target, dtype=float)


def calibrated_scores(target: np.ndarray, references: np.ndarray) -> np.ndarray:
    """Watson et al.: minus (the loss under the target less the mean loss under the reference
    models); ``references`` is [models, examples]."""
    ref = np.asarray(references, dtype=float)
    if ref.ndim != 2 or ref.shape[1] != len(target):
        raise ValueError(f"reference losses must be [models, {len(target)}], got {ref.shape}")
    return -(np.asarray(target, dtype=float) - ref.mean(0))


def attack_metrics(members: np.ndarray, nonmembers: np.ndarray) -> dict[str, float]:
    """AUC and TPR at 1% FPR of member and non-member scores."""
    return {"auc": roc_auc(members, nonmembers), "tpr_at_1fpr": tpr_at_fpr(members, nonmembers)}


# -- the reference models' plan ---------------------------------------------------------------------


def reference_plan(
    population: Sequence[int], victims: Sequence[int], pairs: int, seed: int
) -> dict[int, list[tuple[int, int, tuple[int, ...]]]]:
    """Per victim, its reference models as (pair, half, clients): for each of ``pairs`` seeded
    shuffles of ``population`` (generator seeded by (seed, pair)), the half that does **not**
    hold the victim; so every victim has exactly ``pairs`` reference models and none was
    trained on its data. A population of one client gives none."""
    pop = sorted(population)
    splits = []
    for k in range(pairs):
        perm = np.random.default_rng([seed, k, 0x4EF]).permutation(pop).tolist()
        half = len(perm) // 2
        splits.append((tuple(sorted(perm[:half])), tuple(sorted(perm[half:]))))
    plan: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
    for v in victims:
        plan[v] = []
        for k, (a, b) in enumerate(splits):
            h, clients = (1, b) if v in a else (0, a)
            if clients:
                plan[v].append((k, h, clients))
    return plan


# -- label inference ---------------------------------------------------------------------------------


def infer_labels(upload: Mapping[str, Any], num_classes: int) -> dict[str, Any] | None:
    """Label inference from one upload's statistics (module docstring): {source, scores [K],
    held [K] bool, estimate [K] or None}; None when the upload holds none of them.
    ``upload`` may also carry ``bias_delta`` (uploaded minus received head bias), which
    :func:`bias_statistic` extracts from a released model."""
    k = num_classes
    if "classes" in upload:
        classes = torch.as_tensor(upload["classes"]).long().cpu().numpy()
        scores = np.zeros(k)
        scores[classes] = 1.0
        if "counts" in upload:
            counts = np.zeros(k)
            counts[classes] = torch.as_tensor(upload["counts"]).double().cpu().numpy()
            source = "prototype upload: classes and counts"
        else:
            counts = scores.copy()
            source = "prototype upload: classes"
        est = counts / counts.sum() if counts.sum() > 0 else None
        return {"source": source, "scores": scores, "held": scores > 0, "estimate": est}
    if "soft" in upload:
        soft = torch.as_tensor(upload["soft"]).double().cpu().numpy()
        mean = soft.reshape(-1, soft.shape[-1]).mean(0)
        est = mean / mean.sum()
        return {
            "source": "soft predictions on the public set",
            "scores": est,
            "held": est >= 1.0 / (2 * k),
            "estimate": est,
        }
    if "bias_delta" in upload:
        delta = torch.as_tensor(upload["bias_delta"]).double().cpu().numpy()
        return {
            "source": "head bias update of the released model",
            "scores": delta,
            "held": delta > 0,
            "estimate": None,
        }
    return None


def bias_statistic(
    model: nn.Module, released: Mapping[str, Tensor], received: Mapping[str, Tensor]
) -> dict[str, Tensor] | None:
    """``{"bias_delta": uploaded - received}`` of the head's last bias (the one with one entry
    per class) when the released model holds it and the server sent it; else None."""
    head = [k for k in getattr(model, "group_keys", lambda _: [])("head") if k.endswith("bias")]
    if not head:
        return None
    key = head[-1]
    if key not in released or key not in received:
        return None
    return {"bias_delta": (released[key].double() - received[key].double()).cpu()}


def label_metrics(cases: Sequence[dict[str, Any]], num_classes: int) -> dict[str, Any]:
    """Pooled metrics of label inference over ``cases``, each {inferred: :func:`infer_labels`'s
    dict, counts: the victim's true label counts [K], prior: the other clients' label counts
    [K], prior_held: share of the other clients that hold each class [K]}."""
    k = num_classes
    scores, truth, prior_scores = [], [], []
    acc, acc_prior, top, top_prior, tv, tv_prior = [], [], [], [], [], []
    for c in cases:
        inf, counts = c["inferred"], np.asarray(c["counts"], dtype=float)
        held = counts > 0
        p = counts / counts.sum()
        prior = np.asarray(c["prior"], dtype=float)
        prior_p = prior / prior.sum() if prior.sum() > 0 else np.full(k, 1.0 / k)
        prior_held = np.asarray(c["prior_held"], dtype=float)
        scores.append(inf["scores"])
        prior_scores.append(prior_held)
        truth.append(held)
        acc.append(float(np.mean(inf["held"] == held)))
        acc_prior.append(float(np.mean((prior_held > 0.5) == held)))
        best = inf["scores"] if inf["estimate"] is None else inf["estimate"]
        top.append(float(np.argmax(best) == np.argmax(counts)))
        top_prior.append(float(np.argmax(prior_p) == np.argmax(counts)))
        if inf["estimate"] is not None:
            tv.append(0.5 * float(np.abs(inf["estimate"] - p).sum()))
        tv_prior.append(0.5 * float(np.abs(prior_p - p).sum()))
    s, t, ps = np.concatenate(scores), np.concatenate(truth), np.concatenate(prior_scores)
    both = t.any() and (~t).any()
    return {
        "source": cases[0]["inferred"]["source"],
        "held_auc": roc_auc(s[t], s[~t]) if both else None,
        "held_auc_prior": roc_auc(ps[t], ps[~t]) if both else None,
        "held_acc": float(np.mean(acc)),
        "held_acc_prior": float(np.mean(acc_prior)),
        "top1_acc": float(np.mean(top)),
        "top1_acc_prior": float(np.mean(top_prior)),
        "top1_chance": 1.0 / k,
        "tv": float(np.mean(tv)) if tv else None,
        "tv_prior": float(np.mean(tv_prior)),
        "n": len(cases),
    }


# -- what the server sees ----------------------------------------------------------------------------


def statistic_sharer(cls: type[Algorithm]) -> bool:
    """Whether the algorithm's upload is a statistic this study reads (prototypes, soft
    predictions on the public set) rather than a model."""
    return issubclass(cls, FedProto | SoftTeacherKD)


def releases_model(cls: type[Algorithm]) -> bool:
    """Whether the release map names an upload key that updates a download key (a model)."""
    return bool(cls.release) and any(ref is not None for ref in cls.release.values())


def _leaves(obj: Any) -> dict[str, Tensor]:
    """Every tensor of a nested dict by its innermost key (the state-dict keys)."""
    out: dict[str, Tensor] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if isinstance(v, Tensor):
                out[k] = v
            else:
                out.update(_leaves(v))
    return out


def released_tensors(
    algo: Algorithm, upload: Mapping[str, Any], model_keys: set[str]
) -> dict[str, Tensor]:
    """The model tensors (state-dict keys of ``model_keys``) of the upload's released keys
    that update a download key (release map ``key -> ref`` with ``ref`` not None)."""
    out: dict[str, Tensor] = {}
    for key, ref in (algo.release or {}).items():
        if ref is not None and key in upload:
            out.update({k: v for k, v in _leaves(upload[key]).items() if k in model_keys})
    return out


def upload_model(
    algo: Algorithm,
    env: ClientEnv,
    exchanges: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]],
    fit: Callable[[nn.Module, list[Tensor]], tuple[int, int]],
) -> tuple[dict[str, Tensor] | None, dict[str, Any]]:
    """The model the server sees of the victim, from its round's ``exchanges`` ((payload,
    released upload) per phase): the released tensors of the last exchange that releases
    any, the rest from that payload, what neither holds fitted by ``fit(model, params)``
    (returns (samples, epochs)). Returns (weights or None, how: a dict saying which keys came
    from where, or why there is no model)."""
    model = env.model("mia-upload")
    state = model.state_dict()
    keys = set(state)
    released: dict[str, Tensor] = {}
    payload: Mapping[str, Any] = {}
    for pay, up in exchanges:
        got = released_tensors(algo, up, keys)
        if got:
            released, payload = got, pay
    if not released:
        return None, {"why": "its upload releases no model parameters"}
    sent = {k: v for k, v in _leaves(payload).items() if k in keys and k not in released}
    known = {**sent, **released}
    missing = [k for k in state if k not in known]
    how: dict[str, Any] = {"released": len(released), "from_payload": len(sent), "fitted": 0}
    if missing:
        with torch.random.fork_rng(devices=_devices(env)):
            torch.manual_seed(key_seed(env.run.seed, env.cid, 0x4F17))
            init = env.init_weights()
        set_weights(model, {**init, **known})
        named = dict(model.named_parameters())
        params = [named[k] for k in missing if k in named]
        if params:
            samples, epochs = fit(model, params)
            how.update(fit_samples=samples, fit_epochs=epochs)
        how["fitted"] = len(missing)
        how["fitted_keys"] = missing
        weights = {**get_weights(model), **known}  # released and sent values stay as seen
    else:
        weights = known
    return {k: weights[k] for k in state}, how


def _devices(env: ClientEnv) -> list:
    return [env.device] if env.device.type == "cuda" else []


def describe_how(how: Mapping[str, Any]) -> str:
    """One phrase for the record: what the upload target is made of."""
    if "why" in how:
        return how["why"]
    parts = [f"{how['released']} released tensors"]
    if how["from_payload"]:
        parts.append(f"{how['from_payload']} from the server's download")
    if how["fitted"]:
        names = sorted({k.rsplit(".", 1)[0] for k in how["fitted_keys"]})
        parts.append(
            f"{how['fitted']} fitted by the attacker ({', '.join(names)}; "
            f"{how.get('fit_epochs', 0)} epochs on {how.get('fit_samples', 0)} samples of the "
            "other clients)"
        )
    return ", ".join(parts)


# -- the study -------------------------------------------------------------------------------------


def _parse_attacks(attacks: str | Sequence[str] | None) -> list[str]:
    if attacks is None:
        return list(ATTACKS)
    if isinstance(attacks, str):
        attacks = [a.strip() for a in attacks.split(",") if a.strip()]
    chosen: list[str] = []
    for a in attacks:
        if a == "mia":
            chosen += list(ATTACKS)
        elif a in ATTACKS:
            chosen.append(a)
        else:
            raise PflkitError(
                f"unknown attack '{a}': use mia (all of them) or choose from "
                f"{', '.join(ATTACKS)} (or dlg, the gradient inversion study)"
            )
    if not chosen:
        raise PflkitError("no attack given: use mia or choose from " + ", ".join(ATTACKS))
    return list(dict.fromkeys(chosen))


def _victims(
    cfg: ExperimentConfig, data: FederatedDataset, rnd: int, seeds: list[int], victims
) -> dict[int, list[int]]:
    """Per seed, the attacked clients: ids (checked), the first N, or (None) every client that
    uploads in round ``rnd`` (sampled, not dropped) and has training and test data."""
    n, hold = data.num_clients, held_out(cfg)
    out = {}
    for s in seeds:
        part = [
            c
            for c in sample_clients(s, rnd, n, cfg.train.client_fraction, hold)
            if not system_draw(cfg.system, s, rnd, c)[0]
            and len(data.clients[c].train_y)
            and len(data.clients[c].test_y)
        ]
        if not part:
            raise PflkitError(
                f"no client with training and test data uploads in round {rnd} (seed {s}): "
                "choose another --round or raise train.client_fraction"
            )
        if victims is None:
            out[s] = part
        elif isinstance(victims, int):
            if victims < 1:
                raise PflkitError(f"--victims {victims} must be at least 1 (or a list of ids)")
            if victims > len(part):
                raise PflkitError(
                    f"--victims {victims} exceeds the {len(part)} clients with training and "
                    f"test data that upload in round {rnd} (seed {s}): give at most {len(part)}"
                )
            out[s] = part[:victims]
        else:
            for c in victims:
                if not 0 <= c < n:
                    raise PflkitError(
                        f"--victims {c} is not a client: give ids between 0 and {n - 1}"
                    )
                if c not in part:
                    raise PflkitError(
                        f"--victims {c} does not upload in round {rnd} (seed {s}: not sampled, "
                        f"dropped, held out or without training or test data): choose among "
                        f"{part[:10]}"
                    )
            out[s] = list(dict.fromkeys(victims))
    return out


def _candidates(data: FederatedDataset, seed: int, cid: int) -> tuple[Tensor, Tensor, int]:
    """(x, y, n): the victim's n members (training split) then n non-members (local test
    split), n = the smaller split, each drawn without replacement (seeded by (seed, victim))."""
    c = data.clients[cid]
    n = min(len(c.train_y), len(c.test_y))
    gen = key_generator(seed, cid, 0x3E3)
    mi = torch.randperm(len(c.train_y), generator=gen)[:n].to(c.train_y.device)
    ni = torch.randperm(len(c.test_y), generator=gen)[:n].to(c.test_y.device)
    x = torch.cat([c.train_x[mi], c.test_x[ni]])
    y = torch.cat([c.train_y[mi], c.test_y[ni]])
    return x, y, n


def _pooled(data: FederatedDataset, clients: Sequence[int]) -> tuple[Tensor, Tensor]:
    xs = [data.clients[c].train_x for c in clients]
    ys = [data.clients[c].train_y for c in clients]
    return torch.cat(xs), torch.cat(ys)


def _train_on(env: ClientEnv, model: nn.Module, x: Tensor, y: Tensor, epochs: int, key, **kw):
    """The client's recipe (``env.train``) on (x, y) for ``epochs`` epochs, torch seeded by
    ``key`` inside ``fork_rng`` (the caller's stream is left as it was)."""
    benv = replace(env, data=replace(env.data, train_x=x, train_y=y))
    ctx = round_context(env.run, 1, "reference")
    with torch.random.fork_rng(devices=_devices(env)):
        seed_torch(*key)
        benv.train(model, ctx, epochs=epochs, **kw)


def _reference_losses(
    sim: Simulation,
    plan: dict[int, list[tuple[int, int, tuple[int, ...]]]],
    cands: dict[int, tuple[Tensor, Tensor, int]],
    epochs: int,
    say: Callable[[str], None],
) -> tuple[dict[int, np.ndarray], dict[int, list[dict[str, Any]]]]:
    """Train each reference model of ``plan`` once (per architecture) and return, per victim,
    its reference models' losses on its candidates [models, 2n] and what they were trained
    on."""
    seed, envs, data = sim.cfg.seed, sim.envs, sim.data
    losses: dict[int, list[np.ndarray]] = {v: [] for v in plan}
    info: dict[int, list[dict[str, Any]]] = {v: [] for v in plan}
    jobs: dict[tuple[str, int, int, tuple[int, ...]], list[int]] = {}
    for v, models in plan.items():
        for k, h, clients in models:
            jobs.setdefault((envs[v].arch, k, h, clients), []).append(v)
    eval_bs = sim.cfg.eval.batch_size
    for i, ((_arch, k, h, clients), users) in enumerate(jobs.items()):
        env = envs[users[0]]
        x, y = _pooled(data, clients)
        say(
            f"reference model {i + 1}/{len(jobs)} (seed {seed}, pair {k}, half {h}): "
            f"{epochs} epochs on {len(y)} samples of clients {list(clients)}"
        )
        model = env.model("mia-reference")
        with torch.random.fork_rng(devices=_devices(env)):
            torch.manual_seed(key_seed(seed, k, h, 0x4EF))
            set_weights(model, env.init_weights())
        _train_on(env, model, x, y, epochs, (seed, k, h, 0x4EF1))
        for v in users:
            cx, cy, _ = cands[v]
            losses[v].append(example_losses(model, cx, cy, eval_bs))
            info[v].append({"pair": k, "half": h, "clients": list(clients), "samples": len(y)})
    return {
        v: np.stack(ls) if ls else np.zeros((0, len(cands[v][1]))) for v, ls in losses.items()
    }, info


class _Recorder:
    """Wraps ``sim.algo``'s ``configure`` and ``aggregate`` to keep, for the victims, the
    payloads and the uploads the server receives (after client-level DP) in round ``rnd``."""

    def __init__(self, sim: Simulation, rnd: int, victims: Sequence[int]):
        algo = sim.algo
        self.payloads: dict[int, dict[str, Any]] = {v: {} for v in victims}
        self.uploads: dict[int, dict[str, Any]] = {v: {} for v in victims}
        self.phases: list[str] = []
        configure, aggregate = algo.configure, algo.aggregate

        def recording_configure(env, server, cid, sctx):
            payload = configure(env, server, cid, sctx)
            if sctx.round == rnd and cid in self.payloads:
                self.payloads[cid].setdefault(sctx.phase, payload)
            return payload

        def recording_aggregate(env, server, uploads, sctx):
            if sctx.round == rnd:
                self.phases.append(sctx.phase)
                for cid in self.uploads:
                    if cid in uploads:
                        self.uploads[cid][sctx.phase] = uploads[cid]
            return aggregate(env, server, uploads, sctx)

        algo.configure = recording_configure  # type: ignore[method-assign]
        algo.aggregate = recording_aggregate  # type: ignore[method-assign]

    def exchanges(self, cid: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return [
            (self.payloads[cid].get(p, {}), self.uploads[cid][p])
            for p in self.phases
            if p in self.uploads[cid]
        ]


def _check_algorithms(entries, targets: list[str] | None) -> None:
    for _, algo_cfg, _ in entries:
        cls = ALGORITHMS.lookup(algo_cfg["name"])
        if cls.release is None and not statistic_sharer(cls):
            raise PflkitError(
                f"algorithm '{cls.name}' declares no release map ({cls.release_refusal}), so "
                "the study cannot tell what its upload reveals: choose an algorithm that "
                "declares one (pflkit list --params NAME shows it)"
            )
        if targets and "upload" in targets and not releases_model(cls):
            what = (
                "uploads statistics, not a model"
                if statistic_sharer(cls)
                else "releases no model parameters"
            )
            raise PflkitError(
                f"--targets upload needs a model in the upload, but algorithm '{cls.name}' "
                f"{what}: leave out --targets (its upload is attacked by label inference) or "
                "use --targets personal"
            )


def membership_study(
    cfg: ExperimentConfig,
    out: Path | str | None = None,
    *,
    attacks: str | Sequence[str] | None = None,
    rnd: int | None = None,
    victims: int | Sequence[int] | None = None,
    references: int = 2,
    ref_epochs: int | None = None,
    fit_epochs: int = 5,
    seeds: Sequence[int] | None = None,
    targets: Sequence[str] | None = None,
    algorithms: Sequence[str | dict[str, Any]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Membership inference (``loss``, ``calibrated``) against each target and label inference
    (``label``) from the upload, for every algorithm (default: the config's) and seed
    (default: the config's), on the victims (default: every client with training and test data
    that uploads in round ``rnd``, default the last). Every check runs before any training.
    Returns a plain dict (the JSON); with ``out``, also writes ``membership.json``,
    ``membership.md`` and ``membership.png`` there (a new or empty folder, or one holding only
    these or the DLG study's files)."""
    say = progress or (lambda line: None)
    chosen_attacks = _parse_attacks(attacks)
    rnd = cfg.train.rounds if rnd is None else rnd
    from pflkit.analysis.privacy import OUTPUTS as DLG_OUTPUTS
    from pflkit.analysis.privacy import check_study

    check_study(
        cfg,
        rnd,
        targets,
        TARGETS,
        references=references,
        fit_epochs=fit_epochs,
        ref_epochs=ref_epochs,
    )
    if out is not None:
        out = Path(out)
        check_out(out, OUTPUTS + DLG_OUTPUTS)
    seeds = list(seeds) if seeds else [cfg.seed]
    entries = plan_entries(list(algorithms) if algorithms else [cfg.algorithm], cfg.train.weighting)
    _check_algorithms(entries, list(targets) if targets else None)
    data = build_federated(cfg.data)
    chosen = _victims(
        cfg,
        data,
        rnd,
        seeds,
        None if victims is None else (victims if isinstance(victims, int) else list(victims)),
    )
    population = [
        c for c in training_clients(data.num_clients, held_out(cfg)) if len(data.clients[c].train_y)
    ]
    epochs = ref_epochs or rnd * cfg.train.local_epochs
    use_targets = list(targets) if targets else list(TARGETS)
    mia = [a for a in chosen_attacks if a in MIA]
    k_classes = data.num_classes
    say(
        f"membership study: {len(entries)} algorithm(s), seeds {seeds}, round {rnd}, "
        f"attacks {', '.join(chosen_attacks)}"
    )
    t0 = time.perf_counter()

    pooled: dict[tuple[str, str, str], tuple[list[np.ndarray], list[np.ndarray]]] = {}
    records: list[dict[str, Any]] = []
    unavailable: dict[tuple[str, str], str] = {}
    label_cases: dict[str, list[dict[str, Any]]] = {}
    references_used: dict[str, Any] = {}
    cands_by_seed: dict[int, dict[int, tuple[Tensor, Tensor, int]]] = {}
    ref_by_seed: dict[int, dict[int, np.ndarray]] = {}
    labels_of: dict[str, str] = {}

    for label, algo_cfg, _ in entries:
        labels_of[label] = algo_cfg["name"]
        for s in seeds:
            run_cfg = run_config(cfg, algo_cfg, [], s)
            with Simulation(run_cfg, data=data, runner=InProcess()) as sim:
                vs = chosen[s]
                if s not in cands_by_seed:
                    cands_by_seed[s] = {v: _candidates(sim.data, s, v) for v in vs}
                cands = cands_by_seed[s]
                if "calibrated" in mia and s not in ref_by_seed:
                    plan = reference_plan(population, vs, references, s)
                    if any(not plan[v] for v in vs):
                        raise PflkitError(
                            "the calibrated attack needs reference models trained on other "
                            "clients' data, but the population has only one client with "
                            "training data: use --attack loss,label"
                        )
                    ref_by_seed[s], info = _reference_losses(sim, plan, cands, epochs, say)
                    references_used[str(s)] = {str(v): i for v, i in info.items()}
                rec = _Recorder(sim, rnd, vs)
                for r in range(1, rnd + 1):
                    say(f"{label} seed {s}: round {r} of {rnd}")
                    sim.run_round(r)
                senv, algo = sim.senv, sim.algo
                ctx = round_context(senv.run, rnd, EVALUATE)
                for v in vs:
                    env = sim.envs[v]
                    cx, cy, n = cands[v]
                    exchanges = rec.exchanges(v)
                    models: dict[str, nn.Module | None] = {}
                    hows: dict[str, str] = {}
                    if "personal" in use_targets and mia:
                        sctx = ServerContext(rnd, EVALUATE, run_cfg.seed)
                        view = algo.eval_view(senv, sim.server, v, sctx)
                        models["personal"] = scored_model(
                            algo, env, view, sim.client_state(v), ctx,
                            finetune_epochs=run_cfg.eval.finetune_epochs,
                        )  # fmt: skip
                        hows["personal"] = "the model evaluation scores"
                    if "upload" in use_targets and mia:
                        why = None
                        if not exchanges:
                            why = f"client {v} uploaded nothing in round {rnd} (failed or diverged)"
                        elif not releases_model(type(algo)):
                            why = (
                                "its upload carries statistics, not a model"
                                if statistic_sharer(type(algo))
                                else "it releases no model parameters"
                            )
                        else:
                            weights, how = upload_model(
                                algo, env, exchanges, _fitter(sim, population, v, fit_epochs, s)
                            )
                            if weights is None:
                                why = how["why"]
                            else:
                                m = env.model("mia-upload")
                                set_weights(m, weights)
                                models["upload"], hows["upload"] = m, describe_how(how)
                        if why is not None:
                            unavailable[(label, "upload")] = why
                    for target, model in models.items():
                        tl = example_losses(model, cx, cy, run_cfg.eval.batch_size)
                        with torch.no_grad():
                            pred = predict(model, cx, run_cfg.eval.batch_size).argmax(1)
                        correct = (pred == cy).double().cpu().numpy()
                        scores = {"loss": loss_scores(tl)}
                        if "calibrated" in mia:
                            scores["calibrated"] = calibrated_scores(tl, ref_by_seed[s][v])
                        for attack in mia:
                            sc = scores[attack]
                            key = (label, target, attack)
                            pooled.setdefault(key, ([], []))
                            pooled[key][0].append(sc[:n])
                            pooled[key][1].append(sc[n:])
                            records.append(
                                dict(
                                    algorithm=label, target=target, attack=attack, seed=s, victim=v
                                )
                                | attack_metrics(sc[:n], sc[n:])
                                | {
                                    "n": n,
                                    "member_acc": float(correct[:n].mean()),
                                    "nonmember_acc": float(correct[n:].mean()),
                                    "model": hows[target],
                                }
                            )
                    if "label" in chosen_attacks:
                        case = _label_case(algo, env, exchanges, data, population, v)
                        if case is not None:
                            label_cases.setdefault(label, []).append(case)
                        else:
                            unavailable[(label, "label")] = (
                                "it uploads nothing"
                                if algo.release == {}
                                else "its upload carries no statistic the label inference reads "
                                "(no prototypes, soft predictions or head bias)"
                            )
                    mins = (time.perf_counter() - t0) / 60
                    done = (
                        [
                            r
                            for r in records
                            if r["victim"] == v
                            and r["seed"] == s
                            and r["algorithm"] == label
                            and r["attack"] == mia[-1]
                        ]
                        if mia
                        else []
                    )
                    shown = ", ".join(f"{r['target']} AUC {r['auc']:.3f}" for r in done)
                    say(f"[{mins:.1f} min] {label} seed {s} victim {v}: {shown or 'attacked'}")

    rows = _rows(pooled, records, entries, use_targets, mia)
    label_rows = [
        {"algorithm": lab} | label_metrics(cases, k_classes) for lab, cases in label_cases.items()
    ]
    result = {
        "config": cfg.name,
        "dataset": cfg.data.dataset,
        "model": cfg.model.name,
        "round": rnd,
        "seeds": seeds,
        "attacks": chosen_attacks,
        "victims": {str(s): v for s, v in chosen.items()},
        "references": references if "calibrated" in mia else 0,
        "ref_epochs": epochs if "calibrated" in mia else None,
        "fit_epochs": fit_epochs,
        "rows": rows,
        "label_rows": label_rows,
        "unavailable": [
            {"algorithm": a, "target": t, "why": why} for (a, t), why in unavailable.items()
        ],
        "reference_models": references_used,
        "records": records,
    }
    if out is not None:
        make_folder(out, "output folder")
        try:
            (out / "membership.json").write_text(json.dumps(result, indent=2))
            (out / "membership.md").write_text(_markdown(result))
            _plot(pooled, rows, out / "membership.png")
        except OSError as err:
            raise PflkitError(
                f"cannot write the study into '{out}' ({err.strerror or err}): choose another --out"
            ) from None
    return result


def _fitter(sim: Simulation, population: Sequence[int], victim: int, epochs: int, seed: int):
    """``fit(model, params)`` for :func:`upload_model`: the client's recipe on the pooled
    training splits of every client but the victim, only ``params`` trained."""
    others = [c for c in population if c != victim]

    def fit(model: nn.Module, params: list[Tensor]) -> tuple[int, int]:
        x, y = _pooled(sim.data, others)
        _train_on(sim.envs[victim], model, x, y, epochs, (seed, victim, 0x4F18), params=params)
        return len(y), epochs

    return fit


def _label_case(
    algo: Algorithm,
    env: ClientEnv,
    exchanges,
    data: FederatedDataset,
    population: Sequence[int],
    victim: int,
) -> dict[str, Any] | None:
    """One victim's label inference: from the first exchange whose upload holds a statistic
    (prototypes, soft predictions), else from the released model's head bias."""
    k = data.num_classes
    inferred = None
    for _, up in exchanges:
        inferred = infer_labels(up, k)
        if inferred is not None:
            break
    if inferred is None and releases_model(type(algo)):
        model = env.model("mia-upload")
        for payload, up in reversed(exchanges):
            received = _leaves(payload)
            released = released_tensors(algo, up, set(model.state_dict()))
            if released:
                stat = bias_statistic(model, released, received)
                inferred = None if stat is None else infer_labels(stat, k)
                break
    if inferred is None:
        return None
    counts = torch.bincount(data.clients[victim].train_y.cpu(), minlength=k).double().numpy()
    others = [c for c in population if c != victim]
    per = (
        np.stack(
            [
                torch.bincount(data.clients[c].train_y.cpu(), minlength=k).double().numpy()
                for c in others
            ]
        )
        if others
        else np.zeros((1, k))
    )
    return {
        "inferred": inferred,
        "counts": counts,
        "prior": per.sum(0),
        "prior_held": (per > 0).mean(0),
    }


def _rows(pooled, records, entries, targets, mia) -> list[dict[str, Any]]:
    """Per (algorithm, target, attack): the pooled AUC and TPR at 1% FPR, the per-victim AUCs'
    mean and population std, member and non-member accuracy of the target."""
    rows = []
    for label, _, _ in entries:
        for target in targets:
            for attack in mia:
                key = (label, target, attack)
                if key not in pooled:
                    continue
                m, n = (np.concatenate(p) for p in pooled[key])
                per = [
                    r for r in records
                    if (r["algorithm"], r["target"], r["attack"]) == key
                ]  # fmt: skip
                aucs = [r["auc"] for r in per]
                weights = np.array([r["n"] for r in per], dtype=float)
                rows.append(
                    {"algorithm": label, "target": target, "attack": attack}
                    | attack_metrics(m, n)
                    | {
                        "auc_victims_mean": float(np.mean(aucs)),
                        "auc_victims_std": float(np.std(aucs)),
                        "members": int(len(m)),
                        "nonmembers": int(len(n)),
                        "member_acc": float(
                            np.average([r["member_acc"] for r in per], weights=weights)
                        ),
                        "nonmember_acc": float(
                            np.average([r["nonmember_acc"] for r in per], weights=weights)
                        ),
                        "victims": len(per),
                        "model": per[0]["model"],
                    }
                )
    return rows


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _markdown(r: dict) -> str:
    lines = [
        f"# Privacy: membership and label inference on {r['config']}",
        "",
        f"{r['dataset']}, model {r['model']}; attacked after round {r['round']}, seeds "
        f"{', '.join(map(str, r['seeds']))}; victims per seed: "
        + "; ".join(f"{s}: {v}" for s, v in r["victims"].items())
        + ". Members: each victim's training split; non-members: its local test split, "
        "balanced by subsampling. Scores pooled over victims and seeds (one threshold).",
        "",
    ]
    if r["rows"]:
        cal = (
            f" `calibrated`: Watson et al. 2022, {r['references']} reference model(s) per victim "
            f"trained for {r['ref_epochs']} epochs on other clients' data."
            if r["references"]
            else ""
        )
        lines += [
            "## Membership inference",
            "",
            f"`loss`: Yeom et al. 2018 (score = -loss).{cal} AUC 0.5 and TPR 0.01 at 1% FPR "
            "are guessing.",
            "",
            "| algorithm | target | attack | AUC | TPR @ 1% FPR | per-victim AUC | "
            "member acc | non-member acc | members | target model |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            lines.append(
                f"| {row['algorithm']} | {row['target']} | {row['attack']} | {row['auc']:.3f} | "
                f"{row['tpr_at_1fpr']:.3f} | {row['auc_victims_mean']:.3f} ± "
                f"{row['auc_victims_std']:.3f} | {row['member_acc']:.3f} | "
                f"{row['nonmember_acc']:.3f} | {row['members']} | {row['model']} |"
            )
    if r["label_rows"]:
        lines += [
            "",
            "## Label inference from the upload",
            "",
            "Which classes the victim holds and its label distribution, inferred from its "
            "upload; in brackets the guess from the other clients' labels alone (no upload). "
            "TV: total variation distance to the true label distribution (lower is better).",
            "",
            "| algorithm | source | held-class AUC | held-class acc | majority class acc | "
            "TV | victims |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in r["label_rows"]:
            lines.append(
                f"| {row['algorithm']} | {row['source']} | {_fmt(row['held_auc'])} "
                f"({_fmt(row['held_auc_prior'])}) | {row['held_acc']:.3f} "
                f"({row['held_acc_prior']:.3f}) | {row['top1_acc']:.3f} "
                f"({row['top1_acc_prior']:.3f}; chance {row['top1_chance']:.3f}) | "
                f"{_fmt(row['tv'])} ({row['tv_prior']:.3f}) | {row['n']} |"
            )
    if r["unavailable"]:
        lines += ["", "Not attacked:", ""]
        lines += [f"- {u['algorithm']} {u['target']}: {u['why']}" for u in r["unavailable"]]
    lines += [
        "",
        "Targets: " + "; ".join(f"`{k}` {v}" for k, v in TARGETS.items()) + ".",
        "Method: src/pflkit/analysis/membership.py (module docstring), docs/membership.md.",
    ]
    return "\n".join(lines) + "\n"


def _plot(pooled, rows, path: Path) -> None:
    """ROC curves (log-log), one panel per algorithm, one curve per (target, attack)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    cols = max(len(algos), 1)
    fig = Figure(figsize=(3.6 * cols, 3.4), dpi=90)
    FigureCanvasAgg(fig)
    styles = {"loss": "--", "calibrated": "-"}
    colors = {"upload": "C0", "personal": "C3"}
    for i, a in enumerate(algos):
        ax = fig.add_subplot(1, cols, i + 1)
        for row in rows:
            if row["algorithm"] != a:
                continue
            m, n = (np.concatenate(p) for p in pooled[(a, row["target"], row["attack"])])
            fpr, tpr = roc_curve(m, n)
            floor = 0.5 / max(len(n), 1)
            ax.plot(
                np.maximum(fpr, floor),
                np.maximum(tpr, floor),
                styles.get(row["attack"], "-"),
                color=colors.get(row["target"]),
                label=f"{row['target']} {row['attack']} (AUC {row['auc']:.2f})",
            )
        ax.plot([1e-3, 1], [1e-3, 1], ":", color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(1e-3, 1)
        ax.set_ylim(1e-3, 1)
        ax.set_xlabel("false positive rate")
        if i == 0:
            ax.set_ylabel("true positive rate")
        ax.set_title(a, fontsize=9)
        ax.legend(fontsize=6, loc="lower right")
    if not algos:
        ax = fig.add_subplot(1, 1, 1)
        ax.text(0.5, 0.5, "no membership attack run", ha="center", va="center")
        ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, format="png")


__all__ = [
    "ATTACKS",
    "TARGETS",
    "attack_metrics",
    "calibrated_scores",
    "example_losses",
    "infer_labels",
    "label_metrics",
    "loss_scores",
    "membership_study",
    "reference_plan",
    "roc_auc",
    "roc_curve",
    "tpr_at_fpr",
    "upload_model",
]
