"""pflkit against PFLlib and FL-bench in one run (issue 38): seconds per round of the same
experiment in the three libraries, interleaved round by round.

**What is measured.** The anchor setting (``benchmarks/vs_libraries.yaml``, bench_fedavg.py's
CONFIG: FedAvg, full Fashion-MNIST, 20 clients, Dirichlet(0.1), 75/25 local split, cnn4 =
PFLlib's FedAvgCNN = FL-bench's avgcnn, batch 10, one local epoch, lr 0.005, all clients every
round, evaluation every round) on exactly pflkit's partition: ``pflkit export`` writes it in
PFLlib's and FL-bench's layouts, and each reference runs its own implementation through its
own entry point (the cross-check's harness, benchmarks/crosscheck/crosscheck.py, builds the
command lines and the work copies; the checkouts are never copied into pflkit). A round is one
training round of every client and one evaluation of every client on its local test split, in
each library's own way (PFLlib's evaluation also scores the training loss on every training
split; pflkit's also scores the global model on the global test set). Per contender: seconds
per round (median over the timed rounds), seconds per training sample, the evaluation share,
the final pooled accuracy over the clients' local test splits (each library's own number), and
the ratios reference / pflkit. ``--algorithms gpfl`` (PFLlib's GPFL) and ``pfedsim``
(FL-bench's pFedSim) run the cross-check cases' options; a library without the algorithm is
skipped with a note.

**Interleaving.** Every job (PFLlib, FL-bench, one per pflkit contender) is a child process in
its own process group, and only one group computes at a time: the others are stopped
(``SIGSTOP`` to the group, confirmed from ``/proc`` for every thread of every process in it
before the next one resumes with ``SIGCONT``). First each job in turn starts up until its first
round begins (data loading, model building: untimed); then, round by round, each job in turn
runs until its log shows the round finished (PFLlib: its "time cost" line, which ends the loop
iteration that began with "Round number: r-1"; FL-bench: "TRAINING EPOCH: r+1", or its "total
running time" after the last round; pflkit: line r of the run's metrics.jsonl); last, each job
finishes untimed (PFLlib is stopped once it has printed its round-N evaluation: its loop would
train one more round). So machine noise hits all alike. Every child is killed on exit, error,
Ctrl-C, SIGTERM or SIGHUP; a child whose parent dies is killed by the kernel
(``PR_SET_PDEATHSIG``), and a stopped group left behind is hung up by it (an orphaned process
group with stopped members gets SIGHUP and SIGCONT). Linux only (``/proc``).

**Round times.** A library's own per-round time where it logs one: PFLlib's "time cost" (its
loop iteration: evaluation, then training), pflkit's ``seconds_train + seconds_eval``. Both
are wall-clock times, so a round whose clock was already running when the job was stopped
also counts the other jobs' turns: where the logged time exceeds the job's own turn by more
than half of the pause before it, that pause is subtracted (a logged time is at most the turn
plus a poll interval otherwise, and pauses last a whole round of another library). FL-bench
logs no per-round time (only, at the end, the mean of its training calls), so its round is the
wall time of its turn (resume to the round's line seen, polled every 20 ms). The turn times of
every job are reported too. Evaluation share: pflkit's ``seconds_eval``; PFLlib's from the
arrival times of its lines "Round number" and "Std Test AUC"; FL-bench's from its last client
line of the round to the round's end (its test of every client, and the aggregation).

**Threads.** The references run with one torch thread each (``OMP_NUM_THREADS=1``, as the
cross-check runs them); pflkit's default contender with pflkit's defaults (``engine.workers:
auto``: one worker process per core with one torch thread each, and one thread in the server
process; the numbers are read from the run's provenance.json); ``--pflkit-workers 1,2`` adds
contenders with that many workers (1: in-process), ``--pflkit-threads N`` in-process ones with
``threads: N``, ``--pflkit-vectorize 1,8`` ones with ``engine.vectorize: true`` and that many
workers, ``--pflkit-graphs 1,8`` those with ``engine.cuda_graphs: true`` too (issue 56; cuda).

**Goal** (issue 38): pflkit's default round at least 2x faster than PFLlib's and 1.7x faster
than FL-bench's on 2 CPU cores; on a GPU at least 5x faster than PFLlib's.

    python benchmarks/vs_libraries.py --pfllib ~/refs/PFLlib --flbench ~/refs/FL-bench \\
        --python ~/refenv/bin/python --rounds 3 --out runs/vs
    python benchmarks/vs_libraries.py ... --algorithms fedavg,gpfl,pfedsim --pflkit-workers 1

Writes ``--out``/vs_libraries.json (every turn, round and number) and prints a markdown table;
the runs' logs and folders stay in ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pickle
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "crosscheck"))
import crosscheck as xc  # noqa: E402
from cases import CASES  # noqa: E402

ANCHOR = HERE / "vs_libraries.yaml"
LIBRARIES = {"pfllib": "PFLlib", "flbench": "FL-bench"}
# algorithm -> the cross-check case of each library that has it (cases.py: the reference's
# name and arguments, pflkit's options)
ALGORITHMS: dict[str, dict[str, str]] = {
    "fedavg": {"pfllib": "fedavg", "flbench": "fedavg-flbench", "pflkit": "fedavg"},
    "gpfl": {"pfllib": "gpfl", "pflkit": "gpfl"},
    "pfedsim": {"flbench": "pfedsim", "pflkit": "pfedsim"},
}
GOALS = {"cpu": {"pfllib": 2.0, "flbench": 1.7}, "cuda": {"pfllib": 5.0}}
POLL = 0.02  # seconds between two looks at a running job's log
REF_MODULES = {"pfllib": ("torch", "h5py"), "flbench": ("torch", "hydra")}


class Usage(Exception):
    """A bad argument: one sentence, exit code 2."""


class JobFailed(RuntimeError):
    """A child exited, failed or ran past its turn's time limit (one sentence, its log)."""


