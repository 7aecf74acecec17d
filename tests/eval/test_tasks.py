"""Tasks (pflkit.eval.tasks): next-token prediction on the bundled python_docs corpus with the
gru_lm model, end to end with FedAvg and FedPer, and what a next-token dataset refuses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pflkit.data.federated import build_federated
from pflkit.data.sources import load_source
from pflkit.data.sources.corpus import topics, windows
from pflkit.data.sources.text import basic_english
from pflkit.engine.runner import run_experiment
from pflkit.errors import PflkitError
from pflkit.eval.metrics import METRICS, score_split
from pflkit.eval.tasks import TASKS, get_task
from pflkit.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_next_token_flattens_every_position_and_counts_tokens():
    task = get_task("next_token")
    # 1 sequence, vocabulary 3, 2 positions: argmax 2 then 0; targets 2 and 1
    logits = torch.tensor([[[0.0, 5.0], [1.0, 0.0], [4.0, 0.0]]])  # [B=1, V=3, L=2]
    flat, target = task.flat(logits, torch.tensor([[2, 1]]))
    assert flat.tolist() == [[0.0, 1.0, 4.0], [5.0, 0.0, 0.0]] and target.tolist() == [2, 1]
    acc = METRICS["accuracy"]()
    assert acc.value(acc.stats(flat, target, 3)) == 0.5  # 1 of 2 tokens, not 0 of 1 sample
    # the task's loss is the mean token cross-entropy, as F.cross_entropy on [B, V, L]
    manual = (F.cross_entropy(flat, target, reduction="none")).mean()
    assert task.loss(logits, torch.tensor([[2, 1]])) == pytest.approx(float(manual))
    assert set(TASKS) >= {"classification", "next_token"}


def test_windows_and_the_python_docs_source():
    assert windows([1, 2, 3, 4, 5, 6, 7], 2).tolist() == [[1, 2, 3], [4, 5, 6]]  # 7 dropped
    src = load_source("python_docs", seq_len=16, max_vocab=500)
    assert src.task == "next_token" and src.num_classes == 500
    assert src.train_x.shape[1] == 16 and src.train_y.shape == src.train_x.shape
    assert src.train_x.dtype == torch.float32 and src.train_y.dtype == torch.int64
    # the target is the input shifted by one position
    assert torch.equal(src.train_y[:, :-1], src.train_x[:, 1:].long())
    assert int(src.train_y.max()) < 500 and src.test_x is None
    assert len(src.group_names) == len(topics()) and len(src.train_groups) == len(src.train_x)
    # every topic gives floor(tokens / 17) windows, in topic order
    texts = list(topics().values())
    counts = [len(basic_english(t.replace("\n", " "))) // 17 for t in texts]
    assert np.bincount(src.train_groups, minlength=len(texts)).tolist() == counts


def test_gru_lm_is_causal_and_puts_the_vocabulary_at_dimension_1():
    torch.manual_seed(0)
    model = build_model("gru_lm", (6,), 20, embed=8, hidden=12)
    x = torch.randint(0, 20, (3, 6)).float()
    out = model(x)
    assert out.shape == (3, 20, 6)
    changed = x.clone()
    changed[:, 4] = (changed[:, 4] + 1) % 20
    out2 = model(changed)
    assert torch.equal(out[:, :, :4], out2[:, :, :4])  # positions before 4 do not see it
    assert not torch.equal(out[:, :, 4:], out2[:, :, 4:])
    assert sum(p.numel() for p in model.head.parameters()) == 12 * 20 + 20
    with pytest.raises(PflkitError, match="model 'gru_lm' needs token sequences"):
        build_model("gru_lm", (1, 28, 28), 10)


def tiny_lm(tiny, **sections):
    parts = {
        "data": {
            "dataset": "python_docs",
            "options": {"seq_len": 16, "max_vocab": 300},
            "subset": 800,
            "num_clients": 4,
            "partition": {"name": "iid"},
            "test_fraction": 0.2,
        },
        "model": {"name": "gru_lm", "options": {"embed": 16, "hidden": 32}},
        "train": {"rounds": 3, "batch_size": 32, "lr": 0.01, "optimizer": "adam"},
        "eval": {"metrics": ["accuracy", "loss", "perplexity", "ece"]},
    }
    return tiny(**(parts | sections))


def test_fedavg_learns_next_tokens_and_the_loss_drops(tiny, tmp_path):
    rows = run_experiment(tiny_lm(tiny), out=tmp_path / "run").rows
    losses = [r["pers_loss_weighted"] for r in rows]
    assert losses[0] > losses[1] > losses[2]
    assert [r["global_loss"] for r in rows] == pytest.approx(losses, abs=1e-5)
    last = rows[-1]
    assert last["pers_ppl_weighted"] == pytest.approx(math.exp(last["pers_loss_weighted"]))
    assert last["pers_acc_weighted"] > 1 / 300 and 0 <= last["pers_ece_weighted"] <= 1
    assert last["pers_loss_weighted"] < math.log(300)  # better than uniform over the vocabulary


def test_fedper_on_topics_as_clients(tiny, tmp_path):
    cfg = tiny_lm(
        tiny,
        algorithm={"name": "fedper"},
        data={
            "dataset": "python_docs",
            "options": {"seq_len": 16, "max_vocab": 300},
            "num_clients": 4,
            "partition": {"name": "natural"},
            "test_fraction": 0.2,
        },
    )
    rows = run_experiment(cfg, out=tmp_path / "run").rows
    assert rows[-1]["pers_loss_weighted"] < rows[0]["pers_loss_weighted"]
    assert "global_acc" not in rows[-1]  # FedPer has no global model to score


def test_score_split_of_a_sequence_model_counts_tokens():
    torch.manual_seed(1)
    model = build_model("gru_lm", (5,), 7, embed=4, hidden=4)
    x, y = torch.randint(0, 7, (9, 5)).float(), torch.randint(0, 7, (9, 5))
    acc, stats = score_split(model, x, y, 4, get_task("next_token"), 7, [METRICS["loss"]()])
    with torch.no_grad():
        logits = model(x)
    assert acc == int((logits.argmax(1) == y).sum()) / 45
    assert stats["loss"]["n"] == 45
    assert stats["loss"]["loss_sum"] / 45 == pytest.approx(float(F.cross_entropy(logits, y)))


def test_a_label_partition_of_next_token_data_is_refused(tiny):
    cfg = tiny_lm(tiny, data={"dataset": "python_docs", "partition": {"name": "dirichlet"}})
    with pytest.raises(PflkitError, match="partitioner 'dirichlet' splits by class label"):
        build_federated(cfg.data)


@pytest.mark.parametrize(
    "setting, says",
    [
        (
            "data.partition={name: dirichlet, alpha: 0.5}",
            "partitioner 'dirichlet' splits by "
            "class label, which the next_token task of dataset 'python_docs' does not have: use "
            "data.partition.name iid or natural",
        ),
        (
            "eval.metrics=[accuracy,f1_macro]",
            "metric 'f1_macro' does not apply to the "
            "next_token task of this dataset (it applies to classification): remove it from "
            "eval.metrics",
        ),
    ],
)
def test_cli_refuses_what_next_token_data_cannot_do(cli, tmp_path, setting, says):
    res = cli("run", "next_token_python_docs", "--set", setting, cwd=tmp_path)
    assert res.returncode == 2
    assert says in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.stderr and not (tmp_path / "runs").exists()
