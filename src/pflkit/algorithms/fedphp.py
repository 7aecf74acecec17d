"""FedPHP: Li et al., "FedPHP: Federated Personalization with Inherited Private Models",
ECML-PKDD 2021; the HPM half of MAP (specs/map.md §2.3, §2.5).

Shared: the whole model. Private: the inherited private model (HPM) and the selection count.

- Client k fine-tunes the downloaded global model for E epochs on (1 - lambda) CE + lambda
  L_kt from its HPM (MAP Eq. 13, KD Eq. 11 or MMD Eq. 12), uploads that model, and folds it
  into its HPM with the client-specific momentum of Eq. 10 (:mod:`pflkit.algorithms.blocks.hpm`).
- Server: parameter averaging of the uploaded models.
- The personalized model is the HPM (the authors' code and MAP's Alg. 1 return it); a client
  never selected has no HPM and is scored with the global model. ``personal="trained"`` scores
  the model right after the client's last local training instead (kept in its state), as
  PFLlib, which evaluates each client's just-trained model before aggregating
  (``serverphp.py`` lines 28-34); a client never selected is scored with the global model.

Deviations: a client's first selection trains on plain CE (there is no HPM to learn from;
``hpm_init: start`` distils from the download instead).
Defaults: lambda = 0.01, KD, tau = 4, mu = 0.9 (MAP §4.2.2, §5.2.5); sample-weighted averaging (the code).

PFLlib's FedPHP (``system/flcore/clients/clientphp.py``, ``servers/serverphp.py`` at d832e76)
is ``kt: mmd, mmd_form: pfllib, hpm_init: start, mu_schedule: code, personal: trained`` with
PFLlib's ``-lam`` and ``-mu``: its momentum (mu / T) * R, R the 0-based round, is
``mu_schedule: code`` when every client trains every round (z - 1 = R, int(Q T) = T; the
code's clip at 0.9 binds only for mu > 0.9). Not reproduced: PFLlib moves only the parameters
into its HPM (pflkit also averages floating-point buffers) and runs the HPM in train mode while
distilling (neither matters for a model without BatchNorm or dropout, such as ``cnn4``); under
partial participation it counts R in rounds rather than selections, starts a late client's HPM
from the initial model rather than the download, and scores an unselected client with the
round's download rather than its last trained model.
"""

from __future__ import annotations

from typing import Literal, NotRequired, cast

from torch import nn

from pflkit.algorithms.base import (
    Payload,
    RoundContext,
    State,
    Update,
    Upload,
    load_model,
    param,
    register,
)
from pflkit.algorithms.blocks.hpm import HPMParams, HPMState, personalize
from pflkit.algorithms.env import ClientEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload, WeightsUpload
from pflkit.primitives.training import Weights, get_weights, set_weights


class FedPHPState(HPMState):
    """The HPM, and the model trained this round (``personal: trained``)."""

    weights: NotRequired[Weights]


@register
class FedPHP(FedAvg):
    name = "fedphp"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    description = "FedPHP (Li et al. 2021): fine-tune with KD/MMD from an inherited private model"
    state = FedPHPState

    class Params(FedAvg.Params, HPMParams):
        personal: Literal["hpm", "trained"] = param(
            "hpm", "paper (the HPM); trained: PFLlib serverphp.py lines 28-34"
        )

    params: Params

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: FedPHPState, ctx: RoundContext
    ) -> Update:
        model = env.model()
        set_weights(model, payload["weights"])
        hpm, loss = personalize(env, model, state, self.params, ctx)
        upload: WeightsUpload = {"weights": get_weights(model), "num_samples": env.num_train}
        new = cast(FedPHPState, hpm)  # the HPM state; "weights" is optional
        if self.params.personal == "trained":
            new = {**hpm, "weights": upload["weights"]}
        return Update(upload, new, {"train_loss": loss})

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        personal = state.get("weights" if self.params.personal == "trained" else "hpm")
        if personal is None:
            return super().personal_model(env, view, state, ctx, upload)
        return load_model(env, personal)
