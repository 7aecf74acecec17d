"""Gradient-inversion privacy evaluation: a semi-honest server runs DLG on a victim's update
(GPFL paper, Sec. 3.3 and 4.7, Table 5).

**Attack.** Deep Leakage from Gradients (Zhu, Liu & Han, "Deep Leakage from Gradients",
NeurIPS 2019), in the form of the GPFL paper's Eq. 12: a dummy input x~ and a dummy output z~
are optimised to minimise ||grad_theta l(Phi(x~), z~) - Delta||^2, where Phi is the attacked
module with parameters theta, Delta the victim's observed update of theta, and l the **MSE**
between Phi's output and z~ (Eq. 12 uses MSE; with a free z~, the MSE gradient at Phi's output,
(2 / numel) (Phi(x~) - z~), can take any value, so the dummy loss can imitate whatever loss the
victim trained with). Choices, as in PFLlib's ``system/utils/dlg.py`` unless said otherwise:

- the dummy input is ``sigmoid(u)`` (pixels in [0, 1], mapped to the dataset's normalisation
  before Phi), u and z~ start as N(0, 1) draws (seeded by (seed, victim, batch), so every
  algorithm and target of a seed starts from the same dummy image);
- optimiser: ``torch.optim.LBFGS`` with PyTorch's defaults (lr 1, at most 20 function
  evaluations per step), ``iterations`` steps (PFLlib: 100); Phi in eval mode;
- the reconstruction is the iterate with the lowest matching loss seen (a diverging L-BFGS
  step, NaN included, cannot spoil it; PFLlib keeps the last iterate and drops NaN results);
- the gradient of a batch does not depend on the order of its samples, so reconstructions are
  matched to the originals by the assignment of least total squared error (PFLlib compares in
  order) before scoring.

**What Delta is.** The victim's update for **one batch**: in round ``round`` the victim
receives its payload (``configure``), runs its own algorithm's ``client_update`` on that one
batch for one local step of plain SGD at ``train.lr`` (no momentum, weight decay, clipping or
augmentation), and Delta = (received - uploaded) / lr over every tensor that is both received
and uploaded and is not a buffer. For an algorithm that takes one plain gradient step, Delta
is exactly the gradient of its local objective on that batch at the received weights, which
is the setting of Zhu et al. (one gradient, one batch) and of Eq. 12. PFLlib instead attacks
the whole round's update (global minus uploaded weights, after a full local epoch, not divided
by lr) with the batch's images: that update is not the gradient of the attacked batch at any
point, so its PSNR mixes leakage with that mismatch. Algorithms that take more than one step
on a batch (FedRep's head epochs run first; the body step that Delta records comes after them)
still give Delta = one body step / lr. Statistics an algorithm reads from the client's data
inside ``client_update`` (FedRoD's class counts) are those of the attacked batch; state from
``client_init`` (GPFL's label proportions alpha_i) is the client's own. In a round of several
exchanges (``phases``), the first is attacked.

**Targets (Table 5).** What the server sees is what the algorithm uploads, so the targets are
derived from the upload's keys (a target whose parameters are not all uploaded is unavailable):

- ``full``: the whole model, Phi(x) = logits; needs every ``body.*`` and ``head.*`` parameter
  (FedAvg, FedRoD's generic model);
- ``fe``: the feature extractor, Phi(x) = body(x); needs every ``body.*`` parameter;
- ``sfe``: GPFL's pseudo feature extractor CoV(phi(x), g) on the global route (Sec. 3.3), g =
  the mean of the received GCE table (Eq. 5); needs the body, ``cov.*`` and ``gce.table``;
- ``sm``: GPFL's pseudo model, logit_u = cos(CoV(phi(x), g), c_u) with the uploaded GCE rows
  c_u (Eq. 13); Delta also covers the table.

The attacker matches Delta on exactly the target's parameters. GPFL's regulariser on CoV and
GCE (Eq. 11) does not depend on the data and the server knows mu and the received values, so
its gradient at the received values is subtracted from Delta before the attack (without that,
sfe and sm would carry an offset no dummy input can explain).

**Score.** PSNR with peak 1 (as PFLlib): 10 log10(1 / MSE) over all pixels of the attacked
batch, images in [0, 1] (PFLlib divides the MSE by 3, a leftover for RGB that adds 4.77 dB; not
here); 100 dB for an exact reconstruction. A victim's PSNR is the mean over its batches; a row
of the table is the mean and population std over (victim, seed) pairs. Lower is more private.
The table also gives the PSNR of the dummy's random start (no attack at all) as the floor.

**Deviations from the paper.** Table 5 is Cifar100 and states neither the round, the batch nor
the attack's settings (specs/gpfl.md §8.14); they are options here. ``round`` R trains rounds
1..R-1 with the engine as a run would (in this process), then attacks round R. Victims must take
part in round R. The GPFL-specific targets are not in any public code.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pflkit.algorithms.base import Algorithm, RoundContext, ServerContext
from pflkit.algorithms.gpfl import GPFL, TABLE, cov_apply, cov_params, reg_norms
from pflkit.config import ExperimentConfig
from pflkit.data.federated import FederatedDataset, build_federated
from pflkit.data.sources import load_source
from pflkit.engine.clients import InProcess, key_generator, seed_torch, system_draw
from pflkit.engine.compare import plan_entries, run_config
from pflkit.engine.folder import check_out, make_folder
from pflkit.engine.simulation import Simulation, sample_clients
from pflkit.errors import PflkitError
from pflkit.primitives.training import set_weights

ATTACKS = ("dlg",)
TARGETS = {
    "full": "the whole model (logits)",
    "fe": "the feature extractor (body)",
    "sfe": "GPFL's pseudo feature extractor CoV(phi(x), g)",
    "sm": "GPFL's pseudo model cos(CoV(phi(x), g), c_u) (Eq. 13)",
}
#: Table 5 of the GPFL paper (Cifar100, label skew), PSNR in dB
PAPER = {
    ("fedper", "fe"): 7.94,
    ("fedrep", "fe"): 7.73,
    ("fedavg", "fe"): 6.92,
    ("fedavg", "full"): 7.30,
    ("fedrod", "fe"): 6.82,
    ("fedrod", "full"): 7.48,
    ("gpfl", "fe"): 6.56,
    ("gpfl", "sfe"): 6.41,
    ("gpfl", "sm"): 6.71,
}
OUTPUTS = ("privacy.json", "privacy.md", "privacy.png")
MAX_PSNR = 100.0


# -- the attack and its score (tested on tiny arrays and a linear model) --------------------------


def psnr(original: Tensor, reconstruction: Tensor) -> float:
    """10 log10(1 / MSE) for images in [0, 1] (peak 1), over all their entries; 100 when equal."""
    mse = float(((original.double() - reconstruction.double()) ** 2).mean())
    return MAX_PSNR if mse == 0 else min(MAX_PSNR, 10 * math.log10(1 / mse))


def match_order(original: Tensor, reconstruction: Tensor) -> Tensor:
    """``reconstruction`` reordered along the batch so that sample i is the one closest to
    original i (least total squared error: the gradient does not see the batch order)."""
    if len(original) < 2:
        return reconstruction
    from scipy.optimize import linear_sum_assignment

    cost = torch.cdist(original.flatten(1).double(), reconstruction.flatten(1).double()) ** 2
    _, cols = linear_sum_assignment(cost.cpu().numpy())
    return reconstruction[torch.as_tensor(cols, device=reconstruction.device)]


def dlg(
    forward: Callable[[Tensor], Tensor],
    params: Sequence[Tensor],
    delta: Sequence[Tensor],
    x_shape: Sequence[int],
    out_shape: Sequence[int],
    *,
    iterations: int,
    gen: torch.Generator,
    to_input: Callable[[Tensor], Tensor] = lambda p: p,
) -> tuple[Tensor, float]:
    """Deep Leakage from Gradients with MSE on a dummy output (GPFL Eq. 12): find pixels
    x~ = sigmoid(u) in [0, 1] and z~ so that grad_params MSE(forward(to_input(x~)), z~)
    matches ``delta``; return (x~ of the best iterate, its matching loss).
    ``params``: the leaf tensors (requires_grad) that ``forward`` uses and ``delta`` is of."""
    device = params[0].device
    u = torch.randn(*x_shape, generator=gen).to(device).requires_grad_()
    z = torch.randn(*out_shape, generator=gen).to(device).requires_grad_()
    opt = torch.optim.LBFGS([u, z])
    best = [math.inf, u.detach().clone()]

    def closure() -> Tensor:
        opt.zero_grad()
        loss = F.mse_loss(forward(to_input(torch.sigmoid(u))), z)
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        diff = sum(
            ((d if g is None else g - d) ** 2).sum() for g, d in zip(grads, delta, strict=True)
        )
        diff.backward()
        value = float(diff.detach())
        if math.isfinite(value) and value < best[0]:
            best[:] = [value, u.detach().clone()]
        return diff

    for _ in range(iterations):
        opt.step(closure)
        if not torch.isfinite(u).all():  # diverged: the best iterate is kept
            break
    return torch.sigmoid(best[1]), best[0]


# -- targets: derived from what the algorithm uploads --------------------------------------------


def target_keys(target: str, model, seen: set[str]) -> list[str] | None:
    """The parameters of ``target`` (their state-dict keys), or None when the server does not
    see them all: ``seen`` = the keys of the victim's upload that have an update."""
    body = [k for k, _ in model.named_parameters() if k.startswith("body.")]
    head = [k for k, _ in model.named_parameters() if k.startswith("head.")]
    cov = sorted(k for k in seen if k.startswith("cov."))
    keys = {
        "full": body + head,
        "fe": body,
        "sfe": body + cov,
        "sm": body + cov + [TABLE],
    }[target]
    if target in ("sfe", "sm") and (not cov or TABLE not in seen):
        return None
    return keys if keys and set(keys) <= seen else None


