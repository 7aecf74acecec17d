"""Breaks of the FedAvg family (Local, FedAvg, FedAvg-FT, FedProx), SCAFFOLD / ScaRS and
Ditto / DittoRS: the averaging weights, the local objective and its proximal or control-variate
term, what is kept private, and which model is scored."""

from mutate import Break

A = "tests/algorithms/"
SD = f"{A}test_scaffold.py"
DI = f"{A}test_ditto.py"

LOCAL = (
    f"{A}test_local.py::test_local_client_step_trains_its_own_model_by_hand",
    f"{A}test_local.py::test_local_sends_nothing_and_keeps_private_models",
    f"{A}test_local.py::test_local_trains_its_own_state_and_sends_nothing_on_toy_clients",
)
FEDAVG = (
    f"{A}test_fedavg.py::test_fedavg_aggregate_is_sample_weighted_mean_of_client_models",
    f"{A}test_fedavg.py::test_fedavg_client_step_is_e_epochs_of_minibatch_sgd_by_hand",
    f"{A}test_fedavg.py::test_one_round_on_toy_clients_is_the_sample_weighted_mean_of_one_sgd_step_by_hand",
    "tests/test_engine.py::test_weighted_average_weights_by_samples",
)
FEDAVG_FT = (f"{A}test_fedavg_ft.py::test_fedavg_ft_scores_the_global_model_fine_tuned_by_hand",)
FEDPROX = (
    f"{A}test_fedprox.py::test_fedprox_loss_adds_exact_proximal_term",
    f"{A}test_fedprox.py::test_fedprox_client_step_by_hand",
    f"{A}test_fedprox.py::test_proximal_term_adds_mu_times_the_distance_to_the_global_model_on_a_toy_client",
)
SCAFFOLD = (
    f"{SD}::test_scaffold_client_step_matches_option_ii_on_a_quadratic",
    f"{SD}::test_scaffold_server_update",
    f"{SD}::test_scaffold_client_update_by_hand",
)
SCARS = (
    f"{SD}::test_scaffold_correction_moves_an_unused_row_by_exactly_k_lr_c_minus_ci",
    f"{SD}::test_scars_client_update_is_scaffold_on_the_rs_loss_by_hand",
)
DITTO = (
    f"{DI}::test_ditto_personal_loss_gradient_adds_lam_times_v_minus_w",
    f"{DI}::test_ditto_aggregate_is_uniform_mean_by_default",
    f"{DI}::test_ditto_client_update_by_hand",
)
DITTORS = (
    f"{DI}::test_dittors_global_branch_uses_rs_and_personal_branch_plain_ce",
    f"{DI}::test_dittors_client_update_by_hand",
)

