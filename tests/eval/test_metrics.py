"""The METRICS registry (pflkit.eval.metrics): every metric by value against a hand computation
(or scikit-learn, an independent implementation), pooling across clients from summed
statistics, the row fields of a run, a metric registered from this file, and bad names."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pflkit.engine.runner import run_experiment
from pflkit.errors import PflkitError
from pflkit.eval.metrics import (
    METRICS,
    Metric,
    add_stats,
    client_fields,
    field_metric,
    resolve,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def onehot_logits(pred: list[int], classes: int) -> torch.Tensor:
    """Logits whose argmax is ``pred`` (one 5 in a row of zeros)."""
    out = torch.zeros(len(pred), classes)
    out[torch.arange(len(pred)), torch.tensor(pred)] = 5.0
    return out


def value(name: str, pred: list[int], target: list[int], classes: int = 3) -> float | None:
    m = METRICS[name]()
    return m.value(m.stats(onehot_logits(pred, classes), torch.tensor(target), classes))


# targets 0 0 1 1 2 2, predictions 0 1 1 1 2 0: confusion (rows true, columns predicted)
# [[1 1 0] [0 2 0] [1 0 1]]; TP 1 2 1, FP 1 1 0, FN 1 0 1
TARGET, PRED = [0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 2, 0]


def test_accuracy_f1_and_balanced_accuracy_by_hand():
    assert value("accuracy", PRED, TARGET) == 4 / 6
    # F1 per class 2TP/(2TP+FP+FN): 2/4, 4/5, 2/3
    assert value("f1_macro", PRED, TARGET) == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)
    # recall per class: 1/2, 2/2, 1/2
    assert value("balanced_accuracy", PRED, TARGET) == pytest.approx(2 / 3)
    # a class in neither targets nor predictions (class 3 of 4) is left out of macro-F1
    assert value("f1_macro", PRED, TARGET, classes=4) == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)
    # a class only predicted (2, never a target) counts 0 in F1, nothing in balanced accuracy
    assert value("f1_macro", [0, 2], [0, 1]) == pytest.approx((1 + 0 + 0) / 3)
    assert value("balanced_accuracy", [0, 2], [0, 1]) == pytest.approx(0.5)


def test_loss_and_perplexity_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # p(target) = 1/2, 3/4
    target = torch.tensor([0, 0])
    loss, ppl = METRICS["loss"](), METRICS["perplexity"]()
    expected = (math.log(2) + math.log(4 / 3)) / 2
    assert loss.value(loss.stats(logits, target, 2)) == pytest.approx(expected, abs=1e-7)
    assert ppl.value(ppl.stats(logits, target, 2)) == pytest.approx(math.exp(expected), 1e-6)
    assert loss.value(loss.stats(logits[:0], target[:0], 2)) is None  # no predictions


def test_ece_by_hand():
    # two classes, p(class 0) = p: confidence max(p, 1 - p)
    p = torch.tensor([0.9, 0.9, 0.62, 0.3], dtype=torch.float64)
    logits = torch.stack([p.log(), (1 - p).log()], 1)
    target = torch.tensor([0, 1, 0, 0])  # right, wrong, right, wrong (predicted 1 at 0.7)
    # bins of width 1/15: 0.9 -> (13/15, 14/15], 0.62 -> (9/15, 10/15], 0.7 -> (10/15, 11/15]
    # ECE = 2/4 |1/2 - 0.9| + 1/4 |1 - 0.62| + 1/4 |0 - 0.7| = 0.2 + 0.095 + 0.175
    m = METRICS["ece"]()
    stats = m.stats(logits, target, 2)
    assert stats["count"].tolist() == [0] * 9 + [1, 1, 0, 0, 2, 0]
    assert m.value(stats) == pytest.approx(0.47)
    # a confidence on a bin's upper edge belongs to that bin: 1/3 = 5/15 is in (4/15, 5/15]
    edge = m.stats(torch.zeros(2, 3, dtype=torch.float64), torch.tensor([0, 1]), 3)
    assert edge["count"].tolist() == [0] * 4 + [2] + [0] * 10
    assert m.value(edge) == pytest.approx(abs(1 / 2 - 1 / 3))


def ece_loop(conf: np.ndarray, correct: np.ndarray, bins: int = 15) -> float:
    """ECE written out with one comparison per bin, (lo, hi], as an independent check."""
    total = 0.0
    for b in range(bins):
        inside = (conf > b / bins) & (conf <= (b + 1) / bins)
        if inside.any():
            total += inside.mean() * abs(correct[inside].mean() - conf[inside].mean())
    return total


def test_metrics_against_independent_implementations():
    sklearn = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(500, 7, generator=g) * 2
    target = torch.randint(0, 7, (500,), generator=g)
    pred = logits.argmax(1).numpy()
    f1 = METRICS["f1_macro"]()
    assert f1.value(f1.stats(logits, target, 7)) == pytest.approx(
        sklearn.f1_score(target.numpy(), pred, average="macro")
    )
    bal = METRICS["balanced_accuracy"]()
    assert bal.value(bal.stats(logits, target, 7)) == pytest.approx(
        sklearn.balanced_accuracy_score(target.numpy(), pred)
    )
    probs = torch.softmax(logits.double(), 1).numpy()
    conf, correct = probs.max(1), (pred == target.numpy()).astype(float)
    ece = METRICS["ece"]()
    assert ece.value(ece.stats(logits, target, 7)) == pytest.approx(ece_loop(conf, correct))


def test_pooled_macro_f1_is_not_the_mean_of_the_clients():
    f1 = METRICS["f1_macro"]()
    a = f1.stats(onehot_logits([0, 0], 2), torch.tensor([0, 0]), 2)  # F1: class 0 only -> 1
    b = f1.stats(onehot_logits([0, 1], 2), torch.tensor([1, 1]), 2)  # (0 + 2/3) / 2 = 1/3
    fields = client_fields(f1, {0: a, 1: b}, "pers", num_clients=3)
    assert fields["pers_f1_macro_clients"] == [1.0, pytest.approx(1 / 3), None]
    assert fields["pers_f1_macro_mean"] == pytest.approx(2 / 3)
    # pooled confusion [[2 0] [1 1]]: F1 class 0 = 4/5, class 1 = 2/3
    assert fields["pers_f1_macro_weighted"] == pytest.approx((0.8 + 2 / 3) / 2)
    assert fields["pers_f1_macro_worst10"] == pytest.approx(1 / 3)  # the lowest client
    assert fields["pers_f1_macro_std"] == pytest.approx(1 / 3)
    # lower is better for a loss: its worst client is the highest
    loss = METRICS["loss"]()
    worst = client_fields(loss, {0: {"loss_sum": 1.0, "n": 1}, 1: {"loss_sum": 9.0, "n": 3}}, "p")
    assert worst["p_loss_worst10"] == 3.0 and worst["p_loss_weighted"] == 10 / 4
    assert add_stats([a, b])["confusion"].tolist() == [[2, 0], [1, 1]]


def test_field_names_map_back_to_their_metric():
    assert field_metric("pers_loss_weighted").name == "loss"
    assert field_metric("val_global_ece").name == "ece"
    assert field_metric("holdout_f1_macro_worst10").name == "f1_macro"
    assert field_metric("pers_acc_mean") is None and field_metric("pers_loss_clients") is None


def test_unknown_and_unsupported_metrics_are_one_sentence():
    with pytest.raises(PflkitError, match=r"unknown metric 'f1' in eval.metrics: the registered"):
        resolve(["accuracy", "f1"])
    with pytest.raises(PflkitError, match="metric 'f1_macro' does not apply to the next_token"):
        resolve(["f1_macro"], "next_token")


# -- in a run ----------------------------------------------------------------------------------


def test_default_rows_have_no_metric_fields_beyond_accuracy(tiny, tmp_path):
    row = run_experiment(tiny(), out=tmp_path / "run").rows[-1]
    assert not [k for k in row if field_metric(k) is not None and k != "global_loss"]
    assert "global_loss" in row  # every row had it before eval.metrics


def test_chosen_metrics_in_the_row(tiny, tmp_path):
    metrics = ["accuracy", "loss", "f1_macro", "balanced_accuracy", "ece", "perplexity"]
    cfg = tiny(eval={"metrics": metrics}, data={"val_fraction": 0.1})
    row = run_experiment(cfg, out=tmp_path / "run").rows[-1]
    for key in ("loss", "f1_macro", "bal_acc", "ece", "ppl"):
        for field in ("mean", "weighted", "std", "worst10"):
            assert isinstance(row[f"pers_{key}_{field}"], float)
            assert isinstance(row[f"val_pers_{key}_{field}"], float)
        assert len(row[f"pers_{key}_clients"]) == 4
        assert isinstance(row[f"val_global_{key}"], float)
    # FedAvg scores the global model everywhere, and digits' global test set is the union of
    # the clients' test splits: pooled personalized numbers = the global model's
    for key in ("f1_macro", "bal_acc", "ece", "ppl"):
        assert row[f"pers_{key}_weighted"] == pytest.approx(row[f"global_{key}"], abs=1e-6)
    assert row["pers_loss_weighted"] == pytest.approx(row["global_loss"], abs=1e-6)
    assert row["pers_ppl_weighted"] == pytest.approx(math.exp(row["pers_loss_weighted"]))
    values = [v for v in row["pers_loss_clients"]]
    assert row["pers_loss_mean"] == pytest.approx(np.mean(values))


class TopTwo(Metric):
    """A metric registered from a test: the target among the two highest logits."""

    name, key = "top2", "top2"
    description = "top-2 accuracy"

    def stats(self, logits, target, num_classes):
        top = logits.topk(2, 1).indices
        return {"hit": int((top == target[:, None]).any(1).sum()), "n": int(target.numel())}

    def value(self, stats):
        return stats["hit"] / stats["n"] if stats["n"] else None


@pytest.fixture
def top2():
    METRICS.add(TopTwo)
    yield
    del METRICS["top2"]


def test_a_metric_registered_here_reaches_the_row(tiny, tmp_path, top2):
    row = run_experiment(tiny(eval={"metrics": ["top2"]}), out=tmp_path / "run").rows[-1]
    assert 1.0 >= row["pers_top2_weighted"] >= row["pers_acc_weighted"]
    assert row["pers_top2_weighted"] == pytest.approx(row["global_top2"], abs=1e-6)
    assert row["pers_top2_weighted"] > row["pers_acc_weighted"]  # 10 classes, a weak model


def test_run_refuses_an_unknown_metric_in_one_sentence(cli, tmp_path):
    res = cli("run", "quickstart_digits", "--set", "eval.metrics=[accuracy,f1]", cwd=tmp_path)
    assert res.returncode == 2
    assert "unknown metric 'f1' in eval.metrics: the registered metrics are accuracy" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "runs").exists()


def test_vectorized_engine_scores_the_chosen_metrics_per_client(tiny, tmp_path):
    metrics = {"metrics": ["loss", "f1_macro", "ece"]}
    rows = {
        v: run_experiment(
            tiny(eval=metrics, engine={"workers": 1, "vectorize": v}), out=tmp_path / str(v)
        ).rows[-1]
        for v in (False, True)
    }
    for key in ("pers_loss_weighted", "pers_f1_macro_mean", "pers_ece_worst10", "global_ece"):
        assert rows[True][key] == pytest.approx(rows[False][key], abs=1e-5)
