"""MAP: Li et al., "MAP: Model Aggregation and Personalization in Federated Learning with
Incomplete Classes", IEEE TKDE 2024 (specs/map.md §2.4, Algorithm 1).

Shared: the stage-A model. Private: the inherited private model (HPM), the selection count,
the client's class counts.

Two-stage local training of each selected client k, starting from the global model psi_t:

- Stage A (aggregation): SGD on the restricted-softmax loss (Eq. 8, :mod:`.rs`); the result
  psi_hat_a is uploaded and averaged by the server (Alg. 1 line 13: uniform mean by default).
- Stage B (personalization), continuing from psi_hat_a: SGD on (1 - lambda) CE + lambda L_kt
  from the HPM (Eq. 13, KD Eq. 11 or MMD Eq. 12, :mod:`.hpm`); the result is folded into the
  HPM with the client-specific momentum (Eq. 10). Never uploaded.
- The personalized model is the HPM (Alg. 1's return value; the authors' code scores it too).

Stage lengths: the paper splits the E local epochs in half (E/2 + E/2, counted in SGD steps,
stage B at the same lr). The authors' code runs stage A for all E epochs and stage B for
max(floor(0.1 * steps_A), 5) steps at 0.2 x lr: ``stage_b_fraction: 0.1, stage_b_lr_scale: 0.2``.
Other authors'-code behaviours as named options: ``weighting: samples`` (sample-count
averaging), ``hpm_bn_recompute: true`` (HPM BatchNorm statistics recomputed on local data),
``mu_schedule: code``, ``kd_form: code``, ``rs_mode: soft``.

ScaMAP (the authors' "MAP combined with Scaffold", details from their code, §2.5): stage A is
SCAFFOLD's corrected local steps (option II controls, :mod:`.scaffold`) on the RS loss; the
client uploads Delta y and Delta c, the server applies SCAFFOLD's update; stage B and the HPM
are MAP's. The paper defines ScaMAP only as "MAP combined with Scaffold", so three defaults
are the authors' code's: stage A all E epochs, stage B 20% of its steps at 0.5 x lr, and the
server control update without the |S|/N factor (``control_scale: code``; SCAFFOLD itself keeps
the SCAFFOLD paper's formula). Two are not: the server step ``eta_g`` = 1 is the SCAFFOLD
paper's (the code's grid is {0.5, 0.9, 0.5}), and stage A keeps the config's weight decay
(``local_weight_decay: true``, the paper's setting for every method; the code's SCAFFOLD
optimiser has none).
``stage_b_fraction: null`` gives MAP's E/2 + E/2 split, which on Fashion-MNIST produced loss
spikes and divergence unless ``train.grad_clip: 100`` (the code's clipping) was set; stage B
never reaches the global model, so the cause is SCAFFOLD's stage A with half the steps
(docs/map.md).

Deviations: a client's first selection has no HPM, so its stage B trains on plain CE and the
HPM starts as the result (§8.4). The code's gradient clipping at norm 100
(not in the paper) is ``train.grad_clip: 100``; its 5-round lr warm-up is not reproduced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from torch import nn

from pflkit.algorithms.base import (
    Payload,
    RoundContext,
    ServerContext,
    State,
    Update,
    Upload,
    Weighting,
    load_model,
    param,
    register,
)
from pflkit.algorithms.blocks.hpm import HPMParams, HPMState, personalize
from pflkit.algorithms.blocks.rs import RestrictedSoftmax, RSParams
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.fedavg import FedAvg
from pflkit.algorithms.records import WeightsPayload
from pflkit.algorithms.scaffold import (
    ControlScale,
    ControlState,
    ScaffoldPayload,
    ScaffoldServer,
    ScaffoldServerParams,
    ScaffoldUpload,
    scaffold_aggregate,
    scaffold_client_step,
    scaffold_payload,
    scaffold_server_init,
)
from pflkit.primitives.training import get_weights, set_weights, steps_per_epoch


class ScaMAPState(HPMState, ControlState):
    """MAP's state and SCAFFOLD's control variate c_i."""


class MAPParams(FedAvg.Params, RSParams, HPMParams):
    weighting: Weighting = param("uniform", "paper (Alg. 1: mean over S_t)")
    stage_b_fraction: float | None = param(
        None, "paper (None: E/2 + E/2); 0.1: authors' code", gt=0
    )
    stage_b_lr_scale: float = param(1.0, "paper (same lr); 0.2: authors' code", gt=0)


@register
class MAP(RestrictedSoftmax, FedAvg):
    name = "map"
    description = "MAP (Li et al. 2024): restricted-softmax stage A uploaded + HPM stage B kept"

    Params = MAPParams
    params: MAPParams
    state: ClassVar[object] = HPMState

    def stage_steps(self, env: ClientEnv, ctx: RoundContext) -> tuple[int, int]:
        t = env.run.train
        total = t.local_epochs * steps_per_epoch(env.num_train, t.batch_size, ctx.drop_last)
        if self.params.stage_b_fraction is None:
            return total - total // 2, total // 2
        return total, max(int(self.params.stage_b_fraction * total), 5)

    def stage_a(
        self,
        env: ClientEnv,
        model: nn.Module,
        payload: WeightsPayload,
        state: HPMState,
        ctx: RoundContext,
        steps: int,
    ) -> tuple[Mapping[str, object], HPMState, float]:
        """Train ``model`` (holding the download) for stage A; return (upload, state, loss)."""
        loss = env.train(model, ctx, loss_fn=self.local_objective(env, payload), steps=steps)
        return {"weights": get_weights(model), "num_samples": env.num_train}, state, loss

    def client_update(
        self, env: ClientEnv, payload: WeightsPayload, state: HPMState, ctx: RoundContext
    ) -> Update:
        model = env.model()
        set_weights(model, payload["weights"])
        steps_a, steps_b = self.stage_steps(env, ctx)
        upload, state, loss_a = self.stage_a(env, model, payload, state, ctx, steps_a)
        lr_b = env.run.train.lr * self.params.stage_b_lr_scale
        hpm_state, loss_b = personalize(env, model, state, self.params, ctx, steps=steps_b, lr=lr_b)
        metrics = {"train_loss": loss_a, "train_loss_b": loss_b}
        return Update(upload, {**state, **hpm_state}, metrics)

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: State,
        ctx: RoundContext,
        upload: Upload | None = None,
    ) -> nn.Module:
        """The HPM; before the client first trains, the global (or uploaded) model."""
        if state.get("hpm") is None:
            return super().personal_model(env, view, state, ctx, upload)
        return load_model(env, state["hpm"])


@register
class ScaMAP(MAP):
    name = "scamap"
    release = {"delta_y": None, "delta_c": None}  # SCAFFOLD's stage A upload
    secagg = ("uniform",)  # its aggregate needs the plain sum, the mean only when uniform
    description = "ScaMAP (Li et al. 2024): MAP whose stage A is SCAFFOLD on the RS loss"
    payload = ScaffoldPayload
    upload = ScaffoldUpload
    state = ScaMAPState
    server = ScaffoldServer

    class Params(MAPParams, ScaffoldServerParams):
        # the authors' code (ScaMAP is defined only there): stage A all E epochs, stage B 20%
        # of its steps at 0.5 x lr. MAP's E/2 + E/2 split (stage_b_fraction: null) is unstable
        # here without gradient clipping (docs/map.md, "ScaMAP")
        stage_b_fraction: float | None = param(0.2, "authors' code", gt=0)
        stage_b_lr_scale: float = param(0.5, "authors' code", gt=0)
        control_scale: ControlScale = param("code", "authors' code (no |S|/N factor)")

    params: Params

    # SCAFFOLD's server side, called as SCAFFOLD's functions: (x, c) state and download, the
    # option-II server update
    def server_init(self, env: ServerEnv) -> ScaffoldServer:
        return scaffold_server_init(env)

    def configure(self, env: ServerEnv, server: State, cid: int, ctx: ServerContext) -> Payload:
        return scaffold_payload(server)

    def aggregate(  # type: ignore[override]  # SCAFFOLD's upload record, not FedAvg's
        self,
        env: ServerEnv,
        server: State,
        uploads: Mapping[int, ScaffoldUpload],
        ctx: ServerContext,
    ) -> State:
        return scaffold_aggregate(env, server, uploads, self.params, self.params.weighting)

    def stage_a(  # type: ignore[override]  # SCAFFOLD's payload and state
        self,
        env: ClientEnv,
        model: nn.Module,
        payload: ScaffoldPayload,
        state: ScaMAPState,
        ctx: RoundContext,
        steps: int,
    ) -> tuple[Mapping[str, object], ScaMAPState, float]:
        # SCAFFOLD's corrected steps train ``env.model()`` (= ``model``), which keeps y for
        # stage B
        step, upload = scaffold_client_step(
            env,
            payload,
            state,
            ctx,
            self.local_objective(env, payload),
            local_weight_decay=self.params.local_weight_decay,
            steps=steps,
        )
        return upload, {**state, "control": step.control}, step.loss