# ---------------------------------------------------------------- the libraries' logs

Line = tuple[float, str]  # (time.monotonic() when the scheduler saw it, the line)

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# PFLlib: system/flcore/servers/serveravg.py (and servergpfl.py) train():
#   print(f"\n-------------Round number: {i}-------------")     before evaluating round i
#   print('-'*25, 'time cost', '-'*25, self.Budget[-1])           after training round i + 1
# serverbase.py evaluate() ends with print("Std Test AUC: {:.4f}".format(...))
_PFL_ROUND = xc._ROUND
_PFL_COST = re.compile(r"-+ time cost -+ ([0-9.eE+-]+)\s*$")
_PFL_EVAL_END = re.compile(r"^Std Test AUC: ")
# FL-bench: src/server/fedavg.py train() (and pfedsim.py) with common.verbose_gap=1:
#   self.logger.log("-" * 28, f"TRAINING EPOCH: {E + 1}", "-" * 28)   before training round E+1
#   then one "client [i] (testset) ..." line per trained client (src/utils/trainer.py), then the
#   test of every client; run_experiment() logs "<name>'s total running time: ..." after the
#   last round. Rich pads each line with spaces to the console's width.
_FLB_EPOCH = re.compile(r"-+ TRAINING EPOCH: (\d+) -+")
_FLB_CLIENT = re.compile(r"^client \[\d+\]")
_FLB_END = re.compile(r"'s total running time: ")


@dataclass
class Progress:
    """What a job's log says so far. ``rounds``: one dict per finished round, in order:
    ``seen`` (when the round's closing line was seen), ``logged`` (the library's own seconds for
    the round, or None), ``logged_eval`` (its own evaluation seconds, or None), ``eval_lines``
    ((first, last) time of the evaluation's lines, or None)."""

    started: bool = False  # the first round has begun: the startup is over
    rounds: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # everything the benchmark needs is in the log (the final evaluation)


def pfllib_progress(lines: list[Line], rounds: int) -> Progress:
    """PFLlib's main.py output (``-eg 1``): round r (pflkit's count: r-th training) ends with
    the r-th "time cost" line, the loop iteration that evaluated round r - 1 and trained round r;
    done once round ``rounds`` is evaluated."""
    p = Progress()
    evaluating: int | None = None  # the "Round number" whose evaluation is being printed
    first: float | None = None
    last: float | None = None
    for t, line in lines:
        if m := _PFL_ROUND.search(line):
            p.started = True
            evaluating, first, last = int(m.group(1)), t, None
        elif _PFL_EVAL_END.search(line) and evaluating is not None:
            last = t
            if evaluating == rounds:
                p.done = True
        elif (m := _PFL_COST.search(line)) and p.started:
            evals = (first, last) if first is not None and last is not None else None
            p.rounds.append(
                {"seen": t, "logged": float(m.group(1)), "logged_eval": None, "eval_lines": evals}
            )
            first = last = None
    return p


