"""Breaks of the knowledge-distillation family (KT-pFL and its homogeneous variant, FedMD,
Sim-pFD, TopK-pFD, FedDF, pFedDF) and of the MAP baselines FedAwS and FLDA: the mixing matrix
and its learning, the temperature and the KL, the ensemble teacher, the server steps, the
gate."""

from mutate import Break

KT = "tests/algorithms/test_ktpfl.py"
MD = "tests/algorithms/test_fedmd.py"
SIM = "tests/algorithms/test_simpfd.py"
DF = "tests/algorithms/test_feddf.py"
DISTILL = "tests/algorithms/blocks/test_distill.py"

KTPFL = (
    f"{KT}::test_c_update_matches_hand_computed_gradient_steps",
    f"{KT}::test_objective_value",
    f"{KT}::test_partial_participation_updates_only_the_sub_block",
    f"{KT}::test_coef_timing_decides_which_c_mixes_and_which_uploads_update_it",
    f"{KT}::test_client_round_order_upload_temperature_and_distillation_by_value",
)
KTPFL_HOMO = (f"{KT}::test_homogeneous_ktpfl_mixes_parameters_by_columns_of_c",)
FEDMD = (
    f"{MD}::test_fedmd_teacher_is_the_plain_mean",
    f"{KT}::test_client_round_order_upload_temperature_and_distillation_by_value",
    f"{DISTILL}::test_kd_loss_is_kl_teacher_student_and_its_t2_form",
)
SIMPFD = (
    f"{SIM}::test_sim_pfd_weights_are_the_cosine_similarities",
    f"{SIM}::test_simpfd_and_topkpfd_teachers_through_the_server_by_hand",
)
TOPKPFD = (
    f"{SIM}::test_topk_pfd_averages_the_k_most_similar_clients_including_itself",
    f"{SIM}::test_simpfd_and_topkpfd_teachers_through_the_server_by_hand",
)
FEDDF = (
    f"{DF}::test_feddf_one_epoch_distils_the_all_client_ensemble_into_each_group_by_value",
    f"{DF}::test_feddf_group_average_is_sample_weighted_before_distillation_by_hand",
    f"{DF}::test_feddf_server_step_is_adam_with_cosine_annealing_by_value",
    f"{DF}::test_feddf_stops_early_when_the_held_out_kl_stops_improving",
)
PFEDDF = (f"{DF}::test_pfeddf_fine_tunes_the_prototype_by_hand",)
FEDAWS = ("tests/algorithms/test_fedaws.py",)
FLDA = ("tests/algorithms/test_flda.py",)

