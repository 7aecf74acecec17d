"""FedProx: Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020.

Shared: the whole model. Private: nothing.

- Client k minimises h_k(w; w_t) = F_k(w) + (mu / 2) ||w - w_t||^2 (paper Eq. 2) with local
  SGD starting from w_t, where w_t is the downloaded global model.
- Server: sample-weighted averaging, as FedAvg.

Deviations: the paper lets stragglers do partial work (gamma-inexact solutions); every client
here does the configured full local epochs, which is how the MAP, GPFL and pFedSim papers run
FedProx. The proximal term covers all parameters (not buffers). Default mu = 0.01, our pick
from the paper's grid {0.001, 0.01, 0.1, 1} (PFLlib's ``-mu`` default is 0, which is FedAvg;
pFedSim App. A.5: mu = 1).
"""

from __future__ import annotations

from pflkit.algorithms.base import param, register
from pflkit.algorithms.env import ClientEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload
from pflkit.primitives.training import LossFn, proximal_loss


@register
class FedProx(FedAvg):
    name = "fedprox"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    vectorize = True  # engine.vectorize covers its local work
    description = "FedProx (Li et al. 2020): FedAvg with a proximal term mu/2 ||w - w_global||^2"

    class Params(FedAvg.Params):
        mu: float = param(0.01, "our pick from the paper's grid {0.001, 0.01, 0.1, 1}", ge=0)

    params: Params

    def local_objective(self, env: ClientEnv, payload: WeightsPayload) -> LossFn:
        return proximal_loss(payload["weights"], self.params.mu)
