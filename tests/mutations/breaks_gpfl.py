"""Breaks of GPFL and its baselines: FedPer, FedRep, FedRoD, Per-FedAvg, pFedMe (each one's
defining math, its aggregation and the model it scores)."""

from mutate import Break

GPFL = ("tests/algorithms/test_gpfl.py",)
FEDPER = ("tests/algorithms/test_fedper.py", "tests/test_model_split.py")
FEDREP = ("tests/algorithms/test_fedrep.py", "tests/test_model_split.py")
FEDROD = ("tests/algorithms/test_fedrod.py", "tests/test_model_split.py")
PERFEDAVG = ("tests/algorithms/test_perfedavg.py", "tests/test_model_split.py")
PFEDME = ("tests/algorithms/test_pfedme.py", "tests/test_model_split.py")

BREAKS = [
    # -- GPFL ------------------------------------------------------------------------------------
    Break(
        "gpfl",
        "without L_mlg",
        "algorithms/gpfl.py",
        "loss = loss + p.lam * mlg_loss(f_g, table_hat[y], p.mlg)",
        "loss = loss",
        GPFL,
    ),
    Break(
        "gpfl",
        "global and personalized routes swapped in training",
        "algorithms/gpfl.py",
        "f_p, f_g = cov_apply(f, gamma[0], beta[0]), cov_apply(f, gamma[1], beta[1])",
        "f_g, f_p = cov_apply(f, gamma[0], beta[0]), cov_apply(f, gamma[1], beta[1])",
        GPFL,
    ),
    Break(
        "gpfl",
        "L_mlg target trainable (gradient flows into the table)",
        "algorithms/gpfl.py",
        "table_hat = shared[TABLE] if p.use_gce else None",
        "table_hat = table if p.use_gce else None",
        GPFL,
    ),
    Break(
        "gpfl",
        "L_alg against the frozen table (C not trained)",
        "algorithms/gpfl.py",
        "loss = loss + alg_loss(f_g, table, y)",
        "loss = loss + alg_loss(f_g, table_hat, y)",
        GPFL,
    ),
    Break(
        "gpfl",
        "regulariser pushes away (wrong sign)",
        "algorithms/gpfl.py",
        "torch._foreach_add_(grads, ts, alpha=self.mu / float(norm))",
        "torch._foreach_add_(grads, ts, alpha=-self.mu / float(norm))",
        GPFL,
    ),
    Break(
        "gpfl",
        "L_mlg summed over the batch by default",
        "algorithms/gpfl.py",
        'loss: Tensor = d.norm(dim=1).mean() if form == "mean_l2" else d.norm()',
        'loss: Tensor = d.norm(dim=1).sum() if form == "mean_l2" else d.norm()',
        GPFL,
    ),
    Break(
        "gpfl",
        "scored with the global input g instead of p",
        "algorithms/gpfl.py",
        "p_i = self._inputs(env, shared, state, model.feature_dim)[1]",
        "p_i = self._inputs(env, shared, state, model.feature_dim)[0]",
        GPFL,
    ),
    Break(
        "gpfl",
        "head not kept (the trained head is dropped)",
        "algorithms/gpfl.py",
        'new_state = {**state, "head": group(model, w, "head")}',
        "new_state = {**state}",
        GPFL,
    ),
    Break(
        "gpfl",
        "aggregation unweighted",
        "algorithms/gpfl.py",
        'uniform = self.params.weighting == "uniform"',
        "uniform = True",
        GPFL,
    ),
    Break(
        "gpfl",
        "local_previous reads the received table",
        "algorithms/gpfl.py",
        'elif "table" in state:\n            table = state["table"]',
        'elif "table" in state:\n            table = shared[TABLE]',
        GPFL,
    ),
]

