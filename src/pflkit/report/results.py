"""Finished runs, grouped into settings, as tables: what ``pflkit compare``, ``pflkit sweep``
and ``pflkit report`` write, and :func:`load_runs`'s DataFrame.

A *setting* is one algorithm with its parameters (in a sweep, one point of the grid) run over
several seeds; its label names it and its run folders are ``<label>-s<seed>``. A compare or
sweep folder lists its settings in ``plan.json``, so a report of the folder shows exactly
the table the command wrote.

Which number of a run is reported (``at``):

- ``last``: the last evaluated round (the default; what papers should report);
- ``mean_last``: the mean over the evaluated rounds among the last ``eval.last`` rounds;
- ``val_round``: the round whose validation value of the metric is highest (runs with a
  validation split, ``data.val_fraction``); each metric at the round its own validation twin
  chooses (``summary.json``'s ``val_round``);
- ``best_test``: the paper protocol of GPFL (ICCV 2023) and most pFL papers, optimistic: every
  number at the evaluated round with the best pooled personalized *test* accuracy
  (``summary.json``'s ``best_test``), plus the std and coefficient of variation of the
  per-client accuracies at that round (GPFL's Table 3). Only evaluated rounds count.

Selection (a sweep's second table): for each algorithm, the setting whose mean over seeds of the
metric's *validation* twin (``val_`` + metric, at the same ``at``) is highest is chosen, and its
test number is reported. :func:`choose` is given the validation numbers only. The setting that
is best on the test numbers is shown next to it, labelled as such: it is what most papers
report, and it overstates accuracy.

Significance: the p-value of a two-sided paired t-test over seeds of each setting against the
table's best one (same seed, same partition and client sampling: the runs pair).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pflkit.errors import PflkitError
from pflkit.report.archive import Tree, tree
from pflkit.report.summary import best_test, read_metrics

PLAN = "plan.json"
AT = ("last", "mean_last", "val_round", "best_test")
At = Literal["last", "mean_last", "val_round", "best_test"]
Select = Literal["val", "test", "none"]
METRICS = {
    "pers_acc_mean": "personalized acc (%)",
    "pers_acc_weighted": "weighted (%)",
    "pers_acc_worst10": "worst 10% (%)",
    "global_acc": "global acc (%)",
}
# more metrics --metric can compare (a column of their own when chosen): the scored clients
# that have trained / not yet (runs with partial participation or sampled evaluation) and the
# held-out clients after their personalization step (data.holdout_clients)
MORE_METRICS = {
    "pers_acc_trained": "trained clients' acc (%)",
    "pers_acc_untrained": "untrained clients' acc (%)",
    "holdout_acc_mean": "held-out acc (%)",
    "holdout_acc_weighted": "held-out weighted (%)",
    "holdout_acc_worst10": "held-out worst 10% (%)",
}
CHOOSABLE = METRICS | MORE_METRICS
# besides these, --metric takes a metric's name in pflkit.eval.metrics.METRICS (its pers_<key>
# _mean: "loss" is pers_loss_mean, "accuracy" pers_acc_mean) or one of its fields
# (pers_<key>_mean, _weighted, _worst10, global_<key>; metric_title, canonical_metric)
# the fairness columns of --at best_test (GPFL's Table 3: std [CV x 10^-2] across clients)
FAIRNESS = {"pers_acc_std": "std over clients (%)", "pers_acc_cv": "CV over clients (×100)"}
_AT_TEXT = {
    "last": "Last-round accuracy",
    "mean_last": "Accuracy averaged over the last evaluated rounds",
    "val_round": "Accuracy at the round chosen on validation",
    "best_test": "Paper protocol, optimistic (GPFL's and most pFL papers'): every number at the "
    "evaluated round with the best weighted (pooled) personalized accuracy, chosen on test "
    "data (only evaluated rounds count: with eval.every > 1, the best of those)",
}


@dataclass
class Run:
    """One finished run folder (on disk, or inside a run archive)."""

    folder: Tree
    label: str
    seed: int
    config: dict[str, Any]
    summary: dict[str, Any]
    _rows: list[dict[str, Any]] | None = field(default=None, repr=False)
    skip_corrupt: bool = False  # leave corrupt metrics lines out instead of refusing them
    skipped: list[int] = field(default_factory=list)  # their line numbers

    @property
    def algorithm(self) -> str:
        return self.summary.get("algorithm") or self.config["algorithm"]["name"]

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The run's metrics rows (read on first use)."""
        if self._rows is None:
            path = self.folder / "metrics.jsonl"
            self._rows = read_metrics(path, self.skip_corrupt, self.skipped)
        return self._rows

    def missing_rounds(self) -> int:
        """Rounds summary.json counts that metrics.jsonl lacks (a cut file, skipped lines)."""
        rounds = self.summary.get("rounds")
        return rounds - len(self.rows) if isinstance(rounds, int) else 0

    def check_rows(self) -> None:
        """Read the metrics rows now: a corrupt line, or rows out of order or fewer than the
        rounds summary.json counts, is one sentence (unless ``skip_corrupt``: the report's
        footnote then names them, :func:`corrupt_note`)."""
        rows, path = self.rows, self.folder / "metrics.jsonl"
        rounds = [r["round"] for r in rows]
        if self.skip_corrupt or (rounds == sorted(set(rounds)) and self.missing_rounds() <= 0):
            return
        raise PflkitError(
            f"metrics file '{path}' holds {len(rows)} rows for the {self.summary.get('rounds')} "
            "rounds its summary.json counts (cut, or rows out of order): restore the file "
            "from a copy, rerun the run, or pass --skip-corrupt to report what is readable "
            "(the table's footnote then says so)"
        )


