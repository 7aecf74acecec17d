"""FedAvg + local fine-tuning (FedAvg-FT): train FedAvg; to evaluate, each client fine-tunes
the current global model on its own training split and is scored with the fine-tuned model.

This is the "FedAvg-FT" / "finetune" personalization baseline of the MAP, GPFL and pFedSim
papers. Fine-tuning happens only at evaluation time and never feeds back into training, so the
training trajectory is exactly FedAvg's. Defaults: ``ft_epochs`` = 1 epoch at the training
learning rate (``ft_lr`` overrides it).

Deviations: MAP scores "the local model after E local epochs" of the selected clients only;
this scores every client after ``ft_epochs`` of fine-tuning from the same global model.
"""

from __future__ import annotations

from torch import nn

from pflkit.algorithms.base import (
    Payload,
    RoundContext,
    State,
    Upload,
    load_model,
    param,
    register,
    train_from,
)
from pflkit.algorithms.env import ClientEnv
from pflkit.algorithms.fedavg import FedAvg


@register
class FedAvgFT(FedAvg):
    name = "fedavg_ft"
    description = "FedAvg + local fine-tuning before evaluation (the FedAvg-FT baseline)"

    class Params(FedAvg.Params):
        ft_epochs: int = param(1, "pflkit (one epoch of fine-tuning)", gt=0)
        ft_lr: float | None = param(None, "pflkit (None: train.lr)", gt=0)

    params: Params

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        """The global model fine-tuned on the client's training split (under MAP's protocol
        too: FedAvg-FT's personalized model is always the fine-tuned global one)."""
        lr = self.params.ft_lr or env.run.train.lr
        weights, _ = train_from(env, view["weights"], ctx, epochs=self.params.ft_epochs, lr=lr)
        return load_model(env, weights)
