"""FedPer: Arivazhagan, Aggarwal, Singh & Choudhary, "Federated Learning with Personalization
Layers", arXiv:1912.00818, 2019 (Sec. 3, Algorithm 1).

Shared: the base layers W_B (the model's ``body``). Private: the personalization layers W_P
(the model's ``head``), which never leave the client.

- Client j receives W_B, loads it under its own W_P_j and runs E epochs of mini-batch SGD on
  both together (the paper's "W_B, W_P_j <- SGD(...)", one joint objective: cross-entropy).
- Server: W_B <- sum_j (n_j / n) W_B_j over the participants (Alg. 1: weighted by local data).
- Personalized model: the latest aggregated W_B with the client's own W_P_j; under MAP's
  protocol (``eval.selected_clients``), the client's model right after local training: its
  trained W_B_j with its W_P_j.

The shared-body / private-head plumbing is
:class:`~pflkit.algorithms.blocks.split.SplitBody`, which FedRep reuses.
``private_layers`` moves named layers of the body to the private side: ``[fc1]`` with
``fedproto_cnn`` shares only the two conv layers, as FedProto's code sets up FedPer (every key
not starting with ``fc`` averaged), whose FedPer and FedRep numbers pFedPM's Table I copies.

Deviations: the paper does not say how W_P starts; here every head starts from the same
initial model as the body (:func:`~pflkit.algorithms.blocks.split.common_init`, as the
PFLlib/GPFL code that runs this baseline). BatchNorm statistics in the body are averaged like
parameters. There is no global model: ``global_acc`` is not reported.
"""

from __future__ import annotations

from pflkit.algorithms.base import RoundContext, register
from pflkit.algorithms.blocks.split import SplitBody
from pflkit.algorithms.env import ClientEnv
from pflkit.models import PFLModel


@register
class FedPer(SplitBody):
    name = "fedper"
    sample_dp_covered = True  # DP-SGD covers it (pflkit.privacy.dpsgd)
    vectorize = True  # engine.vectorize covers its local work
    description = "FedPer (Arivazhagan et al. 2019): shared body, private head, trained jointly"

    def local_train(self, env: ClientEnv, model: PFLModel, ctx: RoundContext) -> float:
        return env.train(model, ctx)