@dataclass
class Setting:
    label: str
    runs: list[Run]

    @property
    def algorithm(self) -> str:
        return self.runs[0].algorithm

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]


def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path`` (a run's summary, a compare's plan), or one sentence naming
    the file when it cannot be read, is not JSON or is not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise PflkitError(
            f"cannot read the {what} '{path}' ({err.strerror or err}): restore it, or leave it out"
        ) from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise PflkitError(
            f"the {what} '{path}' is not valid JSON ({_first_line(err)}): it is damaged; "
            "restore it, or rerun what wrote it"
        ) from None
    if not isinstance(data, dict):
        raise PflkitError(
            f"the {what} '{path}' holds a JSON {type(data).__name__}, not an object: it is "
            "damaged; restore it, or rerun what wrote it"
        )
    return data


def _read_config(path: Path | Tree) -> dict[str, Any]:
    """A run folder's config.yaml as a mapping (read within the limits of any config,
    :func:`pflkit.config_io.read_yaml`; inside a run archive, :func:`pflkit.config_io.config_text`),
    or one sentence naming the file."""
    from pflkit.config_io import config_text, read_yaml

    if isinstance(path, Path):
        return read_yaml(path, "the run config", written=True)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, KeyError, UnicodeDecodeError) as err:
        raise PflkitError(f"cannot read the run config '{path}' ({err}): restore it") from None
    return config_text(text, f"the run config '{path}'", written=True)


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 120 else text[:117] + "..."


def _check_summary(path: Path, summary: dict[str, Any]) -> None:
    """The parts of a run's summary.json a report reads must be there, with numbers."""
    need = {
        "comm": ("bytes_down_per_client_round", "bytes_up_per_client_round"),
        "seconds": ("train_per_round", "eval_per_round"),
    }
    for part, keys in need.items():
        section = summary.get(part)
        if not isinstance(section, dict) or not all(
            isinstance(section.get(k), int | float) and not isinstance(section.get(k), bool)
            for k in keys
        ):
            raise PflkitError(
                f"the run summary '{path}' lacks '{part}' ({', '.join(keys)}): it was not "
                "written by pflkit or is damaged; rerun the run"
            )
    for part in ("final", "mean_last", "val_round", "best_test"):
        if part in summary and not isinstance(summary[part], dict):
            raise PflkitError(
                f"the run summary '{path}' has a '{part}' that is not an object: it is "
                "damaged; rerun the run"
            )


