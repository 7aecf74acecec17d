"""The results page, ``pflkit report --html DIR`` (:mod:`pflkit.report.page`): its numbers
against the run folders' own files, its config diff and partition heatmap by hand, its bad
input, and the page in a real headless browser (Debian's Chromium through Selenium and
chromedriver): no console error, no network request, a header click sorts a table, the curves
hold data."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_config
from pflkit.engine.compare import run_compare
from pflkit.experiment import validate
from pflkit.report.results import Run, Setting, find_settings

pytest.importorskip("plotly")
pytest.importorskip("itables")
page = pytest.importorskip("pflkit.report.page")


@pytest.fixture(scope="module")
def cmp(tmp_path_factory) -> Path:
    """A finished compare: Local and FedAvg, seeds 0 and 1, 4 rounds on digits, with a
    validation split and eval.last (so every protocol is on the page)."""
    out = tmp_path_factory.mktemp("page") / "cmp"
    raw = tiny_config(
        train={"rounds": 4},
        data={"val_fraction": 0.2},
        eval={"last": 2},
        compare={"algorithms": ["local", "fedavg"], "seeds": [0, 1]},
    )
    run_compare(validate(raw), out, progress=False)
    return out


def _summary(cmp: Path, label: str, seed: int) -> dict:
    return json.loads((cmp / f"{label}-s{seed}" / "summary.json").read_text())


def test_the_tables_hold_every_protocol_with_the_summaries_numbers(cmp):
    settings, _ = find_settings([cmp])
    assert page.protocols(settings) == ["last", "mean_last", "val_round", "best_test"]
    frame = page.protocol_frame(settings, "last", "pers_acc_mean").set_index("setting")
    for label in ("local", "fedavg"):
        accs = 100 * np.array([_summary(cmp, label, s)["final"]["pers_acc_mean"] for s in (0, 1)])
        assert frame.loc[label, "personalized acc (%) mean"] == f"{accs.mean():.2f}"
        assert frame.loc[label, "personalized acc (%) std"] == f"{accs.std():.2f}"
        assert frame.loc[label, "seeds"] == 2
        # the same text as the markdown table's "mean ± std" cell
        [md] = [
            x for x in (cmp / "results.md").read_text().splitlines() if x.startswith(f"| {label} |")
        ]
        mean, std = md.split(" | ")[1].split(" ± ")
        assert (
            frame.loc[label, "personalized acc (%) mean"],
            frame.loc[label, "personalized acc (%) std"],
        ) == (mean, std)
    assert frame.loc["local", "global acc (%) mean"] == ""  # Local has no global model
    best = frame["personalized acc (%) mean"].astype(float).idxmax()
    assert frame.loc[best, "p vs best"] == ""
    at_val = page.protocol_frame(settings, "val_round", "pers_acc_mean").set_index("setting")
    v = [_summary(cmp, "fedavg", s)["val_round"]["pers_acc_mean"]["value"] for s in (0, 1)]
    assert at_val.loc["fedavg", "personalized acc (%) mean"] == f"{100 * np.mean(v):.2f}"
    # the fairness columns of the paper protocol
    at_best = page.protocol_frame(settings, "best_test", "pers_acc_mean")
    assert "std over clients (%) mean" in at_best.columns


def test_a_curve_is_the_mean_over_seeds_with_a_band_of_one_std(cmp):
    settings, _ = find_settings([cmp])
    fig = page.curve_figure(settings, "pers_acc_mean")
    traces = {t.name: t for t in fig.data}
    per_seed = []
    for seed in (0, 1):
        rows = [json.loads(x) for x in (cmp / f"fedavg-s{seed}" / "metrics.jsonl").open()]
        per_seed.append({r["round"]: r["pers_acc_mean"] for r in rows if "pers_acc_mean" in r})
    rounds = sorted(per_seed[0])
    values = 100 * np.array([[p[r] for r in rounds] for p in per_seed])
    line = traces["fedavg (n=2)"]
    assert list(line.x) == rounds
    np.testing.assert_allclose(line.y, values.mean(axis=0))
    band = traces["fedavg ± std"]
    n = len(rounds)
    np.testing.assert_allclose(band.y[:n], values.mean(axis=0) + values.std(axis=0))
    np.testing.assert_allclose(band.y[n:][::-1], values.mean(axis=0) - values.std(axis=0))
    assert page.curve_figure(settings, "no_such_metric") is None


def test_the_band_is_one_population_std_by_hand():
    """Three seeds (with two, std and half the min..max range coincide), one missing a round."""
    rows = [
        [{"round": 1, "pers_acc_mean": 0.1}, {"round": 2, "pers_acc_mean": 0.4}],
        [{"round": 1, "pers_acc_mean": 0.2}, {"round": 2, "pers_acc_mean": 0.5}],
        [{"round": 1, "pers_acc_mean": 0.6}],
    ]
    runs = [Run(Path("a"), "a", seed, {}, {}, r) for seed, r in enumerate(rows)]
    fig = page.curve_figure([Setting("a", runs)], "pers_acc_mean")
    band, line = fig.data
    # round 1: 10, 20, 60 -> mean 30, std sqrt(((-20)^2 + (-10)^2 + 30^2) / 3) = sqrt(1400 / 3)
    # round 2: 40, 50 -> mean 45, std 5
    s1 = (1400 / 3) ** 0.5
    assert list(line.x) == [1, 2] and line.name == "a (n=3)"
    np.testing.assert_allclose(line.y, [30, 45])
    np.testing.assert_allclose(band.x, [1, 2, 2, 1])
    np.testing.assert_allclose(band.y, [30 + s1, 50, 40, 30 - s1])


def _setting(label: str, *configs: dict) -> Setting:
    runs = [Run(Path(label), label, seed, cfg, {}) for seed, cfg in enumerate(configs)]
    return Setting(label, runs)


def test_config_diff_by_hand():
    base = {"seed": 0, "train": {"lr": 0.1, "rounds": 5}, "algorithm": {"name": "fedavg"}}
    prox = {"seed": 0, "train": {"lr": 0.1, "rounds": 5}, "algorithm": {"name": "fedprox", "mu": 1}}
    odd = {"seed": 1, "train": {"lr": 0.2, "rounds": 5}, "algorithm": {"name": "fedavg"}}
    differ, values, shared = page.config_diff(
        [_setting("fedavg", base, {**base, "seed": 1}), _setting("mix", prox, odd)]
    )
    assert differ == ["train.lr", "algorithm.name", "algorithm.mu"]
    assert values == {
        "fedavg": {"train.lr": 0.1, "algorithm.name": "fedavg", "algorithm.mu": None},
        "mix": {"train.lr": "0.1 | 0.2", "algorithm.name": '"fedprox" | "fedavg"',
                "algorithm.mu": "1 | null"},
    }  # fmt: skip
    assert shared == {"train.rounds": 5}


def test_the_heatmap_counts_each_clients_samples_per_class(cmp):
    from pflkit.data.federated import build_federated

    settings, _ = find_settings([cmp])
    [(title, drawn, note)] = page.partition_tables(settings)
    table, _ = drawn
    data = build_federated(validate(settings[0].runs[0].config).data)
    for cid, c in enumerate(data.clients):
        labels = np.concatenate([c.train_y.numpy(), c.test_y.numpy(), c.val_y.numpy()])
        np.testing.assert_array_equal(table[cid], np.bincount(labels, minlength=10))
    assert "digits, 4 clients, dirichlet(alpha=0.5)" in title
    assert note == "samples (train + test + val) per client and class"


def test_a_partition_whose_data_is_missing_is_a_note_not_a_download(cmp, tmp_path, monkeypatch):
    import urllib.request

    asked = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: asked.append(a) or 1 / 0)
    run = find_settings([cmp])[0][0].runs[0]
    config = json.loads(json.dumps(run.config))
    config["data"] |= {"dataset": "cifar10", "root": str(tmp_path / "empty"), "download": True}
    [(title, drawn, note)] = page.partition_tables([_setting("x", config)])
    assert drawn is None and "cifar10" in title
    assert asked == []  # the runs' download: true is not followed
    assert "cifar" in note.lower() and "\n" not in note


def test_report_html_writes_one_page_and_keeps_the_table_output(cli, cmp, tmp_path):
    r = cli("report", str(cmp), "--html", "page", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (cmp / "results.md").read_text()
    path = tmp_path / "page" / "report.html"
    assert f"results page: {Path('page') / 'report.html'}" in r.stderr
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.html"]
    text = path.read_text()
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\s(src|href)=", text)  # all inline
    assert "plotly.js v" in text and "_itables_" in text  # both inlined
    for at in ("last", "mean_last", "val_round", "best_test"):
        assert f'id="at-{at}"' in text


@pytest.mark.parametrize(
    "target, message",
    [
        ("afile", "--html 'afile' is a file, not a folder: give a folder to write report.html "
         "into, e.g. --html afile-page"),
        ("afile/sub", "--html 'afile/sub' lies under"),
    ],
)  # fmt: skip
def test_report_html_bad_target_is_one_sentence(cli, cmp, tmp_path, target, message):
    (tmp_path / "afile").write_text("x")
    r = cli("report", str(cmp), "--html", target, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: " + message) or message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_report_html_refuses_overhead_and_an_unwritable_place(cli, cmp, tmp_path):
    r = cli("report", str(cmp), "--overhead", "--html", "page", cwd=tmp_path)
    assert r.returncode == 2 and "drop --format, --out, --html" in r.stderr
    r = cli("report", str(cmp), "--html", "/proc/pflkit-page", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "cannot write the results page folder '/proc/pflkit-page'" in r.stderr
    assert r.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


# -- in a real browser -----------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip(
            "no Chromium and chromedriver here: apt-get install chromium chromium-driver "
            "(make install does it as root)"
        )
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1300,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(options=opts, service=service)
    yield driver
    driver.quit()


def _column(driver, table_index: int, header: str) -> list[str]:
    return driver.execute_script(
        """const t = document.querySelectorAll('table.dataTable')[arguments[0]];
        const heads = [...t.closest('.dt-container').querySelectorAll('thead th')];
        const i = heads.findIndex(h => h.textContent.trim() === arguments[1]);
        return [...t.querySelectorAll('tbody tr')].map(r => r.children[i].textContent);""",
        table_index,
        header,
    )


def test_the_page_in_chromium(browser, cmp, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    settings, _ = find_settings([cmp])
    path = page.write_page(settings, tmp_path / "page")
    browser.get(path.as_uri())
    WebDriverWait(browser, 60).until(
        lambda d: d.execute_script(
            "return document.querySelectorAll('table.dataTable').length >= 5 && "
            "document.querySelectorAll('.js-plotly-plot .main-svg').length > 0"
        )
    )
    # the curves: Plotly drew each setting's line and band
    drawn = browser.execute_script(
        """const g = document.getElementById('curve-pers_acc_mean').querySelector('.js-plotly-plot');
        return [g.data.length, g.querySelectorAll('.scatterlayer .trace path.js-line').length,
                g.data[1].y.length];"""
    )
    assert drawn[0] == 4 and drawn[1] >= 2 and drawn[2] == 4, drawn
    assert (
        browser.execute_script(
            "return document.querySelector('#partition-map .js-plotly-plot').data[0].type"
        )
        == "heatmap"
    )
    # a header click sorts the first table by that column, ascending; a second click descending
    col = "personalized acc (%) mean"
    before = [float(x) for x in _column(browser, 0, col)]
    header = browser.execute_script(
        """return [...document.querySelectorAll('table.dataTable')[0].querySelectorAll('thead th')]
        .find(h => h.textContent.trim() === arguments[0]);""",
        col,
    )
    # DataTables itself typed the column as numeric (so "10.2" sorts after "9.5")
    assert "dt-type-numeric" in header.get_attribute("class")

    def values() -> list[float]:
        return [float(x) for x in _column(browser, 0, col)]

    def ordered() -> bool:  # DataTables marks the column it orders by
        return "dt-ordering-" in (header.get_attribute("class") or "")

    def after_click(done) -> list[float]:  # the redraw may lag the click on a loaded machine
        header.click()
        WebDriverWait(browser, 30).until(lambda b: done(values()))
        return values()

    first = after_click(lambda v: ordered() and v in (sorted(before), sorted(before)[::-1]))
    second = after_click(lambda v: v == first[::-1])
    assert sorted(before) == sorted(first) and len(set(first)) == len(first) > 1
    # one click ascending, the other descending (which comes first depends on the order the
    # table starts in)
    assert {tuple(first), tuple(second)} == {tuple(sorted(first)), tuple(sorted(first)[::-1])}
    # the search box filters rows
    box = browser.find_elements(By.CSS_SELECTOR, ".dt-search input")[0]
    box.send_keys("fedavg")
    assert [r.strip() for r in _column(browser, 0, "setting")] == ["fedavg"]
    # nothing went wrong and nothing was fetched: only the file itself was requested
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
    urls = set()
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.add(message["params"]["request"]["url"])
    assert {u.split(":", 1)[0] for u in urls} <= {"file", "data", "blob"}, urls
