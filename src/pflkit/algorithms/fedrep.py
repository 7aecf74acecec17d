"""FedRep: Collins, Hassani, Mokhtari & Shakkottai, "Exploiting Shared Representations for
Personalized Federated Learning", ICML 2021 (Algorithm 1).

Shared: the representation phi (the model's ``body``). Private: the head h_i (the model's
``head``), which never leaves the client; ``private_layers`` (:mod:`~pflkit.algorithms.fedper`)
moves named body layers into h_i.

Client i, given the global phi^t (Algorithm 1, "Client update"):

1. Head update: ``head_epochs`` epochs of SGD on h_i with phi^t frozen,
   h_i <- GRD(f_i(h_i, phi^t), h_i, eta).
2. Representation update: ``body_epochs`` epochs of SGD on phi with the new h_i frozen,
   phi_i <- GRD(f_i(h_i, phi), phi, eta); phi_i is uploaded.

Server: phi^{t+1} = sum_i (n_i / n) phi_i over the participants (``weighting: uniform``: the
paper's plain mean 1/(rn) sum_i). Personalized model: the latest phi with the client's h_i.

Defaults: ``head_epochs`` = 10 (the paper's experiments train the head for many more local
epochs than the body; 10 is our reading of the FedRep authors' scripts, not re-checked here),
``body_epochs`` = ``train.local_epochs``. Both phases use the config's optimiser settings and
lr. The codes that ran FedRep as a baseline differ: PFLlib (GPFL's Table 1) trains
``-pls`` head epochs, default 1 (``main.py``, ``clientrep.py``), then ``local_epochs`` body
epochs; FL-bench (pFedSim's Table 3) trains E - 1 head epochs and 1 body epoch
(``src/client/fedrep.py``, ``train_body_epoch`` 1; pFedSim App. A.5: one epoch for the
feature extractor), i.e. ``head_epochs: 4, body_epochs: 1`` at E = 5.

Deviations: the paper's weighting is the plain mean; the default here is the sample-weighted
mean (the PFLlib/GPFL code that runs this baseline), ``weighting: uniform`` gives the paper's.
Heads start from the shared initial model (:mod:`~pflkit.algorithms.fedper`). "Frozen" means
not optimised and without gradient (``local_sgd`` turns ``requires_grad`` off, as the authors'
code does, so head epochs skip the body's backward); BatchNorm running statistics in the body
still move during head epochs, as in that code.
"""

from __future__ import annotations

from typing import Self

from pydantic import model_validator

from pflkit.algorithms.base import RoundContext, param, register
from pflkit.algorithms.blocks.split import SplitBody
from pflkit.algorithms.env import ClientEnv
from pflkit.models import PFLModel


@register
class FedRep(SplitBody):
    name = "fedrep"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    vectorize = True  # engine.vectorize covers its local work
    description = "FedRep (Collins et al. 2021): head epochs (body frozen), then body epochs"

    class Params(SplitBody.Params):
        head_epochs: int = param(
            10, "FedRep scripts as we read them, not re-checked; PFLlib -pls: 1", ge=0
        )
        body_epochs: int | None = param(
            None, "PFLlib clientrep.py (None: train.local_epochs); pFedSim A.5: 1", ge=0
        )

        @model_validator(mode="after")
        def _some_training(self) -> Self:
            if self.head_epochs == 0 and self.body_epochs == 0:
                raise ValueError("head_epochs and body_epochs cannot both be 0")
            return self

    params: Params

    def local_train(self, env: ClientEnv, model: PFLModel, ctx: RoundContext) -> float:
        p = self.params
        body_epochs = env.run.train.local_epochs if p.body_epochs is None else p.body_epochs
        losses = []
        params = dict(model.named_parameters())
        head = [params[k] for k in self.private_keys(model) if k in params]
        body = [params[k] for k in self.shared_keys(model) if k in params]
        if p.head_epochs:
            losses.append(env.train(model, ctx, epochs=p.head_epochs, params=head))
        if body_epochs:
            losses.append(env.train(model, ctx, epochs=body_epochs, params=body))
        return losses[-1]