def _read_plan(path: Path) -> tuple[list[tuple[str, list[str]]], dict[str, Any]]:
    """A compare or sweep folder's plan.json: its settings (label, run folder names) and
    report options, or one sentence naming the file."""
    plan = read_json(path, "compare plan")
    settings, options = plan.get("settings"), plan.get("options", {})
    broken = None
    if not isinstance(settings, list) or not settings:
        broken = "no list of 'settings'"
    elif not isinstance(options, dict) or not all(
        k in ("at", "metric", "select") and isinstance(v, str) for k, v in options.items()
    ):
        broken = f"'options' other than at, metric and select names ({options!r:.60})"
    else:
        for s in settings:
            ok = isinstance(s, dict) and isinstance(s.get("label"), str)
            folders = s.get("folders") if ok else None
            if not (isinstance(folders, list) and all(isinstance(f, str) for f in folders)):
                broken = f"a setting without a 'label' and a list of 'folders' ({s!r:.60})"
                break
    if broken:
        raise PflkitError(
            f"the compare plan '{path}' has {broken}: it is damaged; rerun the compare or "
            "sweep with the same --out to rewrite it, or report its run folders directly"
        )
    return [(s["label"], s["folders"]) for s in settings], options


def load_run(
    folder: str | Path | Tree, label: str | None = None, skip_corrupt: bool = False
) -> Run:
    """A finished run folder; its label is the folder name without ``-s<seed>``. Its
    metrics.jsonl is read and checked (:meth:`Run.check_rows`; ``skip_corrupt``: corrupt
    lines are left out and counted instead)."""
    folder = tree(folder)
    if not (folder / "summary.json").is_file():
        what = (
            f"has not finished: finish it with pflkit run --resume {folder}"
            if (folder / "config.yaml").exists()
            else "is not a pflkit run folder"
        )
        raise PflkitError(f"'{folder}' {what} (no summary.json), or leave it out")
    summary = read_json(folder / "summary.json", "run summary")
    _check_summary(folder / "summary.json", summary)
    config = _read_config(folder / "config.yaml")
    seed = summary.get("seed", config.get("seed", 0))
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise PflkitError(f"the run in '{folder}' has a seed {seed!r} that is not an integer")
    if label is None:
        label = re.sub(rf"-s{seed}$", "", folder.name)
    run = Run(folder, label, seed, config, summary, skip_corrupt=skip_corrupt)
    run.check_rows()
    return run


def find_settings(
    paths: Sequence[str | Path | Sequence[str | Path]], skip_corrupt: bool = False
) -> tuple[list[Setting], dict[str, Any]]:
    """The settings of ``paths`` (run folders, or compare / sweep folders, read through their
    plan, or run archives: :mod:`pflkit.report.archive`) in order, with the options of the
    last plan read (``{}`` if none). A run whose metrics.jsonl is corrupt is refused, or with
    ``skip_corrupt`` read without the corrupt lines (:func:`load_run`). A list or tuple among
    ``paths`` (``make_report(glob(...))``) stands for its items."""
    runs: list[Run] = []
    options: dict[str, Any] = {}
    flat: list[Any] = [p for i in paths for p in (i if isinstance(i, list | tuple) else [i])]
    for path in map(tree, flat):
        if (path / PLAN).is_file():
            planned, options = _read_plan(path / PLAN)
            for label, folders in planned:
                runs += [load_run(path / f, label, skip_corrupt) for f in folders]
        elif (path / "config.yaml").exists() or (path / "summary.json").exists():
            runs.append(load_run(path, skip_corrupt=skip_corrupt))
        elif path.is_dir() and any((p / "config.yaml").exists() for p in path.iterdir()):
            inside = sorted(path.iterdir(), key=lambda p: p.name)
            runs += [
                load_run(p, skip_corrupt=skip_corrupt)
                for p in inside
                if (p / "config.yaml").exists()
            ]
        else:
            raise PflkitError(
                f"'{path}' is neither a run folder nor a folder of runs: give run folders "
                "(with summary.json) or compare / sweep folders"
            )
    if not runs:
        raise PflkitError("no runs to report: give run folders or compare / sweep folders")
    settings: dict[str, Setting] = {}
    for run in runs:
        s = settings.setdefault(run.label, Setting(run.label, []))
        if run.seed in s.seeds:
            twin = s.runs[s.seeds.index(run.seed)].folder
            raise PflkitError(
                f"two runs of '{run.label}' with seed {run.seed} ({twin} and {run.folder}): "
                "leave one of them out"
            )
        s.runs.append(run)
    for s in settings.values():
        s.runs.sort(key=lambda r: r.seed)
    return list(settings.values()), options