BREAKS += [
    # -- FedPer (and the SplitBody plumbing FedRep shares) -------------------------------------
    Break(
        "fedper",
        "trains the head only",
        "algorithms/fedper.py",
        "        return env.train(model, ctx)",
        '        return env.train(model, ctx, params=model.group_params("head"))',
        FEDPER,
    ),
    Break(
        "fedper",
        "trained head dropped (private part not kept)",
        "algorithms/blocks/split.py",
        'return Update(upload, {**state, "head": private}, {"train_loss": loss})',
        'return Update(upload, state, {"train_loss": loss})',
        FEDPER,
    ),
    Break(
        "fedper",
        "private layers shared (private_layers ignored)",
        "algorithms/blocks/split.py",
        'private = tuple(f"body.{name}." for name in self.params.private_layers)',
        "private = ()",
        FEDPER,
    ),
    Break(
        "fedper",
        "aggregation unweighted",
        "algorithms/blocks/split.py",
        'uniform = self.params.weighting == "uniform"',
        "uniform = True",
        FEDPER,
    ),
    Break(
        "fedper",
        "scores the downloaded body's initial head",
        "algorithms/blocks/split.py",
        'return load_model(env, {**body, **state["head"]})',
        'return load_model(env, {**body, **self.client_init(env)["head"]})',
        FEDPER,
    ),
    Break(
        "fedper",
        "MAP's protocol scores the aggregated body, not the trained one",
        "algorithms/blocks/split.py",
        'body = view["body"] if upload is None else upload["body"]',
        'body = view["body"]',
        FEDPER,
    ),
    # -- FedRep ----------------------------------------------------------------------------------
    Break(
        "fedrep",
        "body epochs before head epochs",
        "algorithms/fedrep.py",
        "        if p.head_epochs:\n"
        "            losses.append(env.train(model, ctx, epochs=p.head_epochs, params=head))\n"
        "        if body_epochs:\n"
        "            losses.append(env.train(model, ctx, epochs=body_epochs, params=body))",
        "        if body_epochs:\n"
        "            losses.append(env.train(model, ctx, epochs=body_epochs, params=body))\n"
        "        if p.head_epochs:\n"
        "            losses.append(env.train(model, ctx, epochs=p.head_epochs, params=head))",
        FEDREP,
    ),
    Break(
        "fedrep",
        "head epochs train the body too",
        "algorithms/fedrep.py",
        "losses.append(env.train(model, ctx, epochs=p.head_epochs, params=head))",
        "losses.append(env.train(model, ctx, epochs=p.head_epochs))",
        FEDREP,
    ),
    Break(
        "fedrep",
        "head phase runs body_epochs",
        "algorithms/fedrep.py",
        "losses.append(env.train(model, ctx, epochs=p.head_epochs, params=head))",
        "losses.append(env.train(model, ctx, epochs=body_epochs, params=head))",
        FEDREP,
    ),
    Break(
        "fedrep",
        "body_epochs defaults to head_epochs",
        "algorithms/fedrep.py",
        "body_epochs = env.run.train.local_epochs if p.body_epochs is None else p.body_epochs",
        "body_epochs = p.head_epochs if p.body_epochs is None else p.body_epochs",
        FEDREP,
    ),
    # -- FedRoD ----------------------------------------------------------------------------------
    Break(
        "fedrod",
        "scored with the personalized head alone",
        "algorithms/fedrod.py",
        "        return combine(self.model.head(f), self.phead(f), self.variant)",
        "        return self.phead(f)",
        FEDROD,
    ),
    Break(
        "fedrod",
        "generic loss without the balanced-softmax prior",
        "algorithms/fedrod.py",
        "return z + counts.log()  # log 0 = -inf for absent classes",
        "return z",
        FEDROD,
    ),
    Break(
        "fedrod",
        "personalized loss trains the body (no stop-gradient on f)",
        "algorithms/fedrod.py",
        "personal = F.cross_entropy(combine(zg.detach(), phead(f.detach()), variant), y)",
        "personal = F.cross_entropy(combine(zg.detach(), phead(f), variant), y)",
        FEDROD,
    ),
    Break(
        "fedrod",
        "P-head trained without the generic logits",
        "algorithms/fedrod.py",
        "personal = F.cross_entropy(combine(zg.detach(), phead(f.detach()), variant), y)",
        "personal = F.cross_entropy(phead(f.detach()), y)",
        FEDROD,
    ),
    Break(
        "fedrod",
        "paper variant averages the heads",
        "algorithms/fedrod.py",
        'return zg + zp if variant == "paper" else (zg + zp) / 2',
        "return (zg + zp) / 2",
        FEDROD,
    ),
    Break(
        "fedrod",
        "trained P-head dropped",
        "algorithms/fedrod.py",
        'return Update(upload, {**state, "phead": new_head}, {"train_loss": loss})',
        'return Update(upload, state, {"train_loss": loss})',
        FEDROD,
    ),
    # -- Per-FedAvg ------------------------------------------------------------------------------
    Break(
        "perfedavg",
        "outer step uses alpha, not beta",
        "algorithms/perfedavg.py",
        "lr=p.beta or t.lr,",
        "lr=self._alpha(env),",
        PERFEDAVG,
    ),
    Break(
        "perfedavg",
        "outer gradient at w, not at w_tmp (FedAvg step)",
        "algorithms/perfedavg.py",
        "outer = F.cross_entropy(functional_call(model, tmp, (x2,)), y2)",
        "outer = F.cross_entropy(functional_call(model, params, (x2,)), y2)",
        PERFEDAVG,
    ),
    Break(
        "perfedavg",
        "D' is D (one batch for both gradients)",
        "algorithms/perfedavg.py",
        "(x1, y1), (x2, y2) = parts[0], parts[1]",
        "(x1, y1), (x2, y2) = parts[0], parts[0]",
        PERFEDAVG,
    ),
    Break(
        "perfedavg",
        "steps draw B samples, not 2B",
        "algorithms/perfedavg.py",
        "batch_size=k * t.batch_size,",
        "batch_size=t.batch_size,",
        PERFEDAVG,
    ),
    Break(
        "perfedavg",
        "scores the meta-model w unadapted",
        "algorithms/perfedavg.py",
        "        return load_model(env, self.adapt(env, start, ctx))",
        "        return load_model(env, start)",
        PERFEDAVG,
    ),
    Break(
        "perfedavg",
        "adaptation step of size beta",
        "algorithms/perfedavg.py",
        "env, weights, ctx, steps=1, lr=self._alpha(env), loss_fn=cross_entropy",
        "env, weights, ctx, steps=1, lr=self.params.beta, loss_fn=cross_entropy",
        PERFEDAVG,
    ),
    Break(
        "perfedavg",
        "aggregation weighted by samples by default",
        "algorithms/perfedavg.py",
        'weighting: Weighting = param("uniform", "paper (Alg. 1: 1/(rn) sum)")',
        'weighting: Weighting = param("samples", "paper (Alg. 1: 1/(rn) sum)")',
        PERFEDAVG,
    ),
    # -- pFedMe ----------------------------------------------------------------------------------
    Break(
        "pfedme",
        "theta restarts from w at every batch",
        "algorithms/pfedme.py",
        "theta.update(moreau_steps(f, theta, anchor, lam, lr, k_steps))",
        "theta.update(moreau_steps(f, anchor, anchor, lam, lr, k_steps))",
        PFEDME,
    ),
    Break(
        "pfedme",
        "personalized model replaced by the local w",
        "algorithms/pfedme.py",
        "personal = {k: theta.get(k, v).detach().clone() for k, v in w.items()}",
        "personal = {k: v.detach().clone() for k, v in w.items()}",
        PFEDME,
    ),
    Break(
        "pfedme",
        "scores the global model",
        "algorithms/pfedme.py",
        '        return load_model(env, state["personal"])',
        "        return super().personal_model(env, view, state, ctx)",
        PFEDME,
    ),
    Break(
        "pfedme",
        "one inner step instead of K",
        "algorithms/pfedme.py",
        "theta.update(moreau_steps(f, theta, anchor, lam, lr, k_steps))",
        "theta.update(moreau_steps(f, theta, anchor, lam, lr, 1))",
        PFEDME,
    ),
    Break(
        "pfedme",
        "local update of w with personal_lr",
        "algorithms/pfedme.py",
        "loss_fn=pfedme_loss(theta, p.lam, p.personal_lr, p.inner_steps, p.theta_decay),",
        "lr=p.personal_lr,"
        " loss_fn=pfedme_loss(theta, p.lam, p.personal_lr, p.inner_steps, p.theta_decay),",
        PFEDME,
    ),
    Break(
        "pfedme",
        "local update pushes w away from theta",
        "algorithms/pfedme.py",
        "return pull - pull.detach() + value",
        "return pull.detach() - pull + value",
        PFEDME,
    ),
    Break(
        "pfedme",
        "beta mixing swapped",
        "algorithms/pfedme.py",
        '"weights": convex_combination(old, mean, b)',
        '"weights": convex_combination(mean, old, b)',
        PFEDME,
    ),
    Break(
        "pfedme",
        "aggregation weighted by samples by default",
        "algorithms/pfedme.py",
        'weighting: Weighting = param("uniform", "paper (Alg. 1: mean over S)")',
        'weighting: Weighting = param("samples", "paper (Alg. 1: mean over S)")',
        PFEDME,
    ),
    Break(
        "pfedme",
        "theta_decay pushes theta away from zero (PFLlib's mu theta with the wrong sign)",
        "algorithms/pfedme.py",
        "loss = loss + 0.5 * theta_decay * sum(v.pow(2).sum() for v in params.values())",
        "loss = loss - 0.5 * theta_decay * sum(v.pow(2).sum() for v in params.values())",
        ("tests/algorithms/test_pfedme.py::test_theta_decay_adds_mu_theta_to_every_inner_step",),
    ),
    Break(
        "pfedme",
        "scored: global still scores theta",
        "algorithms/pfedme.py",
        "            return super().personal_model(env, view, state, ctx, upload)\n"
        "        if upload is None",
        '            return load_model(env, state["personal"])\n        if upload is None',
        (
            "tests/algorithms/test_pfedme.py::test_scored_global_scores_the_global_model_as_pfllib_does",
        ),
    ),
]
