"""``pflkit analyze privacy --attack mia``: membership inference (loss threshold, Yeom et al.
2018; difficulty calibration, Watson et al. 2022) against the upload and the personalized
model, and label inference from the upload (src/pflkit/analysis/membership.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from conftest import tiny_config
from pflkit.analysis.membership import (
    _candidates,
    calibrated_scores,
    example_losses,
    infer_labels,
    label_metrics,
    loss_scores,
    membership_study,
    reference_plan,
    roc_auc,
    roc_curve,
    tpr_at_fpr,
    upload_model,
)
from pflkit.engine.clients import InProcess
from pflkit.engine.simulation import Simulation
from pflkit.errors import PflkitError
from pflkit.primitives.training import predict, set_weights

# -- the metrics, by hand -------------------------------------------------------------------------


def test_auc_and_tpr_at_1_percent_fpr_by_hand():
    """Members 0.9, 0.8, 0.4; non-members 0.8, 0.7, 0.3, 0.2. Pairs won: 0.9 beats 4, 0.8
    beats 3 and ties 1 (1/2), 0.4 beats 2: 9.5 of 12. Thresholds from the top: 0.9 -> (FPR
    0, TPR 1/3); 0.8 -> (1/4, 2/3); 0.7 -> (2/4, 2/3); 0.4 -> (2/4, 1); 0.3 -> (3/4, 1);
    0.2 -> (1, 1)."""
    m, n = [0.9, 0.8, 0.4], [0.8, 0.7, 0.3, 0.2]
    assert roc_auc(m, n) == pytest.approx(9.5 / 12)
    fpr, tpr = roc_curve(m, n)
    assert fpr.tolist() == pytest.approx([0, 0, 1 / 4, 2 / 4, 2 / 4, 3 / 4, 1])
    assert tpr.tolist() == pytest.approx([0, 1 / 3, 2 / 3, 2 / 3, 1, 1, 1])
    assert tpr_at_fpr(m, n) == pytest.approx(1 / 3)  # only the threshold with no false positive
    assert tpr_at_fpr(m, n, fpr=0.25) == pytest.approx(2 / 3)
    assert roc_auc([1.0, 1.0], [1.0]) == 0.5  # ties count one half
    assert roc_auc([0.0], [1.0]) == 0.0 and roc_auc([1.0], [0.0]) == 1.0


def test_one_percent_fpr_allows_one_false_positive_in_a_hundred():
    """One non-member of 100 above every member: at 1% FPR the rule may call it a member, so
    every member is caught (TPR 1); at 0.5% FPR none is (TPR 0)."""
    m, n = [5.0], [10.0] + [0.0] * 99
    assert tpr_at_fpr(m, n, 0.01) == 1.0
    assert tpr_at_fpr(m, n, 0.005) == 0.0
    assert roc_auc(m, n) == pytest.approx(0.99)


# -- the scores -------------------------------------------------------------------------------------


def test_loss_and_calibrated_scores_by_value():
    """Target losses 0.1, 2.0, 0.5; references [0.5, 2.5, 0.1] and [0.7, 1.5, 0.3], mean
    [0.6, 2.0, 0.2]: calibrated = -(target - mean) = 0.5, 0.0, -0.3."""
    target = np.array([0.1, 2.0, 0.5])
    refs = np.array([[0.5, 2.5, 0.1], [0.7, 1.5, 0.3]])
    assert loss_scores(target).tolist() == pytest.approx([-0.1, -2.0, -0.5])
    assert calibrated_scores(target, refs).tolist() == pytest.approx([0.5, 0.0, -0.3])


def test_calibration_turns_a_hard_member_and_an_easy_non_member_around():
    """A member the target finds hard (loss 1.0) that models without it find harder (3.0), and
    an easy non-member (0.2, references 0.2): by loss alone the member looks like the
    non-member (AUC 0); calibrated, it is caught (AUC 1)."""
    target = np.array([1.0, 0.2])  # [member, non-member]
    refs = np.array([[3.0, 0.2], [3.0, 0.2]])
    raw, cal = loss_scores(target), calibrated_scores(target, refs)
    assert roc_auc(raw[:1], raw[1:]) == 0.0
    assert roc_auc(cal[:1], cal[1:]) == 1.0


class Memoriser(nn.Module):
    """Outputs logit 50 on the stored label of a stored input (the members), zeros otherwise."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, classes: int):
        super().__init__()
        self.x, self.y, self.classes = x, y, classes

    def forward(self, x):
        out = torch.zeros(len(x), self.classes)
        hit = (x[:, None, :] == self.x[None, :, :]).all(-1)  # [batch, stored]
        rows, cols = hit.nonzero(as_tuple=True)
        out[rows, self.y[cols]] = 50.0
        return out


