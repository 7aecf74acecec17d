"""FedPHP: Li et al., "FedPHP: Federated Personalization with Inherited Private Models",
ECML-PKDD 2021; the HPM half of MAP (specs/map.md §2.3, §2.5).

Shared: the whole model. Private: the inherited private model (HPM) and the selection count.

- Client k fine-tunes the downloaded global model for E epochs on (1 - lambda) CE + lambda
  L_kt from its HPM (MAP Eq. 13, KD Eq. 11 or MMD Eq. 12), uploads that model, and folds it
  into its HPM with the client-specific momentum of Eq. 10 (:mod:`pflkit.algorithms.blocks.hpm`).
- Server: parameter averaging of the uploaded models.
- The personalized model is the HPM (the authors' code and MAP's Alg. 1 return it); a client
  never selected has no HPM and is scored with the global model.

Deviations: a client's first selection trains on plain CE (there is no HPM to learn from).
Defaults: lambda = 0.01, KD, tau = 4, mu = 0.9 (MAP §3); sample-weighted averaging (the code).
"""

from __future__ import annotations

from pflkit.algorithms.base import Payload, State, Update, register
from pflkit.algorithms.blocks.hpm import HPMParams, personalize
from pflkit.algorithms.blocks.training import get_weights, set_weights
from pflkit.algorithms.env import ClientEnv
from pflkit.algorithms.fedavg import FedAvg


@register
class FedPHP(FedAvg):
    name = "fedphp"
    description = "FedPHP (Li et al. 2021): fine-tune with KD/MMD from an inherited private model"

    class Params(FedAvg.Params, HPMParams):
        pass

    def client_update(self, env: ClientEnv, payload: Payload, state: State, rnd: int, phase: str):
        model = env.model()
        set_weights(model, payload["weights"])
        state, loss = personalize(env, model, state, self.params)
        upload = {"weights": get_weights(model), "num_samples": env.num_train}
        return Update(upload, state, {"train_loss": loss})

    def personal_weights(self, env: ClientEnv, view: Payload, state: State):
        return state.get("hpm")
