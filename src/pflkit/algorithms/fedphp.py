"""FedPHP: Li et al., "FedPHP: Federated Personalization with Inherited Private Models",
ECML-PKDD 2021; the HPM half of MAP (specs/map.md §2.3, §2.5).

Shared: the whole model. Private: the inherited private model (HPM) and the selection count.

- Client k fine-tunes the downloaded global model for E epochs on (1 - lambda) CE + lambda
  L_kt from its HPM (MAP Eq. 13, KD Eq. 11 or MMD Eq. 12), uploads that model, and folds it
  into its HPM with the client-specific momentum of Eq. 10 (:mod:`pflkit.algorithms.hpm`).
- Server: parameter averaging of the uploaded models.
- The personalized model is the HPM (the authors' code and MAP's Alg. 1 return it); a client
  never selected has no HPM and is scored with the global model.

Deviations: a client's first selection trains on plain CE (there is no HPM to learn from).
Defaults: lambda = 0.01, KD, tau = 4, mu = 0.9 (MAP §3); sample-weighted averaging (the code).
"""

from __future__ import annotations

from pflkit.algorithms.base import Payload, State, Update, register
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.hpm import HPMParams, personalize
from pflkit.algorithms.training import get_weights, set_weights


@register
class FedPHP(FedAvg):
    name = "fedphp"
    description = "FedPHP (Li et al. 2021): fine-tune with KD/MMD from an inherited private model"

    class Params(FedAvg.Params, HPMParams):
        pass

    def client_update(self, cid: int, payload: Payload, state: State, rnd: int, phase: str):
        model = self.ctx.model(self.ctx.arch(cid))
        set_weights(model, payload["weights"])
        state, loss = personalize(self.ctx, model, cid, state, self.params)
        n = len(self.ctx.client(cid).train_y)
        return Update(
            {"weights": get_weights(model), "num_samples": n}, state, {"train_loss": loss}
        )

    def personal_weights(self, server: State, cid: int, state: State):
        return state.get("hpm")