BREAKS = [
    # -- Local -------------------------------------------------------------------------------------
    Break(
        "local",
        "Local uploads its model",
        "algorithms/local.py",
        'return Update({}, {"weights": weights}, {"train_loss": loss})',
        'return Update({"weights": weights, "num_samples": env.num_train}, {"weights": weights},'
        ' {"train_loss": loss})',
        LOCAL,
    ),
    Break(
        "local",
        "Local keeps the untrained model",
        "algorithms/local.py",
        'return Update({}, {"weights": weights}, {"train_loss": loss})',
        'return Update({}, {"weights": state["weights"]}, {"train_loss": loss})',
        LOCAL,
    ),
    Break(
        "local",
        "Local restarts from a fresh model every round",
        "algorithms/local.py",
        'weights, loss = train_from(env, state["weights"], ctx)',
        "weights, loss = train_from(env, env.init_weights(), ctx)",
        LOCAL,
    ),
    # -- FedAvg ------------------------------------------------------------------------------------
    Break(
        "fedavg",
        "uniform mean instead of n_k / n",
        "algorithms/fedavg.py",
        'uniform = self.params.weighting == "uniform"',
        "uniform = True",
        FEDAVG,
    ),
    Break(
        "fedavg",
        "weights not normalised by the total",
        "algorithms/base.py",
        "[wu / total for wu in w]",
        "[wu / len(ups) for wu in w]",
        FEDAVG,
    ),
    Break(
        "fedavg",
        "upload counts one sample",
        "algorithms/fedavg.py",
        'upload = {"weights": weights, "num_samples": env.num_train}',
        'upload = {"weights": weights, "num_samples": 1}',
        FEDAVG,
    ),
    Break(
        "fedavg",
        "client runs one epoch whatever E",
        "algorithms/fedavg.py",
        'weights, loss = train_from(env, payload["weights"], ctx, loss_fn=loss_fn)',
        'weights, loss = train_from(env, payload["weights"], ctx, loss_fn=loss_fn, epochs=1)',
        FEDAVG,
    ),
    # -- FedAvg-FT ---------------------------------------------------------------------------------
    Break(
        "fedavg_ft",
        "scores the global model before fine-tuning",
        "algorithms/fedavg_ft.py",
        "        return load_model(env, weights)",
        '        return load_model(env, view["weights"])',
        FEDAVG_FT,
    ),
    Break(
        "fedavg_ft",
        "ft_epochs ignored",
        "algorithms/fedavg_ft.py",
        "epochs=self.params.ft_epochs",
        "epochs=env.run.train.local_epochs",
        FEDAVG_FT,
    ),
    Break(
        "fedavg_ft",
        "ft_lr ignored",
        "algorithms/fedavg_ft.py",
        "lr = self.params.ft_lr or env.run.train.lr",
        "lr = env.run.train.lr",
        FEDAVG_FT,
    ),
    # -- FedProx -----------------------------------------------------------------------------------
    Break(
        "fedprox",
        "proximal term dropped",
        "primitives/training.py",
        "return cross_entropy(model, x, y) + 0.5 * mu * prox",
        "return cross_entropy(model, x, y)",
        FEDPROX,
    ),
    Break(
        "fedprox",
        "mu instead of mu / 2",
        "primitives/training.py",
        "return cross_entropy(model, x, y) + 0.5 * mu * prox",
        "return cross_entropy(model, x, y) + mu * prox",
        FEDPROX,
    ),
    Break(
        "fedprox",
        "proximal term with the wrong sign",
        "primitives/training.py",
        "(p - anchor[name]).pow(2).sum()",
        "(p + anchor[name]).pow(2).sum()",
        FEDPROX,
    ),
    Break(
        "fedprox",
        "client step ignores the local objective",
        "algorithms/fedavg.py",
        "loss_fn = self.local_objective(env, payload)",
        "loss_fn = cross_entropy",
        FEDPROX,
    ),
    # -- SCAFFOLD ----------------------------------------------------------------------------------
    Break(
        "scaffold",
        "correction c_i - c (wrong sign)",
        "algorithms/scaffold.py",
        "(c_global[k] - c_local[k]).detach()",
        "(c_local[k] - c_global[k]).detach()",
        SCAFFOLD,
    ),
    Break(
        "scaffold",
        "control update divides by lr, not K lr",
        "algorithms/scaffold.py",
        "-delta_y[k] / (k_steps * step_lr) - c_global[k]",
        "-delta_y[k] / step_lr - c_global[k]",
        SCAFFOLD,
    ),
    Break(
        "scaffold",
        "control update at the unscheduled lr",
        "algorithms/scaffold.py",
        "k_steps, step_lr = ctx.work_steps(steps), ctx.lr_factor * lr",
        "k_steps, step_lr = ctx.work_steps(steps), lr",
        SCAFFOLD,
    ),
    Break(
        "scaffold",
        "server step ignores eta_g",
        "algorithms/scaffold.py",
        "new_x[k] = v + (eta_g if k in c else 1.0) * dy[k]",
        "new_x[k] = v + dy[k]",
        SCAFFOLD,
    ),
    Break(
        "scaffold",
        "server control update without |S| / N",
        "algorithms/scaffold.py",
        'scale = len(uploads) / num_clients if control_scale == "paper" else 1.0',
        "scale = 1.0",
        SCAFFOLD,
    ),
    Break(
        "scaffold",
        "client keeps its old control variate",
        "algorithms/scaffold.py",
        'new_state = {**state, "control": step.control}',
        "new_state = dict(state)",
        SCAFFOLD,
    ),
    # -- ScaRS -------------------------------------------------------------------------------------
    Break(
        "scars",
        "mixin order: SCAFFOLD's CE wins over RS",
        "algorithms/scaffold.py",
        "class ScaRS(RestrictedSoftmax, Scaffold):",
        "class ScaRS(Scaffold, RestrictedSoftmax):",
        SCARS,
    ),
    Break(
        "scars",
        "local objective not passed to the corrected steps",
        "algorithms/scaffold.py",
        "            self.local_objective(env, payload),",
        "            cross_entropy,",
        SCARS,
    ),
    Break(
        "scars",
        "personal=local scores the global model",
        "algorithms/scaffold.py",
        'if self.params.personal == "local" and state.get("weights") is not None:',
        "if False:",
        SCARS,
    ),
    # -- Ditto -------------------------------------------------------------------------------------
    Break(
        "ditto",
        "personal model pulled to the client's trained w_k",
        "algorithms/ditto.py",
        "loss_fn=self.personal_loss(w_t),",
        'loss_fn=self.personal_loss(glob.upload["weights"]),',
        DITTO,
    ),
    Break(
        "ditto",
        "personal model restarts from w_t",
        "algorithms/ditto.py",
        'state.get("personal", w_t),',
        "w_t,",
        DITTO,
    ),
    Break(
        "ditto",
        "personal_epochs ignored",
        "algorithms/ditto.py",
        "epochs=p.personal_epochs or t.local_epochs,",
        "epochs=t.local_epochs,",
        DITTO,
    ),
    Break(
        "ditto",
        "personal_lr ignored",
        "algorithms/ditto.py",
        "lr=p.personal_lr or t.lr,",
        "lr=t.lr,",
        DITTO,
    ),
    Break(
        "ditto",
        "server averages by n_k by default",
        "algorithms/ditto.py",
        'weighting: Weighting = param("uniform", "paper (Alg. 1: server average)")',
        'weighting: Weighting = param("samples", "paper (Alg. 1: server average)")',
        DITTO,
    ),
    Break(
        "ditto",
        "scores the global model",
        "algorithms/ditto.py",
        '        return load_model(env, state["personal"])',
        "        return super().personal_model(env, view, state, ctx, upload)",
        DITTO,
    ),
    # -- DittoRS -----------------------------------------------------------------------------------
    Break(
        "dittors",
        "mixin order: global branch on plain CE",
        "algorithms/ditto.py",
        "class DittoRS(RestrictedSoftmax, Ditto):",
        "class DittoRS(Ditto, RestrictedSoftmax):",
        DITTORS,
    ),
    Break(
        "dittors",
        "default rs_mode soft",
        "algorithms/ditto.py",
        'rs_mode: RSMode = param("hard", "paper (MAP Eq. 8); soft: MAP code\'s DittoRS")',
        'rs_mode: RSMode = param("soft", "paper (MAP Eq. 8); soft: MAP code\'s DittoRS")',
        DITTORS,
    ),
    Break(
        "dittors",
        "personal branch on the RS loss",
        "algorithms/ditto.py",
        "loss_fn=self.personal_loss(w_t),",
        "loss_fn=lambda m, x, y: self.local_objective(env, payload)(m, x, y)"
        " + self.personal_loss(w_t)(m, x, y) - F.cross_entropy(m(x), y),",
        DITTORS,
    ),
]
