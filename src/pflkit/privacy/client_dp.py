"""Client-level differential privacy of the uploads: DP-FedAvg (McMahan, Ramage, Talwar & Zhang,
"Learning Differentially Private Recurrent Language Models", ICLR 2018, Alg. 1 with the
fixed-denominator estimator), with adaptive clipping (Andrew, Thakkar, McMahan & Ramaswamy,
"Differentially Private Learning with Adaptive Clipping", NeurIPS 2021, Alg. 1) as an option.

What is protected is what the algorithm releases (``Algorithm.release``, its release map):
for each released upload key, the client's update ``Delta_k = upload[key] - payload[ref]`` (or
the uploaded statistic itself when ``ref`` is None). Per round, at the server, before the
algorithm's ``aggregate``:

1. clip: ``Delta_k <- Delta_k * min(1, C / ||Delta_k||)``, the norm taken over every released
   floating-point tensor of the upload together;
2. noise (``mode: central``, the paper's trusted server): ``S = sum_k Delta_k + N(0, (z C)^2 I)``
   and every received upload's released key becomes ``ref_k + S / m`` (m: the round's cohort
   size, fixed before anyone drops out), so the algorithm's aggregate, whatever it is, sees
   only the noised mean (post-processing); ``mode: local``: each upload becomes
   ``ref_k + Delta_k + N(0, (z C)^2 I)``, which the server may use one by one (pFedSim's
   similarity, FedAMP's attention);
3. ``num_samples`` becomes 1 in every upload: a sample-weighted mean would give a client with
   more data more than C / m of influence, so the DP aggregate weighs uploads equally
   (McMahan et al.'s w_k = 1).

Integer tensors (BatchNorm's step counter) are never released: each takes the payload's value
(or zero without a reference). With adaptive clipping (central mode only) the server also
counts the clipped-free clients, ``b = (sum_k 1[||Delta_k|| <= C] + N(0, sigma_b^2)) / m``, and
sets ``C <- C exp(-eta_C (b - gamma))`` for the next round; the update's noise multiplier is
``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. Thm. 1), so the two releases together
spend exactly what noise multiplier z alone would, and the accountant counts z.

The noise comes from a generator seeded by (seed, round, phase), so runs are deterministic and
a resumed run continues as the uninterrupted one (the adaptive C is checkpointed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pflkit.algorithms.base import Algorithm, Payload, Upload
from pflkit.config import ClientDPConfig, ExperimentConfig
from pflkit.errors import PflkitError
from pflkit.privacy import accountant

META = frozenset({"num_samples"})  # upload keys beside the released ones (public once set to 1)


def leaves(tree: Any, prefix: str = "") -> dict[str, Tensor]:
    """The tensors of a nested dict, by dotted path, in sorted order."""
    if isinstance(tree, Tensor):
        return {prefix: tree}
    if isinstance(tree, Mapping):
        out: dict[str, Tensor] = {}
        for k in sorted(tree):
            out.update(leaves(tree[k], f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {}


def rebuild(tree: Any, values: Mapping[str, Tensor], prefix: str = "") -> Any:
    """``tree`` with the tensors at the paths of ``values`` replaced."""
    if isinstance(tree, Tensor):
        return values.get(prefix, tree)
    if isinstance(tree, Mapping):
        return {
            k: rebuild(v, values, f"{prefix}.{k}" if prefix else str(k)) for k, v in tree.items()
        }
    return tree


def describe_release(cls: type[Algorithm]) -> list[str]:
    """What ``pflkit list --params`` says of an algorithm's release map, one line each."""
    if cls.release is None:
        return [
            "releases: not declared as a release map",
            f"client-level DP: refused, {cls.release_refusal}",
        ]
    parts = [
        f"{key} (an update of the download's {ref})" if ref else f"{key} (as it is)"
        for key, ref in cls.release.items()
    ]
    lines = [f"releases: {', '.join(parts) or 'nothing'}"]
    if cls.private:
        lines.append(f"keeps private (never uploaded): {', '.join(cls.private)}")
    if not cls.release:
        lines.append("client-level DP: nothing to protect")
    elif cls.uses_each_upload:
        lines.append(f"client-level DP: mode local only (it {cls.uses_each_upload})")
    else:
        lines.append("client-level DP: mode central or local")
    return lines