def flbench_progress(lines: list[Line], rounds: int) -> Progress:
    """FL-bench's main.py output with ``common.verbose_gap=1``: round r ends when "TRAINING
    EPOCH: r+1" (or, after the last round, "total running time") is seen; its evaluation runs
    from the round's last client line to that line. Done when the process has exited (its
    results JSON closes the log)."""
    p = Progress()
    last_client: float | None = None
    for t, line in lines:
        if m := _FLB_EPOCH.search(line):
            epoch = int(m.group(1))
            p.started = True
            if epoch > 1 and len(p.rounds) == epoch - 2:
                p.rounds.append(_flb_round(t, last_client))
            last_client = None
        elif _FLB_CLIENT.search(line):
            last_client = t
        elif _FLB_END.search(line) and p.started and len(p.rounds) == rounds - 1:
            p.rounds.append(_flb_round(t, last_client))
    return p


def _flb_round(t: float, last_client: float | None) -> dict[str, Any]:
    evals = (last_client, t) if last_client is not None else None
    return {"seen": t, "logged": None, "logged_eval": None, "eval_lines": evals}


def pflkit_progress(lines: list[Line], started: bool) -> Progress:
    """A pflkit run: ``started`` once its provenance.json is written (right before round 1);
    round r ends with line r of metrics.jsonl, whose ``seconds_train + seconds_eval`` is the
    round's own time. Done when the process has exited (summary.json written)."""
    p = Progress(started=started)
    for t, line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        p.rounds.append(
            {
                "seen": t,
                "logged": row["seconds_train"] + row["seconds_eval"],
                "logged_eval": row["seconds_eval"],
                "eval_lines": None,
                "accuracy": row.get("pers_acc_weighted"),
            }
        )
    return p


def unpaused(logged: float | None, wall: float, pause: float) -> float | None:
    """A library's own round time without the pause it may span. Its clock is wall time: when
    it was already running as the job was stopped (PFLlib starts the next iteration's clock
    right after printing the line that ends a turn), the logged time is the pause plus about
    the turn; otherwise at most the turn. A logged time above the turn by more than half the
    pause therefore spans it, and the pause is subtracted."""
    if logged is None:
        return None
    return logged - pause if logged > wall + pause / 2 else logged


# ---------------------------------------------------------------- the jobs and the scheduler


def _tail(path: Path, state: dict) -> list[str]:
    """The complete lines added to ``path`` since the last call (``state`` keeps the offset
    and a partial last line)."""
    try:
        with open(path, "rb") as f:
            f.seek(state.get("offset", 0))
            data = f.read()
    except FileNotFoundError:
        return []
    state["offset"] = state.get("offset", 0) + len(data)
    *lines, state["rest"] = (state.get("rest", b"") + data).split(b"\n")
    return [_ANSI.sub("", x.decode("utf-8", "replace")).rstrip("\r ") for x in lines]