# -- numbers ---------------------------------------------------------------------------------------


def value(run: Run, metric: str, at: At = "last", val: bool = False) -> float | None:
    """The run's ``metric`` (its validation twin with ``val``) reported ``at``; None when the
    run does not record it (e.g. no global model)."""
    s = run.summary
    if at == "best_test":
        entry = s.get("best_test")
        if entry is None and "final" in s:  # a summary written before best_test existed
            entry = best_test([r for r in run.rows if "pers_acc_mean" in r])
        return None if entry is None else entry.get(f"val_{metric}" if val else metric)
    if at == "val_round":
        if "val_round" not in s:
            raise PflkitError(
                f"--at val_round needs runs with a validation split; '{run.folder}' has none: "
                "run with data.val_fraction > 0 (e.g. 0.1)"
            )
        entry = s["val_round"].get(metric)
        return None if entry is None else entry["val" if val else "value"]
    if at == "mean_last" and "mean_last" not in s:
        raise PflkitError(
            f"--at mean_last needs runs with eval.last > 0; '{run.folder}' has none: "
            "rerun with eval.last set (e.g. 10), or report --at last"
        )
    key = f"val_{metric}" if val else metric
    return s.get("final" if at == "last" else at, {}).get(key)


def values(setting: Setting, metric: str, at: At = "last", val: bool = False) -> dict[int, float]:
    """Seed -> the number, for the runs that record it."""
    out = {r.seed: value(r, metric, at, val) for r in setting.runs}
    return {k: v for k, v in out.items() if v is not None}


def paired_p(a: dict[int, float], b: dict[int, float]) -> float | None:
    """Two-sided paired t-test p-value of ``a`` vs ``b`` over their common seeds; None with
    fewer than two. Differences all equal: 1 when they are 0, else 0 (t is infinite)."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    d = np.array([a[s] - b[s] for s in seeds])
    if np.all(d == d[0]):
        return 1.0 if d[0] == 0 else 0.0
    from scipy import stats

    return float(stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue)


def choose(val_scores: dict[str, float], lower: bool = False) -> str | None:
    """The label with the highest validation score, or with ``lower`` the lowest (a loss; the
    first on ties; NaN, a setting without the number, never wins; None if none has it). It is
    given the validation numbers only, so test accuracy cannot influence the choice."""
    scored = {k: -v if lower else v for k, v in val_scores.items() if not math.isnan(v)}
    return max(scored, key=lambda k: scored[k]) if scored else None


def canonical_metric(metric: str) -> str:
    """The row field ``--metric`` names: a field of :data:`CHOOSABLE` or of a registered
    metric as it is, a registered metric's name as its ``pers_<key>_mean``; anything else is
    one sentence listing what it takes."""
    from pflkit.eval.metrics import METRICS as REGISTERED
    from pflkit.eval.metrics import field_metric

    if metric in CHOOSABLE or field_metric(metric) is not None:
        return metric
    if metric in REGISTERED:
        return f"pers_{REGISTERED[metric]().key}_mean"
    raise PflkitError(
        f"unknown metric {metric!r}: use a metric name ({', '.join(sorted(REGISTERED))}), one "
        f"of {', '.join(CHOOSABLE)}, or a chosen metric's field (pers_<key>_mean, "
        "pers_<key>_weighted, pers_<key>_worst10, global_<key>, e.g. pers_loss_mean)"
    )


def compare_options(metric: str) -> dict[str, str]:
    """The report options of ``pflkit compare --metric`` (checked: :func:`canonical_metric`)."""
    return {"metric": canonical_metric(metric)}


def metric_title(metric: str) -> str:
    """The column title of the row field ``metric`` (:func:`canonical_metric`)."""
    if metric in CHOOSABLE:
        return CHOOSABLE[metric]
    from pflkit.eval.metrics import field_metric, row_keys

    m = field_metric(metric)
    assert m is not None, metric
    unit = " (%)" if m.percent else ""
    return row_keys(m).get(metric, metric.replace("_", " ")) + unit


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of the row field ``metric`` is the better one (loss, ECE)."""
    from pflkit.eval.metrics import field_metric

    m = field_metric(metric)
    return m is not None and not m.higher_is_better