BREAKS = [
    # -- KT-pFL ------------------------------------------------------------------------------------
    Break(
        "ktpfl",
        "c not learned (eq. 7 step skipped)",
        "algorithms/ktpfl.py",
        "x = project_simplex(x - lr * grad)",
        "x = project_simplex(x)",
        KTPFL,
    ),
    Break(
        "ktpfl",
        "c not projected onto the simplex",
        "algorithms/ktpfl.py",
        "x = project_simplex(x - lr * grad)",
        "x = x - lr * grad",
        KTPFL,
    ),
    Break(
        "ktpfl",
        "sub-block columns not renormalised",
        "algorithms/ktpfl.py",
        "    x = sub / mass\n",
        "    x = sub\n",
        KTPFL,
    ),
    Break(
        "ktpfl",
        "KL part weighted uniformly, not by D_n / D",
        "algorithms/ktpfl.py",
        "w = num_samples.double() / num_samples.double().sum()",
        "w = torch.full_like(num_samples.double(), 1.0 / len(num_samples))",
        KTPFL,
    ),
    Break(
        "ktpfl",
        "coefficient KL reversed",
        "algorithms/ktpfl.py",
        "kl = (p * (p.clamp_min(EPS).log() - s.clamp_min(EPS).log())).sum(-1)",
        "kl = (s * (s.clamp_min(EPS).log() - p.clamp_min(EPS).log())).sum(-1)",
        KTPFL,
    ),
    Break(
        "ktpfl",
        "rho pulls c to 0, not 1/N",
        "algorithms/ktpfl.py",
        "rho * (c - 1.0 / n).pow(2).sum()",
        "rho * c.pow(2).sum()",
        KTPFL,
    ),
    Break(
        "ktpfl",
        "coef_kl mean ignored (KL summed)",
        "algorithms/ktpfl.py",
        'kl = kl.mean(-1) if reduction == "mean" else kl.sum(-1)',
        "kl = kl.sum(-1)",
        KTPFL,
    ),
    Break(
        "ktpfl",
        "teachers mix rows of c, not columns",
        "algorithms/blocks/distill.py",
        '"mn,mbk->nbk"',
        '"nm,mbk->nbk"',
        KTPFL,
    ),
    Break(
        "ktpfl",
        "KT-pFL distils before training",
        "algorithms/ktpfl.py",
        '    default_order = "train_then_distill"',
        '    default_order = "distill_then_train"',
        KTPFL,
    ),
    # -- KT-pFL, homogeneous -----------------------------------------------------------------------
    Break(
        "ktpfl_homo",
        "parameters mixed by rows of c",
        "algorithms/ktpfl.py",
        'personal[cid] = mix_weights(mixing[:, j], models, uploads[cid]["weights"])',
        'personal[cid] = mix_weights(mixing[j, :], models, uploads[cid]["weights"])',
        KTPFL_HOMO,
    ),
    Break(
        "ktpfl_homo",
        "c not updated",
        "algorithms/ktpfl.py",
        'c = update_coefficients(server["c"], active, soft, num, self.params)',
        'c = server["c"]',
        KTPFL_HOMO,
    ),
    Break(
        "ktpfl_homo",
        "soft predictions at T = 1",
        "algorithms/ktpfl.py",
        '"soft": soft_predictions(model, x, self.params.temperature),',
        '"soft": soft_predictions(model, x, 1.0),',
        KTPFL_HOMO,
    ),
    Break(
        "ktpfl_homo",
        "client downloads the shared model, not its mix",
        "algorithms/ktpfl.py",
        'payload: Payload = {"weights": server["personal"].get(cid, server["weights"])}',
        'payload: Payload = {"weights": server["weights"]}',
        KTPFL_HOMO,
    ),
    Break(
        "ktpfl_homo",
        "c's KL weighted uniformly",
        "algorithms/ktpfl.py",
        '[float(uploads[c]["num_samples"]) for c in active_list]',
        "[1.0 for c in active_list]",
        KTPFL_HOMO,
    ),
    # -- FedMD -------------------------------------------------------------------------------------
    Break(
        "fedmd",
        "consensus weighted by D_n",
        "algorithms/fedmd.py",
        'return torch.full((a, a), 1.0 / a, dtype=torch.float64, device=server["soft"].device)',
        'return (server["num_samples"] / server["num_samples"].sum())[:, None].expand(a, a)',
        FEDMD,
    ),
    Break(
        "fedmd",
        "consensus is the student's own predictions",
        "algorithms/fedmd.py",
        'return torch.full((a, a), 1.0 / a, dtype=torch.float64, device=server["soft"].device)',
        'return torch.eye(a, dtype=torch.float64, device=server["soft"].device)',
        FEDMD,
    ),
    Break(
        "fedmd",
        "FedMD trains before it digests",
        "algorithms/fedmd.py",
        'default_order = "distill_then_train"',
        'default_order = "train_then_distill"',
        FEDMD,
    ),
    Break(
        "fedmd",
        "uploads not softened by T",
        "algorithms/blocks/distill.py",
        "return torch.softmax(predict(model, x, 1000).float() / temperature, dim=1)",
        "return torch.softmax(predict(model, x, 1000).float(), dim=1)",
        FEDMD,
    ),
    Break(
        "fedmd",
        "student not softened by T in the KL",
        "algorithms/blocks/distill.py",
        "logp = F.log_softmax(model(x) / t, dim=1)",
        "logp = F.log_softmax(model(x), dim=1)",
        FEDMD,
    ),
    # -- Sim-pFD -----------------------------------------------------------------------------------
    Break(
        "simpfd",
        "similarity rows normalised, not columns",
        "algorithms/simpfd.py",
        "total = cos.sum(0, keepdim=True)",
        "total = cos.sum(1, keepdim=True)",
        SIMPFD,
    ),
    Break(
        "simpfd",
        "dot products, not cosines",
        "algorithms/blocks/distill.py",
        "flat = flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-12)",
        "flat = flat",
        SIMPFD,
    ),
    Break(
        "simpfd",
        "code form shifts by the row minimum",
        "algorithms/simpfd.py",
        "cos = cos - cos.min(dim=0, keepdim=True).values",
        "cos = cos - cos.min(dim=1, keepdim=True).values",
        SIMPFD,
    ),
    Break(
        "simpfd",
        "teachers mixed with the stored uniform c",
        "algorithms/simpfd.py",
        'return similarity_weights(server["soft"], self.params.sim_weights)',
        "return super().mixing_weights(server)",
        SIMPFD,
    ),
    # -- TopK-pFD ----------------------------------------------------------------------------------
    Break(
        "topkpfd",
        "the k least similar clients",
        "algorithms/simpfd.py",
        "top = cos.topk(k, dim=0).indices",
        "top = cos.topk(k, dim=0, largest=False).indices",
        TOPKPFD,
    ),
    Break(
        "topkpfd",
        "weights 1 / A, not 1 / k",
        "algorithms/simpfd.py",
        "w.scatter_(0, top, 1.0 / k)",
        "w.scatter_(0, top, 1.0 / a)",
        TOPKPFD,
    ),
    Break(
        "topkpfd",
        "k ignored (always 5)",
        "algorithms/simpfd.py",
        'return topk_weights(server["soft"], self.params.k)',
        'return topk_weights(server["soft"], 5)',
        TOPKPFD,
    ),
    # -- FedDF -------------------------------------------------------------------------------------
    Break(
        "feddf",
        "each group distils its own ensemble",
        "algorithms/feddf.py",
        "info = self.fuse(env, model, teacher)",
        "info = self.fuse(env, model, self.ensemble_teacher(env, group))",
        FEDDF,
    ),
    Break(
        "feddf",
        "ensemble teacher without T",
        "algorithms/feddf.py",
        "torch.softmax(logits / len(uploads) / self.params.temperature, dim=1)",
        "torch.softmax(logits / len(uploads), dim=1)",
        FEDDF,
    ),
    Break(
        "feddf",
        "ensemble averages probabilities, not logits",
        "algorithms/feddf.py",
        "z = predict(model, x, 1000).double()",
        "z = torch.softmax(predict(model, x, 1000).double(), dim=1)",
        FEDDF,
    ),
    Break(
        "feddf",
        "group average uniform, not n_k-weighted",
        "algorithms/feddf.py",
        'set_weights(model, weighted_average(group, uniform=self.params.weighting == "uniform"))',
        "set_weights(model, weighted_average(group, uniform=True))",
        FEDDF,
    ),
    Break(
        "feddf",
        "server lr not annealed",
        "algorithms/feddf.py",
        "            sched.step()\n",
        "",
        FEDDF,
    ),
    Break(
        "feddf",
        "last student kept, not the best",
        "algorithms/feddf.py",
        "    set_weights(model, best_weights)\n",
        "",
        FEDDF,
    ),
    # -- pFedDF ------------------------------------------------------------------------------------
    Break(
        "pfeddf",
        "scores the prototype before fine-tuning",
        "algorithms/feddf.py",
        '        weights, _ = train_from(env, view["proto"], ctx, epochs=epochs)\n'
        "        return load_model(env, weights)",
        '        weights, _ = train_from(env, view["proto"], ctx, epochs=epochs)\n'
        '        return load_model(env, view["proto"])',
        PFEDDF,
    ),
    Break(
        "pfeddf",
        "ft_epochs ignored",
        "algorithms/feddf.py",
        "epochs = self.params.ft_epochs or env.run.train.local_epochs",
        "epochs = env.run.train.local_epochs",
        PFEDDF,
    ),
    Break(
        "pfeddf",
        "fine-tunes a fresh model, not the prototype",
        "algorithms/feddf.py",
        'weights, _ = train_from(env, view["proto"], ctx, epochs=epochs)',
        "weights, _ = train_from(env, env.init_weights(), ctx, epochs=epochs)",
        PFEDDF,
    ),
    # -- FedAwS ------------------------------------------------------------------------------------
    Break(
        "fedaws",
        "hinge on the cosine, not the cosine distance",
        "algorithms/fedaws.py",
        "F.relu(margin - (1 - cos[off])).pow(2).sum()",
        "F.relu(margin - cos[off]).pow(2).sum()",
        FEDAWS,
    ),
    Break(
        "fedaws",
        "embeddings not normalised",
        "algorithms/fedaws.py",
        "wn = F.normalize(w, dim=1)",
        "wn = w",
        FEDAWS,
    ),
    Break(
        "fedaws",
        "server step eta, not lambda * eta",
        "algorithms/fedaws.py",
        "return PAPER_LR_MULTIPLIER * env.run.train.lr if lr is None else lr",
        "return env.run.train.lr if lr is None else lr",
        FEDAWS,
    ),
    Break(
        "fedaws",
        "average uniform, not n_k-weighted",
        "algorithms/fedaws.py",
        'weights: Weights = weighted_average(uploads, uniform=p.weighting == "uniform")',
        "weights: Weights = weighted_average(uploads, uniform=True)",
        FEDAWS,
    ),
    Break(
        "fedaws",
        "code form without momentum",
        "algorithms/fedaws.py",
        'momentum = 0.0 if form == "paper" else CODE_MOMENTUM',
        "momentum = 0.0",
        FEDAWS,
    ),
    # -- FLDA --------------------------------------------------------------------------------------
    Break(
        "flda",
        "gate weights the private expert",
        "algorithms/flda.py",
        "log_g = F.logsigmoid(s) + F.log_softmax(zg, dim=1)",
        "log_g = F.logsigmoid(-s) + F.log_softmax(zg, dim=1)",
        FLDA,
    ),
    Break(
        "flda",
        "general model trained through the mixture (paper)",
        "algorithms/flda.py",
        "mix = mixture(zg.detach(), zp, gate_logit(x, weight, bias), variant)",
        "mix = mixture(zg, zp, gate_logit(x, weight, bias), variant)",
        FLDA,
    ),
    Break(
        "flda",
        "paper loss without the general model's CE",
        "algorithms/flda.py",
        "return F.cross_entropy(zg, y) + F.nll_loss(mix, y)",
        "return F.nll_loss(mix, y)",
        FLDA,
    ),
    Break(
        "flda",
        "map_code loss not doubled",
        "algorithms/flda.py",
        "return 2 * F.cross_entropy(mixture(zg, zp, gate_logit(h, weight, bias), variant), y)",
        "return F.cross_entropy(mixture(zg, zp, gate_logit(h, weight, bias), variant), y)",
        FLDA,
    ),
]