def available_targets(model, seen: set[str]) -> list[str]:
    """The targets whose parameters all lie in ``seen`` (in the order of :data:`TARGETS`)."""
    return [t for t in TARGETS if target_keys(t, model, seen) is not None]


def _attacked(target: str, model, received: dict[str, Tensor], keys: list[str]):
    """(forward, leaves): the module the attacker differentiates, and the leaf tensors in the
    order of ``keys``. The model holds the received weights; CoV and GCE are new leaves."""
    own = dict(model.named_parameters())
    leaves = {k: own[k] if k in own else received[k].clone().requires_grad_() for k in keys}
    if target == "full":
        return model, [leaves[k] for k in keys]
    if target == "fe":
        return model.features, [leaves[k] for k in keys]
    cov = {k: v for k, v in leaves.items() if k.startswith("cov.")}
    g = received[TABLE].mean(0)  # Eq. 5 from the received table, as the victim computed it

    def sfe(x: Tensor) -> Tensor:
        return cov_apply(model.features(x), *cov_params(cov, g))

    def sm(x: Tensor) -> Tensor:  # Eq. 13
        return F.normalize(sfe(x), dim=1) @ F.normalize(leaves[TABLE], dim=1).T

    return (sfe if target == "sfe" else sm), [leaves[k] for k in keys]