def percent(metric: str) -> bool:
    """Whether the row field ``metric`` is a share that tables show x 100."""
    from pflkit.eval.metrics import field_metric

    m = field_metric(metric)
    return m is None or m.percent


def _mean(v: dict[int, float]) -> float:
    return float(np.mean(list(v.values()))) if v else math.nan


def _fmt(v: dict[int, float], scale: float = 100) -> str:
    if not v:
        return "–"
    a = scale * np.array(list(v.values()))
    return f"{a.mean():.2f} ± {a.std():.2f}"


def _scale(metric: str) -> float:
    return 100 if percent(metric) else 1


def _cost(s: Setting) -> tuple[float, float]:
    """Mean bytes (down + up) per client per round, and seconds per round."""
    comm = [r.summary["comm"] for r in s.runs]
    sec = [r.summary["seconds"] for r in s.runs]
    kb = np.mean([c["bytes_down_per_client_round"] + c["bytes_up_per_client_round"] for c in comm])
    return float(kb), float(np.mean([t["train_per_round"] + t["eval_per_round"] for t in sec]))


def _has_val(settings: list[Setting]) -> bool:
    return all("val_round" in r.summary for s in settings for r in s.runs)


# -- tables ----------------------------------------------------------------------------------------


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]

    def markdown(self) -> str:
        lines = [f"## {self.title}", "", "| " + " | ".join(self.columns) + " |"]
        lines.append("|" + "---|" * len(self.columns))
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        return "\n".join(lines) + "\n"


