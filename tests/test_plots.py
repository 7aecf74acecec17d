"""Tests for pflkit.report.plots."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from pflkit.report.plots import plot_class_heatmap, plot_curves, plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Check that ``path`` is a non-trivial PNG; return its (width, height)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    assert len(data) > 2000  # a real drawing, not an empty canvas
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    return width, height


@pytest.mark.parametrize("shape", [(5, 10), (100, 100), (20, 3)])
def test_class_heatmap(tmp_path, shape):
    table = np.random.default_rng(0).integers(0, 50, size=shape)
    path = tmp_path / "sub" / "heat.png"  # parent folder is created
    plot_class_heatmap(table, path, title="class counts")
    _png_size(path)


def test_class_heatmap_annotated_small_tables_differ(tmp_path):
    table = np.arange(12).reshape(3, 4)
    plot_class_heatmap(table, tmp_path / "a.png")
    plot_class_heatmap(table[:, ::-1], tmp_path / "b.png")
    assert (tmp_path / "a.png").read_bytes() != (tmp_path / "b.png").read_bytes()


def test_class_heatmap_rejects_1d(tmp_path):
    with pytest.raises(ValueError, match="2-D"):
        plot_class_heatmap(np.arange(5), tmp_path / "x.png")


def test_curves_mean_and_band(tmp_path):
    rounds = np.arange(0, 50, 5)
    curves = {
        "fedavg": [(rounds, np.linspace(0.1, 0.8, 10) + s * 0.02) for s in range(3)],
        "ditto": [(rounds, np.linspace(0.2, 0.9, 10))],
        # seeds with different rounds and a None value
        "apfl": [(np.array([0, 10, 20]), np.array([0.1, None, 0.5], dtype=object)),
                 (np.array([0, 20, 30]), np.array([0.2, 0.4, 0.6]))],
    }  # fmt: skip
    path = tmp_path / "curves.png"
    plot_curves(curves, path, ylabel="personalized accuracy", title="FMNIST")
    _png_size(path)


def test_curves_empty(tmp_path):
    plot_curves({}, tmp_path / "empty.png", ylabel="accuracy")
    plot_curves({"x": [(np.array([1, 2]), np.array([None, None]))]}, tmp_path / "none.png", "acc")
    _png_size(tmp_path / "empty.png")
    _png_size(tmp_path / "none.png")


def test_curves_length_mismatch(tmp_path):
    with pytest.raises(ValueError, match="differ in length"):
        plot_curves({"x": [(np.arange(3), np.arange(4))]}, tmp_path / "bad.png", "acc")


def test_run_with_missing_values(tmp_path):
    metrics = []
    for r in range(1, 21):
        row = {"round": r, "train_loss": 2.0 / r}
        if r % 5 == 0:  # evaluation every 5 rounds
            row.update(global_acc=0.5 + r / 100, pers_acc_mean=0.6 + r / 100)
            row["pers_acc_worst10"] = None if r == 5 else 0.3 + r / 100
        else:
            row["global_acc"] = None
        metrics.append(row)
    path = tmp_path / "run.png"
    plot_run(metrics, path)
    w, h = _png_size(path)
    assert w > h  # two panels side by side


def test_run_without_accuracy_or_empty(tmp_path):
    plot_run([{"round": 1, "train_loss": 1.0}, {"round": 2}], tmp_path / "loss_only.png")
    plot_run([], tmp_path / "empty.png")
    _png_size(tmp_path / "loss_only.png")
    _png_size(tmp_path / "empty.png")


def test_compare_plot_one_colour_per_algorithm_and_no_hidden_duplicates(tmp_path):
    from pflkit.report.plots import plot_compare

    r = np.arange(1, 6)
    same_global = [(r, r / 10)]
    curves = {
        "fedavg": {"personalized": [(r, r / 20)], "global": same_global},
        "fedavg_ft": {"personalized": [(r, r / 8)], "global": same_global},
        "local": {"personalized": [(r, r / 9), (r, r / 9 + 0.01)], "global": []},
    }
    legend = plot_compare(curves, tmp_path / "c.png", title="fmnist, 20 clients")
    assert legend == [
        "fedavg, personalized",
        "fedavg, global = fedavg_ft, global",  # drawn once, both named
        "fedavg_ft, personalized",
        "local, personalized",
    ]
    w, h = _png_size(tmp_path / "c.png")
    assert w > h


def test_heatmap_with_class_names(tmp_path):
    table = np.array([[3, 0, 1], [0, 2, 2]])
    plot_class_heatmap(table, tmp_path / "h.png", "t", class_names=["cat", "dog", "bird"])
    _png_size(tmp_path / "h.png")
