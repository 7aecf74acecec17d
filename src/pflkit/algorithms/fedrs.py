"""FedRS: Li & Zhan, "FedRS: Federated Learning with Restricted Softmax for Label Distribution
Non-IID Data", KDD 2021; as used in MAP (specs/map.md §2.2, §2.5).

Shared: the whole model. Private: the client's class counts (used only locally).

- Client k runs FedAvg's local training with the restricted-softmax loss (MAP Eq. 8),
  CE(a^k * logits, y) with a^k_c = 1 for observed classes and alpha for missing ones
  (:mod:`pflkit.algorithms.blocks.rs`). ``rs_mode: soft`` is the FedRS code's
  a_c = alpha + (1 - alpha) n_c / max_j n_j; ``complete`` is MAP Table III's literal rule.
- Server: parameter averaging, unchanged.

Deviations: none in the math. Defaults: alpha = 0.9 (MAP's default), hard mode (the paper),
sample-weighted averaging (the FedRS code; ``weighting: uniform`` for MAP's Alg. 1).
"""

from __future__ import annotations

from pflkit.algorithms.base import register
from pflkit.algorithms.blocks.rs import RestrictedSoftmax, RSParams
from pflkit.algorithms.fedavg import FedAvg


@register
class FedRS(RestrictedSoftmax, FedAvg):
    name = "fedrs"
    description = "FedRS (Li & Zhan 2021): FedAvg with restricted softmax on missing classes"

    class Params(FedAvg.Params, RSParams):
        pass

    params: Params