@dataclass
class Job:
    """One child process and what its log says. ``kind``: pfllib, flbench or pflkit (which
    parser reads ``watch``); ``ready``: a file whose existence ends the startup (pflkit's
    provenance.json; the references' logs say it themselves)."""

    name: str
    kind: str
    cmd: list[str]
    cwd: Path
    env: dict[str, str]
    log: Path
    watch: Path
    rounds: int
    ready: Path | None = None
    proc: subprocess.Popen | None = None
    lines: list[Line] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    _tail: dict = field(default_factory=dict)

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as f:
            f.write(" ".join(self.cmd) + "\n")
            f.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                preexec_fn=_child_setup,
            )

    def read(self) -> None:
        now = time.monotonic()
        self.lines += [(now, x) for x in _tail(self.watch, self._tail)]

    def progress(self) -> Progress:
        if self.kind == "pfllib":
            return pfllib_progress(self.lines, self.rounds)
        if self.kind == "flbench":
            return flbench_progress(self.lines, self.rounds)
        return pflkit_progress(self.lines, self.ready is not None and self.ready.exists())

    def pause(self) -> None:
        """Stop every process of the job's group and wait until every thread has stopped."""
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        wait_stopped(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL to the whole group (stopped or not; grandchildren included), then reap."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the try/finally clauses still kill the group
    _prctl = None


def _child_setup() -> None:
    """In the child, before exec: its own process group (stopped and killed as one), and
    SIGKILL when the parent dies."""
    os.setpgid(0, 0)
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def group_threads(pgid: int) -> list[tuple[int, str]]:
    """(thread id, state) of every thread of every process in process group ``pgid``
    (/proc/<pid>/task/<tid>/stat: the state after the command name, the group 3 fields on)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:
                continue
            for task in (proc / "task").iterdir():
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                out.append((int(task.name), state))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return out


def wait_stopped(pgid: int, timeout: float = 30.0) -> None:
    """Return once no thread of group ``pgid`` can run (stopped, traced, zombie or dead)."""
    deadline = time.monotonic() + timeout
    while any(state not in "TtZX" for _, state in group_threads(pgid)):
        if time.monotonic() > deadline:
            raise JobFailed(f"process group {pgid} did not stop within {timeout:.0f} s")
        time.sleep(0.001)


def turn(
    job: Job,
    label: str | int,
    until: Callable[[Progress], bool],
    final: bool = False,
    timeout: float = 3600.0,
    poll: float = POLL,
) -> None:
    """Let ``job`` (alone) compute until its log satisfies ``until``, then stop it (or, in the
    ``final`` turn, let it exit; a final turn also ends when the process exits with 0). The
    turn's times (monotonic clock) go to ``job.turns``."""
    cont = time.monotonic()
    if job.proc is None:
        job.start()
    else:
        job.resume()
    assert job.proc is not None
    while True:
        job.read()
        if until(job.progress()):
            break
        rc = job.proc.poll()
        if rc is not None:
            job.read()
            if until(job.progress()) or (final and rc == 0):
                break
            what = "startup" if label == "startup" else f"round {label}"
            raise JobFailed(
                f"{job.name} exited with code {rc} during its {what} turn; see {job.log}"
            )
        if time.monotonic() - cont > timeout:
            raise JobFailed(
                f"{job.name} did not finish its turn ({label}) within {timeout:.0f} s; "
                f"see {job.log}"
            )
        time.sleep(poll)
    seen = time.monotonic()
    if final:
        job.kill()  # PFLlib would train one more round; the others have exited already
    else:
        job.pause()
    job.turns.append({"label": label, "cont": cont, "seen": seen, "stopped": time.monotonic()})


def interleave(
    jobs: list[Job],
    rounds: int,
    on_turn: Callable[[Job, str | int], None] | None = None,
    timeout: float = 3600.0,
    poll: float = POLL,
) -> None:
    """Startups one after the other, then rounds 1..``rounds`` round-robin, then every job's
    final turn; one job computes at a time. Every child is killed when this returns or
    raises (Ctrl-C included)."""
    try:
        plan: list[tuple[str | int, Callable[[Progress], bool], bool]] = [
            ("startup", lambda p: p.started, False)
        ]
        plan += [(r, lambda p, r=r: len(p.rounds) >= r, False) for r in range(1, rounds + 1)]
        plan.append(("final", lambda p: p.done, True))
        for label, until, final in plan:
            for job in jobs:
                turn(job, label, until, final=final, timeout=timeout, poll=poll)
                if on_turn is not None:
                    on_turn(job, label)
    finally:
        for job in jobs:
            job.kill()


# ---------------------------------------------------------------- the numbers


def rounds_of(job: Job) -> list[dict[str, Any]]:
    """Per timed round: the turn's wall time, the pause before it, the library's logged time,
    that time without the pause (``own``), the evaluation seconds, and the round's seconds
    (``own`` where the library logs one, else the turn's wall time)."""
    progress = job.progress()
    by_label = {t["label"]: t for t in job.turns}
    prev = by_label["startup"]
    out = []
    for r in range(1, job.rounds + 1):
        t, info = by_label[r], progress.rounds[r - 1]
        wall = t["seen"] - t["cont"]
        pause = t["cont"] - prev["seen"]
        own = unpaused(info["logged"], wall, pause)
        if info["logged_eval"] is not None:
            ev = info["logged_eval"]
        elif info["eval_lines"] is not None:
            ev = info["eval_lines"][1] - max(info["eval_lines"][0], t["cont"])
        else:
            ev = None
        out.append(
            {
                "round": r,
                "wall": wall,
                "pause_before": pause,
                "logged": info["logged"],
                "own": own,
                "seconds": own if own is not None else wall,
                "eval": ev,
            }
        )
        prev = t
    return out


def summary(job: Job, samples: int, accuracy: float | None) -> dict[str, Any]:
    rows = rounds_of(job)
    med = statistics.median(r["seconds"] for r in rows)
    evals = [r["eval"] for r in rows if r["eval"] is not None]
    start = next(t for t in job.turns if t["label"] == "startup")
    return {
        "seconds_per_round": med,
        "source": "own log" if rows[0]["own"] is not None else "turn wall time",
        "turn_wall_per_round": statistics.median(r["wall"] for r in rows),
        "eval_share": statistics.median(evals) / med if len(evals) == len(rows) else None,
        "samples_per_round": samples,
        "seconds_per_sample": med / samples if samples else None,
        "final_accuracy": accuracy,
        "startup_seconds": start["seen"] - start["cont"],
        "rounds": rows,
    }


def train_samples(out: Path, cfg: dict) -> list[int]:
    """Each client's training-split size, from the export (PFLlib's config.json, else
    FL-bench's partition.pkl)."""
    for p in (out / "pfllib" / "dataset").glob("*/config.json"):
        if p.parent.name.endswith(xc.data_key(cfg)):
            return json.loads(p.read_text())["num_samples"]["train"]
    name = "fmnist" if cfg["data"]["dataset"] == "fashion_mnist" else "mnist"
    pkl = out / f"flbench-{xc.data_key(cfg)}" / "data" / name / "partition.pkl"
    with open(pkl, "rb") as f:
        return [len(c["train"]) for c in pickle.load(f)["data_indices"]]


# ---------------------------------------------------------------- building the jobs


@dataclass
class Contender:
    key: str  # pfllib, flbench, pflkit, pflkit-w2
    library: str  # pfllib, flbench, pflkit
    label: str  # the table's name
    implementation: str
    threads: str
    job: Job
    run_dir: Path | None = None


def reference_env() -> dict[str, str]:
    return {**xc._one_thread(), "PYTHONUNBUFFERED": "1"}


def build(
    alg: str, args: argparse.Namespace, cfg_path: Path, cfg: dict, work: Path
) -> tuple[list[Contender], list[str]]:
    """The contenders of ``alg`` (references first, then pflkit's) and the notes on skipped
    libraries."""
    cases, notes, out = ALGORITHMS[alg], [], []
    work.mkdir(parents=True, exist_ok=True)
    refs = {"pfllib": args.pfllib, "flbench": args.flbench}
    rounds = cfg["train"]["rounds"]
    for lib, nice in LIBRARIES.items():
        if lib not in cases:
            notes.append(f"{nice} has no {alg}: skipped")
            continue
        if refs[lib] is None:
            notes.append(f"{nice} skipped: no --{lib} given")
            continue
        case = CASES[cases[lib]]
        if lib == "pfllib":
            name = xc.prepare_pfllib(cfg_path, cfg, refs[lib], args.out)
            cmd = [args.python, "-u", *xc.pfllib_command(case, cfg, name, 1, args.device)]
            cwd = args.out / "pfllib" / "system"
        else:
            cwd = xc.prepare_flbench(cfg_path, cfg, refs[lib], args.out)
            use_cuda = args.device == "cuda"
            cmd = [args.python, *xc.flbench_command(case, cfg, 0, 1, use_cuda)]
        log = work / f"{lib}.log"
        job = Job(nice, lib, cmd, cwd, reference_env(), log, log, rounds)
        impl = f"{nice} {case.ref_name} {' '.join(case.ref_args)}".strip()
        out.append(
            Contender(
                lib,
                lib,
                nice,
                f"{impl} ({xc.commit(refs[lib])})",
                "1 torch thread (OMP_NUM_THREADS=1, as the cross-check)",
                job,
            )
        )
    if len(out) == 0:
        raise Usage(
            f"no reference library runs {alg}: give "
            + " or ".join(f"--{lib}" for lib in LIBRARIES if lib in cases)
        )
    case = CASES[cases["pflkit"]]
    base = xc.pflkit_config(case, yaml.safe_load(cfg_path.read_text()), 1)
    base["name"] = f"vs-{alg}"
    base.pop("compare")
    variants: list[tuple[str, str, dict]] = [("pflkit", "pflkit (default engine)", {})]
    variants += [
        (f"pflkit-w{w}", f"pflkit workers={w}", {"engine": {"workers": w}})
        for w in args.pflkit_workers
    ]
    variants += [
        (f"pflkit-t{t}", f"pflkit threads={t}", {"threads": t}) for t in args.pflkit_threads
    ]
    variants += [
        (
            f"pflkit-v{w}",
            f"pflkit vectorised workers={w}",
            {"engine": {"workers": w, "vectorize": True}},
        )
        for w in args.pflkit_vectorize
    ]
    variants += [
        (
            f"pflkit-g{w}",
            f"pflkit vectorised, CUDA graphs, workers={w}",
            {"engine": {"workers": w, "vectorize": True, "cuda_graphs": True}},
        )
        for w in args.pflkit_graphs
    ]
    for key, label, extra in variants:
        raw = {**base, **extra}
        path = work / f"{key}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        run_dir = work / key
        cmd = [sys.executable, "-m", "pflkit", "run", str(path), "--out", str(run_dir), "-q"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log = work / f"{key}.log"
        job = Job(key, "pflkit", cmd, Path.cwd(), env, log, run_dir / "metrics.jsonl", rounds)
        job.ready = run_dir / "provenance.json"
        opts = ", ".join(f"{k}={v}" for k, v in case.pflkit.items() if k != "name")
        out.append(
            Contender(key, "pflkit", label, f"pflkit {case.pflkit['name']} {opts}".strip(), "", job)
        )
        out[-1].run_dir = run_dir
    return out, notes


def pflkit_threads(c: Contender) -> str:
    """The thread counts of a pflkit contender, from its run's provenance.json and config."""
    prov = json.loads((c.run_dir / "provenance.json").read_text())
    prov = prov[-1] if isinstance(prov, list) else prov
    main = prov["machine"]["torch_threads"]
    resolved = yaml.safe_load((c.run_dir / "config.yaml").read_text())
    w = resolved["engine"]["workers"]
    if w == "auto":
        from pflkit.engine.clients import auto_workers
        from pflkit.experiment import validate

        w = auto_workers(validate(resolved))
    if w == 1:
        how = "torch's default" if resolved.get("threads") is None else "config threads"
        return f"{main} torch thread(s) ({how}), in-process (engine.workers 1)"
    per = resolved["engine"]["threads_per_worker"]
    return f"{w} worker processes x {per} torch thread(s), server process {main} threads"


def accuracy(c: Contender, rounds: int) -> float | None:
    """The contender's pooled accuracy after round ``rounds``, from its own log."""
    if c.library == "pflkit":
        rows = c.job.progress().rounds
        return rows[rounds - 1].get("accuracy") if len(rows) >= rounds else None
    text = c.job.log.read_text(errors="replace")
    if c.library == "pfllib":
        curves = xc.parse_pfllib(text)
        return curves[0].get(rounds) if curves else None
    return xc.parse_flbench(text).get(rounds)


# ---------------------------------------------------------------- report


def table(results: dict[str, Any], device: str) -> str:
    lines = []
    for alg, res in results.items():
        lines += [
            f"### {alg}: {res['rounds']} rounds, {res['timed_on']}",
            "",
            "| contender | implementation | threads | s/round (median) | from | turn wall "
            "s/round | µs per training sample | eval share | final accuracy (%) |",
            "|---|---|---|---:|---|---:|---:|---:|---:|",
        ]
        for c in res["contenders"]:
            share = "-" if c["eval_share"] is None else f"{c['eval_share']:.1%}"
            acc = "-" if c["final_accuracy"] is None else f"{100 * c['final_accuracy']:.2f}"
            per = "-" if c["seconds_per_sample"] is None else f"{1e6 * c['seconds_per_sample']:.0f}"
            lines.append(
                f"| {c['label']} | {c['implementation']} | {c['threads']} | "
                f"{c['seconds_per_round']:.2f} | {c['source']} | {c['turn_wall_per_round']:.2f} | "
                f"{per} | {share} | {acc} |"
            )
        if res["ratios"]:
            refs = [lib for lib in LIBRARIES if any(r["reference"] == lib for r in res["ratios"])]
            goals = GOALS.get(device, {})
            head = [
                f"{LIBRARIES[r]} / pflkit" + (f" (goal >= {goals[r]}x)" if r in goals else "")
                for r in refs
            ]
            lines += ["", "| pflkit contender | " + " | ".join(head) + " |"]
            lines.append("|---|" + "---:|" * len(refs))
            for label in dict.fromkeys(r["pflkit"] for r in res["ratios"]):
                cells = [
                    f"{r['ratio']:.2f}x"
                    for ref in refs
                    for r in res["ratios"]
                    if r["pflkit"] == label and r["reference"] == ref
                ]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += [f"- {n}" for n in res["notes"]] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one sentence, exit 2 (argparse prints usage too)
        raise Usage(f"{message} (see --help)")


def _counts(value: str, flag: str, what: str, example: str) -> list[int]:
    """A comma-separated list of positive counts, without repeats; one sentence if not."""
    try:
        counts = [int(c) for c in value.split(",") if c]
    except ValueError:
        counts = [0]
    if any(c < 1 for c in counts):
        raise Usage(f"{flag} {value!r}: give {what} counts, e.g. {example}")
    return list(dict.fromkeys(counts))


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pfllib", type=Path, help="a PFLlib checkout (TsingZ0/PFLlib)")
    ap.add_argument("--flbench", type=Path, help="an FL-bench checkout (KarhouTam/FL-bench)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the references")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    ap.add_argument(
        "--algorithms", default="fedavg", help=f"comma-separated, of {', '.join(ALGORITHMS)}"
    )
    ap.add_argument("--out", type=Path, required=True, help="a new folder for runs and results")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--subset", type=int, help="train on a Fashion-MNIST subset (smoke runs)")
    ap.add_argument(
        "--pflkit-workers", default="", help="more pflkit contenders: engine.workers, e.g. 2"
    )
    ap.add_argument(
        "--pflkit-threads",
        default="",
        help="more pflkit contenders: in-process with this many torch threads, e.g. 1",
    )
    ap.add_argument(
        "--pflkit-vectorize",
        default="",
        help="more pflkit contenders: engine.vectorize true with this many workers, e.g. 1,8",
    )
    ap.add_argument(
        "--pflkit-graphs",
        default="",
        help="more pflkit contenders: --pflkit-vectorize's with engine.cuda_graphs true (cuda)",
    )
    ap.add_argument(
        "--turn-timeout", type=float, default=3600.0, help="seconds a turn may take (3600)"
    )
    args = ap.parse_args(argv)
    algs = [a for a in args.algorithms.split(",") if a]
    if not algs or (unknown := [a for a in algs if a not in ALGORITHMS]):
        raise Usage(
            f"--algorithms {args.algorithms!r}: unknown algorithm "
            f"{', '.join(unknown) if algs else '(none given)'}; choose from {', '.join(ALGORITHMS)}"
        )
    args.algorithms = list(dict.fromkeys(algs))
    if args.rounds < 1:
        raise Usage(f"--rounds {args.rounds}: give at least 1 timed round")
    if args.subset is not None and args.subset < 1:
        raise Usage(f"--subset {args.subset}: give a positive number of training images")
    args.pflkit_workers = _counts(args.pflkit_workers, "--pflkit-workers", "worker", "1,2")
    args.pflkit_threads = _counts(args.pflkit_threads, "--pflkit-threads", "thread", "1")
    args.pflkit_vectorize = _counts(args.pflkit_vectorize, "--pflkit-vectorize", "worker", "1,8")
    args.pflkit_graphs = _counts(args.pflkit_graphs, "--pflkit-graphs", "worker", "1,8")
    if args.device not in ("cpu", "cuda"):
        raise Usage(f"--device {args.device!r}: choose cpu or cuda")
    if args.pflkit_graphs and args.device != "cuda":
        raise Usage("--pflkit-graphs: CUDA graphs need --device cuda")
    if args.turn_timeout <= 0:
        raise Usage(f"--turn-timeout {args.turn_timeout}: give a positive number of seconds")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise Usage(f"--out {args.out} exists and is not an empty folder: choose a new folder")
    needed = {lib for a in args.algorithms for lib in ALGORITHMS[a] if lib in LIBRARIES}
    for lib in sorted(needed):
        path = getattr(args, lib)
        if path is None:
            continue
        # what crosscheck.prepare_pfllib / prepare_flbench copy and run
        markers = ["system/main.py"] if lib == "pfllib" else ["main.py", "src/server/fedavg.py"]
        if missing := [m for m in markers if not (path / m).is_file()]:
            an = "an" if lib == "flbench" else "a"
            raise Usage(
                f"--{lib} {path} is not {an} {LIBRARIES[lib]} checkout (no {missing[0]}): "
                f"give the folder of {an} {LIBRARIES[lib]} clone"
            )
    for alg in args.algorithms:
        libs = sorted(lib for lib in ALGORITHMS[alg] if lib in LIBRARIES)
        if all(getattr(args, lib) is None for lib in libs):
            raise Usage(
                f"no reference library to compare {alg} with: give "
                f"{' and/or '.join('--' + lib for lib in libs)} (a checkout)"
            )
    running = sorted(lib for lib in needed if getattr(args, lib) is not None)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise Usage("--device cuda: this machine's torch sees no CUDA device; use --device cpu")
    modules = sorted({m for lib in running for m in REF_MODULES[lib]})
    try:
        r = subprocess.run(
            [args.python, "-c", f"import {', '.join(modules)}"],
            capture_output=True,
            timeout=300,
            check=False,
        )
        ok = r.returncode == 0
    except OSError:
        ok = False
    if not ok:
        raise Usage(
            f"--python {args.python} cannot import {', '.join(modules)}: give the interpreter "
            "of the reference libraries' environment"
        )
    return args


def anchor(args: argparse.Namespace) -> tuple[dict, dict]:
    """(the config as written, the same with every default filled in) for ``args``; a value
    pflkit refuses (a --subset too small for 20 clients, ...) is a Usage error."""
    from pflkit.errors import PflkitError
    from pflkit.experiment import validate

    raw = yaml.safe_load(ANCHOR.read_text())
    raw["train"]["rounds"] = args.rounds
    raw["device"] = args.device
    if args.subset is not None:
        raw["data"]["subset"] = args.subset
    try:
        full = validate(raw).dump()
    except (PflkitError, ValueError) as err:
        raise Usage(f"the anchor config with these options is refused: {err}") from None
    return raw, full


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        raw, cfg = anchor(args)
    except (Usage, xc.Usage) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    cfg_path = args.out / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in saved:  # the finally clauses then kill every child
        signal.signal(s, _interrupt)
    try:
        results = {alg: run_algorithm(alg, args, cfg_path, cfg) for alg in args.algorithms}
    except (Usage, xc.Usage) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except JobFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(
            f"error: {' '.join(map(str, e.cmd[:5]))} ... failed (exit {e.returncode})",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: every job was killed; their logs are in {args.out}", file=sys.stderr)
        return 130
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": ["python", "benchmarks/vs_libraries.py", *(argv or sys.argv[1:])],
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "device": args.device,
        },
        "config": raw,
        "algorithms": results,
    }
    tmp = args.out / "vs_libraries.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, args.out / "vs_libraries.json")
    print(table(results, args.device))
    print(f"raw numbers: {args.out / 'vs_libraries.json'}")
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_algorithm(alg: str, args: argparse.Namespace, cfg_path: Path, cfg: dict) -> dict:
    work = args.out / alg
    contenders, notes = build(alg, args, cfg_path, cfg, work)
    for n in notes:
        print(f"{alg}: {n}", flush=True)
    sizes = train_samples(args.out, cfg)
    batch = cfg["train"]["batch_size"]
    load = os.getloadavg()[0]
    print(
        f"{alg}: {', '.join(c.label for c in contenders)} interleaved, {args.rounds} timed "
        f"rounds, {sum(sizes)} training samples a round; load average {load:.2f}",
        flush=True,
    )

    def said(job: Job, label: str | int) -> None:
        t = job.turns[-1]
        what = "started" if label == "startup" else f"round {label}"
        if label != "final":
            print(f"  {job.name}: {what} in {t['seen'] - t['cont']:.1f} s", flush=True)

    interleave([c.job for c in contenders], args.rounds, said, timeout=args.turn_timeout)
    rows, times = [], {}
    for c in contenders:
        # PFLlib's DataLoader drops each epoch's short last batch (clientbase.py line 59)
        n = sum(s - s % batch for s in sizes) if c.library == "pfllib" else sum(sizes)
        s = summary(c.job, n, accuracy(c, args.rounds))
        threads = c.threads or pflkit_threads(c)
        rows.append(
            {
                "key": c.key,
                "library": c.library,
                "label": c.label,
                "implementation": c.implementation,
                "threads": threads,
                "command": c.job.cmd,
                "log": str(c.job.log),
                **s,
            }
        )
        times[c.key] = s["seconds_per_round"]
    ratios = [
        {
            "pflkit": p["label"],
            "reference": ref["library"],
            "ratio": ref["seconds_per_round"] / p["seconds_per_round"],
        }
        for p in rows
        if p["library"] == "pflkit"
        for ref in rows
        if ref["library"] in LIBRARIES
    ]
    if any(c.library == "pfllib" for c in contenders):
        notes.append(
            "PFLlib is stopped once it has printed its round-N evaluation (-gr N trains one "
            "round more); its training samples exclude each client's short last batch"
        )
    return {
        "rounds": args.rounds,
        "timed_on": f"{os.cpu_count()} CPUs, device {args.device}",
        "load_average_at_start": load,
        "contenders": rows,
        "ratios": ratios,
        "notes": notes,
    }


if __name__ == "__main__":
    sys.exit(main())