def test_a_model_that_memorised_its_members_is_caught_every_time():
    """Members' loss ~0, non-members' log 10: AUC 1 and TPR 1 at 1% FPR."""
    gen = torch.Generator().manual_seed(0)
    xm, xn = torch.randn(200, 5, generator=gen), torch.randn(200, 5, generator=gen)
    ym, yn = (
        torch.randint(0, 10, (200,), generator=gen),
        torch.randint(0, 10, (200,), generator=gen),
    )
    model = Memoriser(xm, ym, 10)
    lm, ln = example_losses(model, xm, ym), example_losses(model, xn, yn)
    assert lm.max() < 1e-10 and ln.min() == pytest.approx(math.log(10))
    assert roc_auc(loss_scores(lm), loss_scores(ln)) == 1.0
    assert tpr_at_fpr(loss_scores(lm), loss_scores(ln)) == 1.0


def test_members_and_non_members_from_one_distribution_give_auc_one_half():
    """A fixed random linear model, 2,000 members and 2,000 non-members drawn from the same
    distribution: the AUC is 0.5 within 4 standard errors (sd of the Mann-Whitney AUC under
    the null: sqrt((n_m + n_n + 1) / (12 n_m n_n)) = 0.0065)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x, y = torch.randn(4000, 8), torch.randint(0, 4, (4000,))
    s = loss_scores(example_losses(model, x, y))
    sd = math.sqrt((2000 + 2000 + 1) / (12 * 2000 * 2000))
    assert abs(roc_auc(s[:2000], s[2000:]) - 0.5) < 4 * sd
    assert tpr_at_fpr(s[:2000], s[2000:]) < 0.05


def test_losses_of_well_fitted_examples_do_not_tie_at_zero():
    """Logit margins 30 and 25: in float32 both cross-entropies round to exactly 0 (a tie at
    the top of the loss attack's ranking); in float64 they are e^-30 and e^-25 apart."""

    class Fixed(nn.Module):
        def forward(self, x):
            return torch.tensor([[30.0, 0.0], [25.0, 0.0]])

    losses = example_losses(Fixed(), torch.zeros(2, 1), torch.tensor([0, 0]))
    assert losses.tolist() == pytest.approx([math.exp(-30), math.exp(-25)], rel=1e-6)


def test_infinite_losses_are_capped():
    """A true class scored -inf (a class without a prototype) gives the cap, not inf or nan."""

    class Minus(nn.Module):
        def forward(self, x):
            return torch.tensor([[0.0, -math.inf], [-math.inf, -math.inf]])

    losses = example_losses(Minus(), torch.zeros(2, 1), torch.tensor([1, 0]))
    assert losses.tolist() == [100.0, 100.0]


# -- members, non-members and the reference models' data -------------------------------------------


def test_members_come_first_from_the_training_split_non_members_from_the_test_split(tiny):
    from pflkit.data.federated import build_federated

    data = build_federated(tiny().data)
    c = data.clients[1]
    x, y, n = _candidates(data, 0, 1)
    assert n == min(len(c.train_y), len(c.test_y)) and len(y) == 2 * n

    def rows(a, b):  # which rows of a are rows of b
        a, b = a.flatten(1), b.flatten(1)
        return (a[:, None, :] == b[None, :, :]).all(-1).any(1)

    assert rows(x[:n], c.train_x).all() and not rows(x[:n], c.test_x).any()
    assert rows(x[n:], c.test_x).all() and not rows(x[n:], c.train_x).any()


def test_no_reference_model_of_a_victim_saw_its_data():
    """Each pair splits the population into two halves; a victim gets the half without it."""
    pop = list(range(7))
    plan = reference_plan(pop, pop, pairs=3, seed=5)
    for v, models in plan.items():
        assert [k for k, _, _ in models] == [0, 1, 2]
        assert all(v not in clients for _, _, clients in models)
    for k in range(3):  # the two halves of a pair partition the population
        halves = {h: set(c) for m in plan.values() for kk, h, c in m if kk == k}
        assert halves[0] | halves[1] == set(pop) and not halves[0] & halves[1]
    assert reference_plan(pop, pop, 3, 5) == plan  # seeded


# -- label inference --------------------------------------------------------------------------------


def test_label_inference_reads_a_prototype_upload():
    """pFedPM / FedProto: classes [0, 3] with counts [5, 15] of K = 4."""
    up = {
        "classes": torch.tensor([0, 3]),
        "protos": torch.zeros(2, 8),
        "counts": torch.tensor([5, 15]),
    }
    inf = infer_labels(up, 4)
    assert inf["held"].tolist() == [True, False, False, True]
    assert inf["estimate"].tolist() == pytest.approx([0.25, 0, 0, 0.75])
    no_counts = infer_labels({"classes": torch.tensor([1, 2]), "protos": torch.zeros(2, 8)}, 4)
    assert no_counts["estimate"].tolist() == pytest.approx([0, 0.5, 0.5, 0])
    assert infer_labels({"weights": {}}, 4) is None


def test_label_inference_from_soft_predictions_and_a_bias_update():
    """Soft predictions on two public samples: mean [0.6, 0.25, 0.1, 0.05]; held when at least
    1 / (2 K) = 0.125. Bias: held where it rose."""
    soft = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.5, 0.3, 0.1, 0.1]])
    inf = infer_labels({"soft": soft, "num_samples": 3}, 4)
    assert inf["estimate"].tolist() == pytest.approx([0.6, 0.25, 0.1, 0.05])
    assert inf["held"].tolist() == [True, True, False, False]
    bias = infer_labels({"bias_delta": torch.tensor([0.2, -0.1, 0.0, 0.3])}, 4)
    assert bias["held"].tolist() == [True, False, False, True] and bias["estimate"] is None