def known_gradient(algo: Algorithm, received: dict[str, Tensor]) -> dict[str, Tensor]:
    """The part of a one-step update that does not depend on the data and that the server can
    compute: GPFL's regulariser on CoV and GCE (Eq. 11 or the code's weight decay) at the
    received values. Empty for every other algorithm."""
    if not isinstance(algo, GPFL) or not algo.params.mu:
        return {}
    mu = algo.params.mu
    groups = [sorted(k for k in received if k.startswith("cov.")), [TABLE]]
    out: dict[str, Tensor] = {}
    for keys in groups:
        keys = [k for k in keys if k in received]
        if not keys:
            continue
        if algo.params.regulariser == "weight_decay":
            out.update({k: mu * received[k] for k in keys})
        else:
            norm = float(reg_norms([received[k] for k in keys]))
            if norm > 0:
                out.update({k: mu * received[k] / norm for k in keys})
    return out


# -- the victim's one-batch update ----------------------------------------------------------------


def _tensors(obj: Any) -> dict[str, Tensor]:
    """Every floating tensor of a payload or upload by its innermost key (the state-dict keys)."""
    out: dict[str, Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, Tensor):
                if v.is_floating_point():
                    out[k] = v
            else:
                out.update(_tensors(v))
    return out


def victim_update(
    sim: Simulation, cid: int, rnd: int, x: Tensor, y: Tensor
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(received, Delta) of client ``cid`` in round ``rnd`` of ``sim`` when its local work is
    one plain SGD step on the batch (x, y): Delta = (received - uploaded) / lr over the
    non-buffer tensors it both receives and uploads. The client's state is not changed."""
    cfg, algo = sim.cfg, sim.algo
    phase = algo.phases(rnd)[0]
    payload = algo.configure(sim.senv, sim.server, cid, ServerContext(rnd, phase, cfg.seed))
    env = sim.envs[cid]
    one_step = cfg.train.model_copy(
        update={
            "local_epochs": 1,
            "batch_size": len(y),
            "momentum": 0.0,
            "weight_decay": 0.0,
            "grad_clip": None,
            "augment": "none",
            "drop_last": False,
        }
    )
    benv = replace(
        env, data=replace(env.data, train_x=x, train_y=y), run=replace(env.run, train=one_step)
    )
    state = copy.deepcopy(sim.client_state(cid))
    seed_torch(cfg.seed, rnd, 0xD16, cid)
    update = algo.client_update(benv, payload, state, RoundContext(rnd, phase, cfg.seed))
    received, uploaded = _tensors(payload), _tensors(update.upload)
    buffers = {k for k, _ in env.model().named_buffers()}
    lr = cfg.train.lr
    delta = {
        k: (received[k] - v) / lr for k, v in uploaded.items() if k in received and k not in buffers
    }
    return received, delta


# -- the study ------------------------------------------------------------------------------------


def _pixels(cfg: ExperimentConfig, data: FederatedDataset) -> tuple[Tensor, Tensor]:
    """(mean, std) that map pixels in [0, 1] to the model's inputs, shaped [1, C, 1, 1]."""
    d = cfg.data
    src = load_source(d.dataset, d.root, download=d.download, **d.options)
    shape = data.input_shape
    if len(shape) != 3 or src.mean is None or src.std is None:
        raise PflkitError(
            f"the privacy study reconstructs images, but dataset '{d.dataset}' has inputs of "
            f"shape {list(shape)} without a pixel normalisation: use an image dataset "
            "(e.g. fashion_mnist)"
        )
    mean = torch.tensor(src.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(src.std, dtype=torch.float32).view(1, -1, 1, 1)
    return mean, std


def _victims(
    cfg: ExperimentConfig, data: FederatedDataset, rnd: int, seeds: list[int], victims
) -> dict[int, list[int]]:
    """Per seed, the attacked clients: ids (checked), or the first N that take part in round
    ``rnd`` (sampled, not dropped, with training data)."""
    n = data.num_clients
    out = {}
    for s in seeds:
        part = [
            c
            for c in sample_clients(s, rnd, n, cfg.train.client_fraction)
            if not system_draw(cfg.system, s, rnd, c)[0] and len(data.clients[c].train_y)
        ]
        if isinstance(victims, int):
            if victims < 1:
                raise PflkitError(f"--victims {victims} must be at least 1 (or a list of ids)")
            if victims > len(part):
                raise PflkitError(
                    f"--victims {victims} exceeds the {len(part)} clients with training data "
                    f"that upload in round {rnd} (seed {s}): give at most {len(part)}"
                )
            out[s] = part[:victims]
            continue
        for c in victims:
            if not 0 <= c < n:
                raise PflkitError(f"--victims {c} is not a client: give ids between 0 and {n - 1}")
            if c not in part:
                raise PflkitError(
                    f"--victims {c} does not upload in round {rnd} (seed {s}: not sampled, "
                    f"dropped or without training data): choose among {part[:10]}"
                )
        out[s] = list(dict.fromkeys(victims))
    return out


def _batches(x: Tensor, y: Tensor, seed: int, cid: int, batches: int, size: int):
    """The victim's attacked batches: the first ``batches`` chunks of ``size`` of a permutation
    seeded by (seed, client), the same for every algorithm of that seed."""
    perm = torch.randperm(len(y), generator=key_generator(seed, cid, 0xBA)).to(y.device)
    return [
        (x[perm[i : i + size]], y[perm[i : i + size]])
        for i in range(0, min(len(y), batches * size), size)
    ]


def check_study(cfg: ExperimentConfig, rnd: int, targets, known, **counts: int | None) -> None:
    """The checks every ``pflkit analyze privacy`` study makes of its options, one sentence
    each: the round within the config's, every count (``--name``; None: not given) at least
    1, every target one of ``known``."""
    if not 1 <= rnd <= cfg.train.rounds:
        raise PflkitError(
            f"--round {rnd} is outside the config's {cfg.train.rounds} rounds: choose --round "
            f"from 1 to {cfg.train.rounds} (or raise train.rounds with --set)"
        )
    for name, value in counts.items():
        if value is not None and value < 1:
            raise PflkitError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for t in targets or []:
        if t not in known:
            raise PflkitError(f"unknown --targets entry '{t}': choose from {', '.join(known)}")


def privacy_study(
    cfg: ExperimentConfig,
    out: Path,
    *,
    attack: str = "dlg",
    rnd: int = 1,
    victims: int | Sequence[int] = 4,
    iterations: int = 100,
    batches: int = 2,
    batch_size: int | None = None,
    seeds: Sequence[int] | None = None,
    targets: Sequence[str] | None = None,
    algorithms: Sequence[str | dict[str, Any]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the attack for every algorithm (default: the config's), seed (default: the
    config's), victim, batch and target (default: every target the algorithm's upload allows)
    and write ``privacy.json``, ``privacy.md`` and ``privacy.png`` into ``out``; returns the
    JSON dict. Every check runs before any training; ``out`` is written only at the end."""
    say = progress or (lambda line: None)
    if attack not in ATTACKS:
        raise PflkitError(
            f"unknown --attack '{attack}': use --attack dlg (Deep Leakage from Gradients, the "
            "one attack implemented)"
        )
    check_study(
        cfg, rnd, targets, TARGETS, iterations=iterations, batches=batches, batch_size=batch_size
    )
    out = Path(out)
    check_out(out, OUTPUTS)
    seeds = list(seeds) if seeds else [cfg.seed]
    entries = plan_entries(list(algorithms) if algorithms else [cfg.algorithm], cfg.train.weighting)
    data = build_federated(cfg.data)
    mean, std = _pixels(cfg, data)
    size = batch_size or cfg.train.batch_size
    chosen = _victims(cfg, data, rnd, seeds, victims if isinstance(victims, int) else list(victims))

    plans = [
        (label, algo_cfg, _targets(cfg, data, algo_cfg, seeds[0], chosen, targets))
        for label, algo_cfg, _ in entries
    ]
    per_victim = sum(
        math.ceil(min(len(data.clients[c].train_y), batches * size) / size)
        for v in chosen.values()
        for c in v
    )
    total = sum(len(u) for *_, u in plans) * per_victim
    say(
        f"DLG on {len(plans)} algorithm(s), {len(seeds)} seed(s), round {rnd}: {total} attacks "
        f"of {iterations} L-BFGS iterations on batches of {size}"
    )
    records: list[dict[str, Any]] = []
    shown: dict[str, Any] = {}  # images of the first (seed, victim, batch) for the figure
    starts: dict[tuple[int, int, int], float] = {}  # PSNR of the dummy's starting image
    t0 = time.perf_counter()
    for label, algo_cfg, use in plans:
        for s in seeds:
            with Simulation(run_config(cfg, algo_cfg, [], s), data=data, runner=InProcess()) as sim:
                for r in range(1, rnd):
                    say(f"{label} seed {s}: training round {r} of {rnd - 1} before the attack")
                    sim.run_round(r)
                for cid in chosen[s]:
                    c = sim.data.clients[cid]
                    for b, (x, y) in enumerate(
                        _batches(c.train_x, c.train_y, s, cid, batches, size)
                    ):
                        originals = (x.cpu() * std + mean).clamp(0, 1)
                        start = torch.sigmoid(
                            torch.randn(x.shape, generator=key_generator(s, cid, b, 0xD1))
                        )
                        starts[(s, cid, b)] = psnr(originals, match_order(originals, start))
                        found = attack_batch(
                            sim, cid, rnd, x, y, use, iterations, (s, cid, b), (mean, std)
                        )
                        for target, (rec, loss) in found.items():
                            rec = match_order(originals, rec)
                            value = psnr(originals, rec)
                            records.append(
                                dict(algorithm=label, target=target, seed=s, victim=cid, batch=b)
                                | {"psnr": value, "match_loss": loss}
                            )
                            if shown.setdefault("at", (s, cid, b)) == (s, cid, b):
                                shown.setdefault("original", originals)
                                shown[f"{label}-{target}"] = rec
                            mins = (time.perf_counter() - t0) / 60
                            say(
                                f"[{len(records)}/{total}, {mins:.1f} min] {label}-{target} "
                                f"seed {s} victim {cid} batch {b + 1}: PSNR {value:.2f} dB"
                            )
    rows = _rows(records, plans)
    result = {
        "config": cfg.name,
        "dataset": cfg.data.dataset,
        "model": cfg.model.name,
        "attack": attack,
        "round": rnd,
        "iterations": iterations,
        "batches": batches,
        "batch_size": size,
        "seeds": seeds,
        "victims": {str(s): v for s, v in chosen.items()},
        "rows": rows,
        # the reference: what the attack scores without any progress (its random start)
        "start_psnr": {
            "mean": float(np.mean([*starts.values()])),
            "std": float(np.std([*starts.values()])),
        },
        "records": records,
    }
    make_folder(out, "output folder")
    try:
        (out / "privacy.json").write_text(json.dumps(result, indent=2))
        (out / "privacy.md").write_text(_markdown(result))
        _grid(shown, plans, out / "privacy.png")
    except OSError as err:
        raise PflkitError(
            f"cannot write the study into '{out}' ({err.strerror or err}): choose another --out"
        ) from None
    return result


def _targets(cfg, data, algo_cfg, seed: int, chosen, targets) -> list[str]:
    """The targets to attack for one algorithm config: those its upload allows (one probe step
    of the first victim on one sample in round 1: only the keys matter), checked against
    ``targets``."""
    with Simulation(run_config(cfg, algo_cfg, [], seed), data=data, runner=InProcess()) as sim:
        cid = chosen[seed][0]
        c = data.clients[cid]
        _, delta = victim_update(sim, cid, 1, c.train_x[:1], c.train_y[:1])
        have = available_targets(sim.envs[cid].model(), set(delta))
    name = algo_cfg["name"]
    if not delta:
        raise PflkitError(
            f"algorithm '{name}' uploads no trainable tensor, so the server has no update "
            "to attack: choose an algorithm that shares model parameters (e.g. fedavg)"
        )
    if not have:
        raise PflkitError(
            f"algorithm '{name}' uploads no model parameters that the attack targets "
            f"({', '.join(TARGETS)}) cover: choose an algorithm that shares its body"
        )
    missing = [t for t in targets or [] if t not in have]
    if missing:
        raise PflkitError(
            f"--targets {missing[0]} needs parameters that algorithm '{name}' does not "
            f"upload: choose from {', '.join(have)} (or leave --targets out: every target "
            "each algorithm uploads)"
        )
    return list(targets or have)


def attack_batch(
    sim: Simulation,
    cid: int,
    rnd: int,
    x: Tensor,
    y: Tensor,
    targets: Sequence[str],
    iterations: int,
    key: tuple[int, ...],
    pixels: tuple[Tensor, Tensor],
) -> dict[str, tuple[Tensor, float]]:
    """DLG on client ``cid``'s one-batch update of round ``rnd`` for each target: {target:
    (reconstructed pixels on the CPU, matching loss)}. ``key`` seeds the dummy input (the
    same for every target), ``pixels`` = (mean, std) of the input normalisation."""
    received, delta = victim_update(sim, cid, rnd, x, y)
    delta = _minus(delta, known_gradient(sim.algo, received))
    model = sim.envs[cid].model("privacy")  # the server's copy, at the received weights
    state = model.state_dict()
    set_weights(model, {k: v for k, v in received.items() if k in state}, strict=False)
    model.eval()
    mean, std = (t.to(x.device) for t in pixels)
    found = {}
    for target in targets:
        keys = target_keys(target, model, set(delta))
        forward, leaves = _attacked(target, model, received, keys)
        with torch.no_grad():
            out_shape = forward(x).shape
        rec, loss = dlg(
            forward,
            leaves,
            [delta[k] for k in keys],
            x.shape,
            out_shape,
            iterations=iterations,
            gen=key_generator(*key, 0xD1),
            to_input=lambda p: (p - mean) / std,
        )
        found[target] = (rec.detach().cpu(), loss)
    return found


def _minus(delta: dict[str, Tensor], known: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v - known[k] if k in known else v for k, v in delta.items()}


def _rows(records: list[dict], plans) -> list[dict[str, Any]]:
    """Per (algorithm, target): mean and population std over (seed, victim) of the victim's
    mean PSNR over its batches."""
    rows = []
    for label, algo_cfg, use in plans:
        for t in use:
            per: dict[tuple[int, int], list[float]] = {}
            for r in records:
                if r["algorithm"] == label and r["target"] == t:
                    per.setdefault((r["seed"], r["victim"]), []).append(r["psnr"])
            values = [float(np.mean(v)) for v in per.values()]
            rows.append(
                {
                    "algorithm": label,
                    "target": t,
                    "psnr_mean": float(np.mean(values)),
                    "psnr_std": float(np.std(values)),
                    "n": len(values),
                    "paper": PAPER.get((algo_cfg["name"], t)),
                }
            )
    return rows


def _markdown(r: dict) -> str:
    lines = [
        f"# Privacy: DLG on {r['config']}",
        "",
        f"{r['dataset']}, model {r['model']}; DLG (Zhu et al. 2019, MSE on a dummy output: "
        f"GPFL Eq. 12) on each victim's one-batch update in round {r['round']}, "
        f"{r['iterations']} L-BFGS iterations, {r['batches']} batch(es) of {r['batch_size']} "
        f"per victim, seeds {', '.join(map(str, r['seeds']))}. PSNR (dB, peak 1; lower is "
        "more private): mean ± std over (victim, seed).",
        "",
        "| algorithm | target | PSNR (dB) | n | GPFL paper, Table 5 (Cifar100) |",
        "|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        paper = "" if row["paper"] is None else f"{row['paper']:.2f}"
        lines.append(
            f"| {row['algorithm']} | {row['target']} | {row['psnr_mean']:.2f} ± "
            f"{row['psnr_std']:.2f} | {row['n']} | {paper} |"
        )
    st = r["start_psnr"]
    lines += [
        "",
        f"Reference: the dummy's random start, sigmoid of N(0, 1) noise, scores {st['mean']:.2f} "
        f"± {st['std']:.2f} dB against the same batches (an attack near it recovered nothing).",
    ]
    lines += ["", "Targets: " + "; ".join(f"`{k}` {v}" for k, v in TARGETS.items()) + "."]
    return "\n".join(lines) + "\n"


def _grid(shown: dict, plans, path: Path) -> None:
    """Originals (top row) and each (algorithm, target)'s reconstructions of the same batch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [f"{label}-{t}" for label, _, use in plans for t in use if f"{label}-{t}" in shown]
    rows = [("original", shown["original"])] + [(n, shown[n]) for n in names]
    cols = min(len(shown["original"]), 10)
    fig = Figure(figsize=(0.8 * cols + 1.4, 0.8 * len(rows)), dpi=72)
    FigureCanvasAgg(fig)
    for i, (name, images) in enumerate(rows):
        for j in range(cols):
            ax = fig.add_subplot(len(rows), cols, i * cols + j + 1)
            img = images[j].permute(1, 2, 0).numpy()
            pixels = img[..., 0] if img.shape[-1] == 1 else img
            ax.imshow(pixels, cmap="gray", vmin=0, vmax=1, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    s, cid, b = shown["at"]
    fig.suptitle(f"DLG reconstructions: seed {s}, client {cid}, batch {b + 1}", fontsize=9)
    fig.savefig(path, format="png", bbox_inches="tight")
