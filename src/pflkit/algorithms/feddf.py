"""FedDF: Lin, Kong, Stich, Jaggi, "Ensemble Distillation for Robust Model Fusion in Federated
Learning", NeurIPS 2020; and pFedDF, its personalised variant in KT-pFL's Table 1
(specs/ktpfl.md §5, §9).

**FedDF.** The server keeps one prototype model per architecture. Client ``n``
downloads its architecture's prototype, trains ``E`` epochs on its private data and uploads the
weights. The server averages the uploads of each architecture group (sample-weighted, FedAvg),
then distils the ensemble of *all* received client models into each averaged prototype on the
public set: teacher ``softmax(mean_m f_m(x) / T)`` (FedDF's averaged logits), student
initialised at the group average, ``distill_epochs`` epochs of SGD (``distill_lr``, default
``train.lr``). Each client is scored with its architecture's prototype (a global model, not
personalised). Deviations: FedDF distils with Adam (lr 1e-3) for up to 10^4 steps with early
stopping on a validation split and random crops; here the same SGD settings as the other
methods of Table 1 (R = 1 epoch over the public set, specs/ktpfl.md §4: "these apply to all
methods").

**pFedDF** (KT-pFL's personalised FedDF): FedDF's training; to evaluate, each client starts from
the last fused prototype of its architecture and fine-tunes it on its private data for
``ft_epochs`` (default: ``train.local_epochs``) at ``train.lr``. As FedAvg-FT, fine-tuning never
feeds back into training.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pflkit.algorithms.base import (
    Algorithm,
    Payload,
    State,
    Update,
    Upload,
    Weighting,
    param,
    register,
    train_from,
    weighted_average,
)
from pflkit.algorithms.blocks.distill import DistillParams, distill_configured, require_public
from pflkit.algorithms.blocks.training import get_weights, predict, set_weights
from pflkit.algorithms.env import ClientEnv, ServerEnv


@register
class FedDF(Algorithm):
    name = "feddf"
    description = (
        "FedDF (Lin et al. 2020): FedAvg within each architecture group, then server-side "
        "ensemble distillation of all client models into each prototype on a public set"
    )

    class Params(Algorithm.Params, DistillParams):
        weighting: Weighting = param(
            "samples", "paper (Alg. 1: n_k-weighted average within each group)"
        )

    def check(self, env: ServerEnv) -> None:
        require_public(env, self.name)

    def server_init(self, env: ServerEnv) -> State:
        return {"protos": {a: env.init_weights(a) for a in sorted(set(env.archs))}}

    def configure(self, env: ServerEnv, server: State, cid: int, rnd: int, phase: str):
        return {"weights": server["protos"][env.arch(cid)]}

    def client_update(self, env: ClientEnv, payload: Payload, state: State, rnd: int, phase: str):
        weights, loss = train_from(env, payload["weights"])
        upload = {"weights": weights, "num_samples": env.num_train}
        return Update(upload, state, {"train_loss": loss})

    def ensemble_teacher(self, env: ServerEnv, uploads: Mapping[int, Upload]) -> torch.Tensor:
        """``softmax(mean_m f_m(x_pub) / T)`` over every uploaded client model."""
        logits = None
        for cid, up in uploads.items():
            model = env.model(env.arch(cid), slot="feddf_teacher")
            set_weights(model, up["weights"])
            z = predict(model, env.public_x, 1000).double()
            logits = z if logits is None else logits + z
        assert logits is not None
        return torch.softmax(logits / len(uploads) / self.params.temperature, dim=1).float()

    def aggregate(self, env: ServerEnv, server: State, uploads: Mapping[int, Upload], rnd, phase):
        teacher = self.ensemble_teacher(env, uploads)
        protos = dict(server["protos"])
        for arch in sorted(set(env.archs)):
            group = {c: u for c, u in uploads.items() if env.arch(c) == arch}
            if not group:
                continue
            model = env.model(arch, slot="feddf_student")
            set_weights(model, weighted_average(group, uniform=self.params.weighting == "uniform"))
            distill_configured(env.run.train, self.params, model, env.public_x, teacher)
            protos[arch] = get_weights(model)
        return {**server, "protos": protos}

    def global_weights(self, env: ServerEnv, server: State):
        # a single global model exists only when every client shares the global architecture
        if set(env.archs) == {env.global_arch}:
            return server["protos"][env.global_arch]
        return None

    def eval_view(self, env: ServerEnv, server: State, cid: int) -> Payload:
        return {"proto": server["protos"][env.arch(cid)]}

    def personal_weights(self, env: ClientEnv, view: Payload, state: State):
        return view["proto"]  # its architecture's prototype


@register
class PFedDF(FedDF):
    name = "pfeddf"
    description = (
        "pFedDF (KT-pFL's personalised FedDF): FedDF, then each client fine-tunes its "
        "architecture's fused prototype on its private data before evaluation"
    )

    class Params(FedDF.Params):
        ft_epochs: int | None = param(None, "KT-pFL (None: train.local_epochs)", gt=0)

    def personal_weights(self, env: ClientEnv, view: Payload, state: State):
        epochs = self.params.ft_epochs or env.run.train.local_epochs
        weights, _ = train_from(env, view["proto"], epochs=epochs)
        return weights