def test_label_metrics_by_hand():
    """Victim counts [5, 0, 0, 15]; inferred from its prototypes (exact) against the others'
    labels [10, 10, 10, 0] held by shares [1, 1, 1, 0]: held-class AUC 1 (prior: held scores
    {1, 0} vs not held {1, 1}: pairs won 0 + 0.5 + 0.5 + 0 of 4 = 0.25), accuracy 1 (prior
    guesses held, held, held, not: only class 0 right), majority class 3 found (prior: class 0 of
    the tie, wrong), TV 0 (prior: 1/12 + 1/3 + 1/3 + 3/4 = 3/2, halved = 3/4)."""
    inf = infer_labels({"classes": torch.tensor([0, 3]), "counts": torch.tensor([5, 15])}, 4)
    case = {
        "inferred": inf,
        "counts": np.array([5, 0, 0, 15]),
        "prior": np.array([10, 10, 10, 0]),
        "prior_held": np.array([1.0, 1.0, 1.0, 0.0]),
    }
    got = label_metrics([case], 4)
    assert got["held_auc"] == 1.0 and got["held_auc_prior"] == pytest.approx(0.25)
    assert got["held_acc"] == 1.0 and got["held_acc_prior"] == 0.25
    assert got["top1_acc"] == 1.0 and got["top1_acc_prior"] == 0.0
    assert got["tv"] == 0.0 and got["tv_prior"] == pytest.approx(3 / 4)


# -- what the server sees ---------------------------------------------------------------------------


def test_the_upload_target_is_the_released_model_plus_what_the_attacker_fits(tiny):
    """FedAvg: every tensor released, nothing fitted. FedRep: the uploaded body as sent, the
    head (which the server never holds) fitted; the fit gets exactly the head's parameters."""
    with Simulation(tiny(), runner=InProcess()) as sim:
        env, w = sim.envs[1], sim.server["weights"]
        up = {k: v + 1 for k, v in w.items()}
        got, how = upload_model(sim.algo, env, [({"weights": w}, {"weights": up})], None)
        assert how["fitted"] == 0 and all(torch.equal(got[k], up[k]) for k in up)
    with Simulation(tiny(algorithm={"name": "fedrep"}), runner=InProcess()) as sim:
        env, body = sim.envs[1], sim.server["body"]
        up = {"body": {k: v + 1 for k, v in body.items()}, "num_samples": 5}
        fitted = []

        def fit(model, params):
            names = {id(p): k for k, p in model.named_parameters()}
            fitted.extend(sorted(names[id(p)] for p in params))
            for p in params:
                p.data.fill_(0.5)
            return 7, 1

        got, how = upload_model(sim.algo, env, [({"body": body}, up)], fit)
        head = env.model().group_keys("head")
        assert sorted(fitted) == sorted(head) and how["fitted_keys"] == head
        assert all(torch.equal(got[k], up["body"][k]) for k in body)
        assert all((got[k] == 0.5).all() for k in head)
        assert how["fit_samples"] == 7


