"""Breaks of MAP and its family (issue 10): the restricted softmax (FedRS), the HPM stage
(FedPHP), MAP's partition and evaluation protocol, ScaMAP's SCAFFOLD stage A."""

from mutate import Break

M = "tests/algorithms/test_map.py"
HPM = "tests/algorithms/blocks/test_hpm.py"
RS = "tests/algorithms/blocks/test_rs.py"
FRS = "tests/algorithms/test_fedrs.py"
P = "tests/algorithms/test_fedphp.py"
MAP = (
    f"{HPM}::test_eq13_weights_ce_by_one_minus_lambda_and_kt_by_lambda",
    f"{HPM}::test_kd_loss_averages_over_the_batch",
    f"{M}::test_incomplete_partition_balances_a_clients_classes_with_quantity_skew",
    f"{M}::test_selected_client_protocol_scores_the_hpm_of_the_selected_clients",
    f"{M}::test_map_stage_b_runs_at_the_scaled_learning_rate",
)
FEDRS = (
    f"{RS}::test_rs_scales_exactly_the_missing_classes_logits",
    f"{RS}::test_rs_soft_and_complete_modes",
    f"{RS}::test_rs_loss_by_value_for_a_fractional_alpha",
    f"{FRS}::test_fedrs_client_step_is_sgd_on_the_rs_loss_by_hand",
)
FEDPHP = (
    f"{HPM}::test_hpm_momentum_schedules",
    f"{HPM}::test_hpm_update_is_the_moving_average",
    f"{P}::test_fedphp_uploads_the_fine_tuned_model_and_folds_it_into_the_hpm",
    f"{P}::test_fedphp_client_step_distils_from_the_hpm_by_hand",
)
FEDPHP_PFLLIB = (  # FedPHP's PFLlib options
    f"{P}::test_pfllib_mmd_of_two_2x2_batches_by_hand",
    f"{P}::test_eq13_with_pfllib_mmd_by_hand",
    f"{P}::test_first_selection_distils_from_the_download_by_hand",
    f"{P}::test_default_first_selection_still_trains_plain_ce",
    f"{P}::test_personal_trained_scores_the_uploaded_model_not_the_hpm",
    f"{P}::test_a_round_reports_the_pooled_accuracy_of_the_trained_models",
)
SCAMAP = (
    f"{M}::test_scamap_client_update_by_hand",
    f"{M}::test_scamap_server_update_by_hand",
)
BREAKS = [
    Break(
        "fedrs",
        "RS logits scaled by alpha^2",
        "algorithms/blocks/rs.py",
        "F.cross_entropy(model(x) * scale, y)",
        "F.cross_entropy(model(x) * scale * scale, y)",
        FEDRS,
    ),
    Break(
        "map",
        "Eq.13 lambda swapped",
        "algorithms/blocks/hpm.py",
        "(1 - p.lam) * F.cross_entropy(logits, y) + p.lam * kt",
        "p.lam * F.cross_entropy(logits, y) + (1 - p.lam) * kt",
        MAP,
    ),
    Break(
        "map",
        "KT teacher is the student",
        "algorithms/blocks/hpm.py",
        "            hp = teacher.features(x)\n            gp = teacher.head(hp)",
        "            hp = model.features(x)\n            gp = model.head(hp)",
        MAP,
    ),
    Break(
        "map",
        "KD sums over the batch",
        "algorithms/blocks/hpm.py",
        'reduction="batchmean"',
        'reduction="sum"',
        MAP,
    ),
    Break(
        "map",
        "partition drops 1/n_k",
        "data/partition.py",
        "d[client, chosen] = 1.0 / n_k[client]",
        "d[client, chosen] = 1.0",
        MAP,
    ),
    Break(
        "map",
        "protocol scores the upload",
        "algorithms/map.py",
        '        if state.get("hpm") is None:',
        '        if state.get("hpm") is None or upload is not None:',
        MAP,
    ),
    Break(
        "map",
        "protocol scores every client",
        "engine/simulation.py",
        "selected = [job(cid, upload) for cid, upload in uploads.items()]",
        "selected = [job(cid, uploads.get(cid)) for cid in range(n)]",
        MAP,
    ),
    Break(
        "map",
        "stage B ignores stage_b_lr_scale",
        "algorithms/map.py",
        "lr_b = env.run.train.lr * self.params.stage_b_lr_scale",
        "lr_b = env.run.train.lr",
        MAP,
    ),
    Break(
        "fedphp",
        "FedPHP uploads its HPM",
        "algorithms/fedphp.py",
        'upload: WeightsUpload = {"weights": get_weights(model), "num_samples": env.num_train}',
        'upload: WeightsUpload = {"weights": state["hpm"], "num_samples": env.num_train}',
        FEDPHP,
    ),
    # -- FedRS -------------------------------------------------------------------------------------
    Break(
        "fedrs",
        "observed means more than min_samples",
        "algorithms/blocks/rs.py",
        "torch.where(counts >= min_samples, 1.0, alpha)",
        "torch.where(counts > min_samples, 1.0, alpha)",
        FEDRS,
    ),
    Break(
        "fedrs",
        "alpha scales the observed classes",
        "algorithms/blocks/rs.py",
        "torch.where(counts >= min_samples, 1.0, alpha)",
        "torch.where(counts >= min_samples, alpha, 1.0)",
        FEDRS,
    ),
    Break(
        "fedrs",
        "soft scale normalised by the sum",
        "algorithms/blocks/rs.py",
        "alpha + (1 - alpha) * counts / counts.max()",
        "alpha + (1 - alpha) * counts / counts.sum()",
        FEDRS,
    ),
    Break(
        "fedrs",
        "mixin order: FedAvg's CE wins over RS",
        "algorithms/fedrs.py",
        "class FedRS(RestrictedSoftmax, FedAvg):",
        "class FedRS(FedAvg, RestrictedSoftmax):",
        FEDRS,
    ),
    # -- FedPHP ------------------------------------------------------------------------------------
    Break(
        "fedphp",
        "HPM momentum on the new model",
        "algorithms/blocks/hpm.py",
        "torch.lerp(v, hpm[k], m)",
        "torch.lerp(hpm[k], v, m)",
        FEDPHP,
    ),
    Break(
        "fedphp",
        "z counts the previous selections only",
        "algorithms/blocks/hpm.py",
        'z = state["selected"] + 1',
        'z = state["selected"]',
        FEDPHP,
    ),
    Break(
        "fedphp",
        "mu_k without Q",
        "algorithms/blocks/hpm.py",
        "return min(max(mu * z / (q * t), 0.0), 1.0)",
        "return min(max(mu * z / t, 0.0), 1.0)",
        FEDPHP,
    ),
    Break(
        "fedphp",
        "fine-tuning without KT from the HPM",
        "algorithms/blocks/hpm.py",
        "loss = env.train(model, ctx, loss_fn=kt_loss(teacher, p), **train)",
        "loss = env.train(model, ctx, **train)",
        FEDPHP,
    ),
    Break(
        "fedphp",
        "KD without tau^2",
        "algorithms/blocks/hpm.py",
        'return tau**2 * F.kl_div(log_p, target, reduction="batchmean")',
        'return F.kl_div(log_p, target, reduction="batchmean")',
        FEDPHP,
    ),
    Break(
        "fedphp",
        "PFLlib MMD without the 0.5",
        "algorithms/blocks/hpm.py",
        "torch.exp(-0.5 * d2 / s)",
        "torch.exp(-d2 / s)",
        FEDPHP_PFLLIB,
    ),
    Break(
        "fedphp",
        "PFLlib MMD bandwidth 50 -> 5",
        "algorithms/blocks/hpm.py",
        "(10, 15, 20, 50)) -> Tensor",
        "(10, 15, 20, 5)) -> Tensor",
        FEDPHP_PFLLIB,
    ),
    Break(
        "fedphp",
        "mmd_form pfllib ignored",
        "algorithms/blocks/hpm.py",
        'mmd_pfllib(h, hp) if p.mmd_form == "pfllib" else mmd_loss(h, hp)',
        "mmd_loss(h, hp)",
        FEDPHP_PFLLIB,
    ),
    Break(
        "fedphp",
        "hpm_init start ignored",
        "algorithms/blocks/hpm.py",
        'if "hpm" not in state and p.hpm_init == "start":',
        "if False:",
        FEDPHP_PFLLIB,
    ),
    Break(
        "fedphp",
        "personal trained scores the HPM",
        "algorithms/fedphp.py",
        'state.get("weights" if self.params.personal == "trained" else "hpm")',
        'state.get("hpm")',
        FEDPHP_PFLLIB,
    ),
    # -- ScaMAP ------------------------------------------------------------------------------------
    Break(
        "scamap",
        "stage A on plain CE",
        "algorithms/map.py",
        "            self.local_objective(env, payload),",
        "            super(RestrictedSoftmax, self).local_objective(env, payload),",
        SCAMAP,
    ),
    Break(
        "scamap",
        "client keeps its old control variate",
        "algorithms/map.py",
        'return upload, {**state, "control": step.control}, step.loss',
        "return upload, state, step.loss",
        SCAMAP,
    ),
    Break(
        "scamap",
        "control update with the paper's |S| / N",
        "algorithms/map.py",
        'control_scale: ControlScale = param("code", "authors\' code (no |S|/N factor)")',
        'control_scale: ControlScale = param("paper", "authors\' code (no |S|/N factor)")',
        SCAMAP,
    ),
    Break(
        "scamap",
        "stage B at MAP's lr scale",
        "algorithms/map.py",
        'stage_b_lr_scale: float = param(0.5, "authors\' code", gt=0)',
        'stage_b_lr_scale: float = param(0.2, "authors\' code", gt=0)',
        SCAMAP,
    ),
    Break(
        "scamap",
        "stage B from the download, not from y",
        "algorithms/map.py",
        "        upload, state, loss_a = self.stage_a(env, model, payload, state, ctx, steps_a)\n",
        "        upload, state, loss_a = self.stage_a(env, model, payload, state, ctx, steps_a)\n"
        '        set_weights(model, payload["weights"])\n',
        SCAMAP,
    ),
]