def cohort_rate(cfg: ExperimentConfig, num_training: int) -> tuple[int, float]:
    """The cohort size m of every round and the sampling rate q = m / N of the accountant."""
    frac = cfg.train.client_fraction
    if not isinstance(frac, int | float):
        raise PflkitError(
            f"privacy.client_dp needs one train.client_fraction, not the range {frac}: the "
            "accountant's sampling rate must be the same every round"
        )
    m = min(max(int(round(frac * num_training)), 1), num_training)
    return m, m / num_training


def build(cfg: ExperimentConfig, algo: Algorithm, num_training: int) -> ClientDP | None:
    """The run's mechanism (None without ``privacy.client_dp``)."""
    if cfg.privacy.client_dp is None:
        return None
    many = [r for r in range(1, cfg.train.rounds + 1) if len(algo.phases(r)) > 1]
    if many:
        raise PflkitError(
            f"algorithm '{algo.name}' exchanges {len(algo.phases(many[0]))} times in round "
            f"{many[0]}; privacy.client_dp accounts for one release a round"
        )
    return ClientDP(cfg, algo, num_training)


class ClientDP:
    """The mechanism of one run: :meth:`release` sanitizes a round's uploads, :meth:`epsilon`
    accounts for them. ``num_training``: the clients that train (N)."""

    def __init__(self, cfg: ExperimentConfig, algo: Algorithm, num_training: int):
        dp = cfg.privacy.client_dp
        assert dp is not None
        self.dp: ClientDPConfig = dp
        self.seed = cfg.seed
        self.check(algo, dp)
        self.cohort, self.rate = cohort_rate(cfg, num_training)
        self.delta = dp.target_delta if dp.target_delta is not None else 1.0 / num_training
        rounds = cfg.train.rounds
        if dp.noise_multiplier is not None:
            self.z = dp.noise_multiplier
        else:
            self.z = accountant.calibrate(
                dp.target_epsilon, self.rate, rounds, self.delta, dp.accountant
            )
        self.count_noise = dp.count_noise if dp.count_noise is not None else self.cohort / 20
        self.z_update = self.z
        if dp.adaptive:
            if self.z == 0 or 2 * self.count_noise <= self.z:
                raise PflkitError(
                    f"adaptive clipping needs 2 * count_noise > noise_multiplier (here "
                    f"2 * {self.count_noise:g} <= {self.z:g}): raise "
                    "privacy.client_dp.count_noise or the cohort size"
                )
            self.z_update = (self.z**-2 - (2 * self.count_noise) ** -2) ** -0.5
        self.clip = dp.clip  # the adaptive C changes; checkpointed with state()

    @staticmethod
    def check(algo: Algorithm, dp: ClientDPConfig) -> None:
        """Refuse an algorithm the mechanism cannot bound, in one sentence."""
        if algo.release is None:
            raise PflkitError(
                f"privacy.client_dp cannot bound algorithm '{algo.name}': {algo.release_refusal}"
            )
        if not algo.release:
            raise PflkitError(
                f"algorithm '{algo.name}' releases nothing (every client keeps its own model): "
                "privacy.client_dp has nothing to protect; remove it"
            )
        if dp.mode == "central" and algo.uses_each_upload:
            raise PflkitError(
                f"algorithm '{algo.name}' {algo.uses_each_upload}, but central client-level DP "
                "hands the server only the noised mean: set privacy.client_dp.mode: local"
            )
        if dp.mode == "local" and dp.adaptive:
            raise PflkitError(
                "adaptive clipping is defined for the central mechanism (Andrew et al.): set "
                "privacy.client_dp.mode: central or adaptive: false"
            )

    # -- accounting -------------------------------------------------------------------------------
    def epsilon(self, rounds: int) -> float:
        """Cumulative epsilon at the run's delta after ``rounds`` releases."""
        return accountant.epsilon(self.z, self.rate, rounds, self.delta, self.dp.accountant)

    def row(self, rnd: int) -> dict[str, float]:
        """The privacy fields of round ``rnd``'s metrics row."""
        return {
            "dp_epsilon": self.epsilon(rnd),
            "dp_delta": self.delta,
            "dp_noise_multiplier": self.z,
            "dp_clip": self.clip,
        }

    def state(self) -> dict[str, float]:
        return {"clip": self.clip}

    def load(self, state: Mapping[str, float] | None) -> None:
        if state:
            self.clip = float(state["clip"])

    # -- the mechanism ----------------------------------------------------------------------------
    def release(
        self,
        algo: Algorithm,
        uploads: Mapping[int, Upload],
        payloads: Mapping[int, Payload],
        rnd: int,
        phase: int,
    ) -> dict[int, Upload]:
        """The uploads the server may see: clipped, noised, equally weighted."""
        assert algo.release is not None
        gen = torch.Generator().manual_seed(hash_seed(self.seed, rnd, phase))
        C, sigma = self.clip, self.z_update * self.clip
        deltas: dict[int, dict[str, Tensor]] = {}
        refs: dict[int, dict[str, Tensor]] = {}
        unclipped = 0
        for cid, up in uploads.items():
            extra = set(up) - set(algo.release) - META
            if extra:
                raise PflkitError(
                    f"algorithm '{algo.name}' uploads {sorted(extra)} outside its release map "
                    f"{sorted(algo.release)}: declare them in its release map or stop uploading them"
                )
            d, r = self.update(algo, up, payloads[cid])
            norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in d.values()))
            unclipped += norm <= C
            scale = min(1.0, C / norm) if norm > 0 else 1.0
            deltas[cid] = {k: t * scale for k, t in d.items()}
            refs[cid] = r
        if not deltas:
            return {}
        first = next(iter(deltas.values()))
        if self.dp.mode == "central":
            total = {k: sum(d[k] for d in deltas.values()) for k in first}
            noised = {k: (t + noise(t, sigma, gen)) / self.cohort for k, t in total.items()}
            new = {cid: noised for cid in deltas}
            if self.dp.adaptive:
                b = (
                    unclipped + float(torch.randn((), generator=gen)) * self.count_noise
                ) / self.cohort
                self.clip = C * math.exp(-self.dp.clip_lr * (b - self.dp.target_quantile))
        else:
            new = {
                cid: {k: t + noise(t, sigma, gen) for k, t in d.items()}
                for cid, d in deltas.items()
            }
        return {cid: self.rebuilt(algo, uploads[cid], refs[cid], new[cid]) for cid in deltas}

    @staticmethod
    def update(algo: Algorithm, up: Upload, payload: Payload):
        """The released update's floating-point leaves and their references (zero for a
        statistic without one), by ``key.path``."""
        assert algo.release is not None
        d: dict[str, Tensor] = {}
        r: dict[str, Tensor] = {}
        for key, ref in algo.release.items():
            base = leaves(payload[ref]) if ref is not None else {}
            for path, t in leaves(up[key]).items():
                ref_t = base.get(path)
                if ref_t is None:
                    ref_t = torch.zeros_like(t)
                r[f"{key}/{path}"] = ref_t
                if t.is_floating_point():
                    d[f"{key}/{path}"] = t - ref_t.to(t)
        return d, r

    @staticmethod
    def rebuilt(
        algo: Algorithm, up: Upload, refs: dict[str, Tensor], new: dict[str, Tensor]
    ) -> Upload:
        """``up`` with each released leaf ``ref + new`` (integer leaves: ``ref``), weight 1."""
        assert algo.release is not None
        out = dict(up)
        for key in algo.release:
            values = {}
            for path, t in leaves(up[key]).items():
                name = f"{key}/{path}"
                ref = refs[name].to(t)
                values[path] = ref + new[name].to(t) if name in new else ref.clone()
            out[key] = rebuild(up[key], values)
        if "num_samples" in out:
            out["num_samples"] = 1
        return out


def noise(like: Tensor, std: float, gen: torch.Generator) -> Tensor:
    """Gaussian noise of ``std`` shaped like ``like`` (drawn on the CPU from ``gen``)."""
    if std == 0:
        return torch.zeros_like(like)
    return (torch.randn(like.shape, generator=gen, dtype=torch.float64) * std).to(like)


def hash_seed(seed: int, rnd: int, phase: int) -> int:
    """One 63-bit seed per (seed, round, phase) for the mechanism's noise."""
    return int(
        np.random.SeedSequence([seed, rnd, phase, 0xD9]).generate_state(1, np.uint64)[0] >> 1
    )