@dataclass
class Report:
    """The tables of a set of settings, their numbers (``results.json``, CSV) and options."""

    head: str
    """The markdown heading and the paragraph saying what the numbers are."""
    tables: list[Table]
    """All settings; with ``select``, also the chosen setting per algorithm."""
    numbers: dict[str, Any]
    """Per setting label: its algorithm, seeds, per-seed numbers, p-value and cost
    (``results.json``)."""
    settings: list[Setting]
    """The settings reported, each with its runs."""
    metric: str = "pers_acc_mean"
    """The metric compared (p-values) and selected on."""

    @property
    def notes(self) -> list[str]:
        """The footnotes: corrupt metrics lines left out (:func:`corrupt_note`)."""
        note = corrupt_note(self.settings)
        return [note] if note else []

    def markdown(self) -> str:
        """The heading and the tables in markdown (``results.md``), then the footnotes."""
        text = "\n".join([self.head, *(t.markdown() for t in self.tables)])
        return text + "".join(f"\n{n}\n" for n in self.notes)

    def latex(self) -> str:
        """The tables as LaTeX ``tabular`` environments (``results.tex``, booktabs rules)."""

        def esc(text: str) -> str:
            text = text.replace("±", "PLUSMINUS").replace("–", "--").replace("×", "x")
            text = re.sub(r"([&%$#_{}])", r"\\\1", text)
            return text.replace("PLUSMINUS", "$\\pm$")

        out = []
        for t in self.tables:
            out += [f"% {t.title}", "\\begin{tabular}{l" + "r" * (len(t.columns) - 1) + "}"]
            out += ["\\toprule", " & ".join(map(esc, t.columns)) + " \\\\", "\\midrule"]
            out += [" & ".join(map(esc, r)) + " \\\\" for r in t.rows]
            out += ["\\bottomrule", "\\end{tabular}", ""]
        out += [f"% {n}" for n in self.notes]
        return "\n".join(out)

    def csv(self) -> str:
        """One line per setting and seed: every number, unrounded (fractions, not %)."""
        buf = io.StringIO()
        rows = [
            {"label": s.label, "algorithm": s.algorithm, "seed": r.seed, "run_dir": str(r.folder)}
            | run_numbers(r)
            for s in self.settings
            for r in s.runs
        ]
        keys = list(dict.fromkeys(k for row in rows for k in row))
        writer = csv.DictWriter(buf, keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()

    def write(self, out: Path) -> None:
        """results.md, results.csv, results.tex, results.json and accuracy.png in ``out``."""
        from pflkit.report.plots import plot_compare

        (out / "results.md").write_text(self.markdown())
        (out / "results.csv").write_text(self.csv())
        (out / "results.tex").write_text(self.latex())
        (out / "results.json").write_text(json.dumps(self.numbers, indent=2) + "\n")
        name = self.settings[0].runs[0].config.get("name", "experiment")
        title = f"{name}: {_setting(self.settings)}"
        plot_compare(curves(self.settings), out / "accuracy.png", title=title)


def corrupt_note(settings: list[Setting]) -> str:
    """The footnote of a report read with ``--skip-corrupt`` that left lines out ("" if
    none did): which runs, which lines, and what that changes."""
    hurt = []
    for s in settings:
        for r in s.runs:
            missing = r.missing_rounds()
            if r.skipped or missing > 0:
                lines = ", ".join(map(str, r.skipped)) or "none"
                hurt.append(
                    f"{r.folder.name} (corrupt lines {lines}; missing rounds: {max(missing, 0)})"
                )
    if not hurt:
        return ""
    return (
        f"Note (--skip-corrupt): the metrics.jsonl of {len(hurt)} run(s) had corrupt or missing "
        f"lines, left out: {'; '.join(hurt)}. The table's numbers come from each run's "
        "summary.json (written when the run finished); curves and numbers recomputed from "
        "the rows lack those rounds."
    )


def run_numbers(run: Run) -> dict[str, Any]:
    """A run's reported numbers, flat: ``final.<metric>``, ``mean_last.<metric>``,
    ``val_round.<metric>`` (and ``val_round.<metric>.round``), ``best_test.<metric>`` (and
    ``best_test.round``), cost."""
    s = run.summary
    out: dict[str, Any] = {"rounds": s.get("rounds")}
    for part in ("final", "mean_last"):
        out |= {
            f"{part}.{k}": v for k, v in s.get(part, {}).items() if k not in ("round", "rounds")
        }
    for k, e in s.get("val_round", {}).items():
        out |= {f"val_round.{k}": e["value"], f"val_round.{k}.round": e["round"]}
    out |= {f"best_test.{k}": v for k, v in s.get("best_test", {}).items()}
    kb, sec = _cost(Setting(run.label, [run]))
    return out | {"bytes_per_client_round": kb, "seconds_per_round": sec}


def curves(settings: list[Setting]) -> dict[str, dict[str, list]]:
    """Per setting, personalized and global accuracy over rounds, one curve per seed."""
    from pflkit.report.plots import _series

    return {
        s.label: {
            "personalized": [_series(r.rows, "pers_acc_mean") for r in s.runs],
            "global": [_series(r.rows, "global_acc") for r in s.runs],
        }
        for s in settings
    }


def build_report(
    settings: list[Setting],
    at: At = "last",
    metric: str = "pers_acc_mean",
    select: Select = "none",
) -> Report:
    """The tables of ``settings``: every setting (mean ± std over seeds, p-value against the
    best on ``metric``, cost; at ``best_test`` also the std and CV over clients), and with
    ``select`` the chosen setting of each algorithm."""
    metric = canonical_metric(metric)
    lower = lower_is_better(metric)
    if at not in AT:
        raise PflkitError(f"unknown --at {at!r}: use one of {', '.join(AT)}")
    if select not in ("val", "test", "none"):
        raise PflkitError(f"unknown --select {select!r}: use val, test or none")
    has_val = _has_val(settings)
    if select == "val" and not has_val:
        raise PflkitError(
            "selecting on validation needs runs with a validation split: run them with "
            "data.val_fraction > 0 (e.g. 0.1), or select on test (labelled as such)"
        )
    shown = METRICS | {metric: metric_title(metric)} | (FAIRNESS if at == "best_test" else {})
    sampled = _sampled(settings, metric, at)
    main = {s.label: values(s, metric, at) for s in settings}
    best = choose({k: _mean(v) for k, v in main.items()}, lower)
    numbers: dict[str, Any] = {}
    rows = []
    private = any("privacy" in r.summary for s in settings for r in s.runs)
    for s in settings:
        kb, sec = _cost(s)
        cols = {k: values(s, k, at) for k in shown}
        p = None if best is None or s.label == best else paired_p(main[s.label], main[best])
        numbers[s.label] = {
            "algorithm": s.algorithm,
            "seeds": s.seeds,
            "final" if at == "last" else at: {k: list(v.values()) for k, v in cols.items()},
            "p_vs_best": p,
            "bytes_per_client_round": kb,
            "seconds_per_round": sec,
        }
        cells = [s.label] + [_fmt(v, _scale(k)) for k, v in cols.items()]
        if sampled:
            se = values(s, f"{metric}_se", at)
            numbers[s.label][f"{metric}_se"] = list(se.values())
            cells.append(_fmt_se(se))
        cells.append("best" if s.label == best else ("–" if p is None else f"{p:.3f}"))
        if has_val:
            v = values(s, metric, at, val=True)
            numbers[s.label]["val_" + metric] = list(v.values())
            cells.append(_fmt(v, _scale(metric)))
        if private:  # the client-level budget spent (privacy.client_dp): equal over seeds
            spent = {(r.summary.get("privacy") or {}).get("epsilon") for r in s.runs}
            numbers[s.label]["dp_epsilon"] = sorted(spent, key=str)
            cells.append(
                ", ".join("∞ (no DP)" if e is None else f"{e:.2f}" for e in sorted(spent, key=str))
            )
        rows.append(cells + [f"{kb / 1024:.1f}", f"{sec:.2f}"])
    columns = ["setting", *shown.values()]
    if sampled:
        columns.append(f"sampling SE: {metric_title(metric)}")
    columns.append("p vs best")
    if has_val:
        columns.append(f"validation: {metric_title(metric)}")
    if private:
        columns.append("client-level ε")
    columns += ["KB / client / round", "s / round"]
    tables = [Table("All settings", columns, rows)]
    if select != "none":
        tables.append(_selection(settings, at, metric, select, numbers))
    head = _head(settings, at, metric) + (_sampling_note(settings, metric) if sampled else "")
    return Report(head, tables, numbers, settings, metric)


def _sampled(settings: list[Setting], metric: str, at: At) -> bool:
    """Whether a run of ``settings`` reports ``metric`` as an estimate from a sample of
    clients (``eval.clients: n``, or a sample of held-out clients) with a standard error."""
    return at != "val_round" and any(
        value(r, f"{metric}_se", at) is not None for s in settings for r in s.runs
    )


def _fmt_se(v: dict[int, float]) -> str:
    """The mean over seeds of a run's standard error, in %."""
    return "–" if not v else f"± {100 * float(np.mean(list(v.values()))):.2f}"


def _sampling_note(settings: list[Setting], metric: str) -> str:
    sizes = sorted(
        {
            f"{r.config.get('eval', {}).get('clients')} of "
            f"{r.config.get('data', {}).get('num_clients')}"
            for s in settings
            for r in s.runs
        }
    )
    return (
        f"\nSampled evaluation (eval.clients: {', '.join(sizes)} clients per evaluation round, "
        f"the same sample for every setting): {metric_title(metric)} is an estimate; the "
        "'sampling SE' column is its standard error within a run (finite-population "
        "corrected; the pooled accuracies' by the ratio estimator), mean over seeds, beside "
        "the ± over seeds of the other columns (docs/guide.md, Evaluation).\n"
    )


def _selection(
    settings: list[Setting], at: At, metric: str, select: Select, numbers: dict[str, Any]
) -> Table:
    """One row per algorithm: its setting chosen on validation (or, with select test, on
    test, labelled) with its test number, and the best-on-test setting next to it."""
    name, lower, scale = metric_title(metric), lower_is_better(metric), _scale(metric)
    columns = ["algorithm"]
    if select == "val":
        columns += ["chosen on validation", f"its test {name}"]
    columns += ["best on test (optimistic)", f"its test {name}"]
    rows = []
    for algo in dict.fromkeys(s.algorithm for s in settings):
        mine = [s for s in settings if s.algorithm == algo]
        picks = []
        if select == "val":
            chosen = choose({s.label: _mean(values(s, metric, at, val=True)) for s in mine}, lower)
            if chosen is not None:
                numbers[chosen]["chosen_on_validation"] = True
            picks.append(chosen)
        picks.append(choose({s.label: _mean(values(s, metric, at)) for s in mine}, lower))
        cells = [algo]
        for label in picks:
            shown = "–" if label is None else _fmt(values(_get(mine, label), metric, at), scale)
            cells += [label or "–", shown]
        rows.append(cells)
    how = "validation (val_ metrics)" if select == "val" else "test accuracy: optimistic"
    return Table(f"Selected settings, per algorithm, chosen on {how}", columns, rows)


def _get(settings: list[Setting], label: str) -> Setting:
    return next(s for s in settings if s.label == label)


def _setting(settings: list[Setting]) -> str:
    """The shared setting in one line (the plot's title): the task, partition, model, rounds."""
    c = settings[0].runs[0].config
    d, t = c.get("data", {}), c.get("train", {})
    part = d.get("partition", {})
    args = ", ".join(f"{k}={v}" for k, v in part.items() if k != "name")
    return (
        f"{d.get('dataset')}, {d.get('num_clients')} clients, partition "
        f"{part.get('name')}({args}) (id {settings[0].runs[0].summary.get('partition_id', '')}), "
        f"model {c.get('model', {}).get('name')}, {t.get('rounds')} rounds, client fraction "
        f"{t.get('client_fraction')}, {t.get('local_epochs')} local epoch(s)"
    )


def _head(settings: list[Setting], at: At, metric: str) -> str:
    c = settings[0].runs[0].config
    t = c.get("train", {})
    seeds = sorted({seed for s in settings for seed in s.seeds})
    return (
        f"# {c.get('name', 'experiment')}\n\n{_setting(settings)}, batch "
        f"{t.get('batch_size')}, lr {t.get('lr')} (unless a setting's label says otherwise); "
        f"seeds {seeds}. {_AT_TEXT[at]}, mean ± std over seeds; p: two-sided paired t-test "
        f"over seeds against the best setting on {metric_title(metric)}.\n"
    )


def make_report(
    *paths: str | Path | Sequence[str | Path], skip_corrupt: bool = False, **options: str | None
) -> Report:
    """The report of ``paths`` (run folders, compare / sweep folders, or lists of them): a
    compare or sweep folder's own options (``plan.json``), overridden by the ``options`` given
    (``at``, ``metric``, ``select``; None keeps the plan's). ``skip_corrupt``: corrupt metrics lines
    are left out and named in a footnote instead of refused (:func:`find_settings`)."""
    settings, planned = find_settings(list(paths), skip_corrupt)
    given = {k: v for k, v in options.items() if v is not None}  # "" is refused, not ignored
    return build_report(settings, **(planned | given))


def load_runs(
    *paths: str | Path | Sequence[str | Path], per_round: bool = False, skip_corrupt: bool = False
) -> Any:
    """A pandas DataFrame of finished runs (run folders or compare / sweep folders, or lists of
    them): one row per run with :func:`run_numbers`' columns, or with ``per_round`` one row per
    run and metrics row (``skip_corrupt``: see :func:`find_settings`). Needs pandas (``pip install
    'pflkit[report]'``)."""
    try:
        import pandas as pd
    except ImportError:
        raise PflkitError("load_runs needs pandas: pip install 'pflkit[report]'") from None
    settings, _ = find_settings(list(paths), skip_corrupt)
    records = []
    for s in settings:
        for r in s.runs:
            ident = {"label": s.label, "algorithm": r.algorithm, "seed": r.seed}
            ident["run_dir"] = str(r.folder)
            if per_round:
                records += [ident | row for row in r.rows]
            else:
                records.append(ident | run_numbers(r))
    return pd.DataFrame.from_records(records)