def test_the_study_attacks_each_target_and_reads_prototypes(tiny, tmp_path):
    cfg = tiny(train={"rounds": 2, "local_epochs": 2})
    res = membership_study(
        cfg, tmp_path / "m", algorithms=["fedavg", "fedrep", "fedproto"], references=1
    )
    keys = [(r["algorithm"], r["target"], r["attack"]) for r in res["rows"]]
    assert keys == [
        (a, t, k)
        for a, ts in (("fedavg", ("upload", "personal")), ("fedrep", ("upload", "personal")),
                      ("fedproto", ("personal",)))
        for t in ts
        for k in ("loss", "calibrated")
    ]  # fmt: skip
    assert all(0 <= r["auc"] <= 1 and r["members"] == r["nonmembers"] for r in res["rows"])
    fedrep = next(r for r in res["rows"] if r["algorithm"] == "fedrep" and r["target"] == "upload")
    assert "fitted by the attacker (head;" in fedrep["model"]
    labels = {r["algorithm"]: r for r in res["label_rows"]}
    assert sorted(labels) == ["fedavg", "fedproto"]  # FedRep's body has no head bias
    assert labels["fedproto"]["held_auc"] == 1.0 and labels["fedproto"]["tv"] == 0.0
    assert labels["fedproto"]["top1_acc"] == 1.0
    assert {(u["algorithm"], u["target"]) for u in res["unavailable"]} == {
        ("fedrep", "label"),
        ("fedproto", "upload"),
    }
    # the reference models never saw their victim's data: recorded clients and sample counts
    from pflkit.data.federated import build_federated

    data = build_federated(cfg.data)
    for v, models in res["reference_models"]["0"].items():
        for m in models:
            assert int(v) not in m["clients"]
            assert m["samples"] == sum(len(data.clients[c].train_y) for c in m["clients"])
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "membership.json",
        "membership.md",
        "membership.png",
    ]
    assert (tmp_path / "m" / "membership.png").read_bytes()[:4] == b"\x89PNG"


def test_an_overfitted_local_model_is_caught(tiny):
    """Local on 30 clients of 600 digits (about 15 training samples each), 50 epochs: every
    member is classified right, a quarter of the non-members wrong, and the loss attack on the
    personalized model scores AUC 0.71 (> 0.6; swapping members and non-members gives < 0.4)."""
    cfg = tiny(
        algorithm={"name": "local"},
        data={"num_clients": 30, "subset": 600},
        train={"rounds": 1, "local_epochs": 50, "lr": 0.1},
    )
    res = membership_study(cfg, attacks="loss")
    (row,) = res["rows"]
    assert row["target"] == "personal" and row["member_acc"] == 1.0
    assert row["auc"] > 0.6, row


# -- the command ------------------------------------------------------------------------------------


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--attack", "mia,ig"], "unknown --attack 'mia,ig': use --attack dlg"),
        (["--attack", "mia", "--algorithms", "fednova"],
         "algorithm 'fednova' declares no release map"),
        (["--attack", "mia", "--algorithms", "fedproto", "--targets", "upload"],
         "--targets upload needs a model in the upload, but algorithm 'fedproto' uploads "
         "statistics, not a model"),
        (["--attack", "mia", "--targets", "head"],
         "unknown --targets entry 'head': choose from upload, personal"),
        (["--attack", "mia", "--round", "4"], "--round 4 is outside the config's 3 rounds"),
        (["--attack", "mia", "--references", "0"], "--references must be at least 1, got 0"),
        (["--attack", "mia", "--victims", "9,"], "--victims 9 is not a client"),
    ],
)  # fmt: skip
def test_bad_input_is_one_sentence_and_leaves_no_folder(cli, cfg_file, tmp_path, args, message):
    r = cli("analyze", "privacy", str(cfg_file), *args, "--out", "pv", cwd=tmp_path)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "pv").exists()


def test_the_api_refuses_an_unknown_attack(tiny):
    with pytest.raises(PflkitError, match="unknown attack 'dlg2': use mia"):
        membership_study(tiny(), attacks="dlg2")


def test_the_command_writes_the_study_from_a_run_folder(cli, cfg_file, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg_file.read_text())
    r = cli("analyze", "privacy", str(run), "--attack", "mia", "--algorithms", "fedavg,pfedpm",
            "--references", "1", "--ref-epochs", "1", "--quiet", "--out", "pv", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "fedavg-upload calibrated: AUC" in r.stdout
    assert (
        "pfedpm label inference (prototype upload: classes and counts): held-class AUC 1.000"
        in r.stdout
    )
    table = (tmp_path / "pv" / "membership.md").read_text()
    assert "| fedavg | upload | loss |" in table and "| pfedpm | personal | calibrated |" in table
    assert "- pfedpm upload: its upload carries statistics, not a model" in table


def test_the_personal_target_is_what_evaluation_scores(tiny):
    """FedAvg: the personalized model is the global model after the round, so the target's
    accuracy on the members equals the global model's on them."""
    cfg = tiny(train={"rounds": 1})
    res = membership_study(cfg, attacks="loss", victims=[2], targets=["personal"])
    (row,) = res["rows"]
    with Simulation(cfg, runner=InProcess()) as sim:
        sim.run_round(1)
        model = sim.envs[2].model()
        set_weights(model, sim.server["weights"])
        x, y, n = _candidates(sim.data, 0, 2)
        acc = (predict(model, x[:n]).argmax(1) == y[:n]).double().mean().item()
    assert row["member_acc"] == pytest.approx(acc)
