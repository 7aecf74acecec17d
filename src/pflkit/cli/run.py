"""``pflkit run``: one experiment into a run folder, or ``--resume`` one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pflkit.cli.common import _hush, _show_summary, out_console
from pflkit.cli.options import ConfigArg, ForceOpt, ImportOpt, OutOpt, QuietOpt, SetOpt
from pflkit.errors import PflkitError, RunInterrupted
from pflkit.experiment import load_config


def run(
    ctx: typer.Context,
    config: ConfigArg = None,
    set_: SetOpt = None,
    imports: ImportOpt = None,
    out: OutOpt = None,
    resume: Annotated[
        Path | None, typer.Option(help="Continue the run in this folder from its last checkpoint.")
    ] = None,
    quiet: QuietOpt = False,
    force: ForceOpt = False,
) -> None:
    """Run one experiment into a run folder (config, metrics.jsonl, summary.json, plots)."""
    _hush(quiet)
    from pflkit.engine.runner import new_run_dir, run_experiment

    if resume is not None:
        if config is not None or out is not None:
            raise PflkitError(
                "--resume takes the config from the run folder: drop CONFIG and --out"
            )
        if not _resumable(resume, set_ or []):
            return
        try:
            res = run_experiment(
                resume=resume,
                overrides=set_ or [],
                progress=False if quiet else None,
                force=force,
            )
        except KeyboardInterrupt:  # outside the round loop (which stops at a round's end)
            raise RunInterrupted(
                f"interrupted (Ctrl-C) outside a round: continue with pflkit run --resume {resume}"
            ) from None
    else:
        if config is None:
            print(ctx.get_help())
            raise PflkitError(
                "pflkit run needs a CONFIG file (e.g. configs/quickstart.yaml) or --resume DIR"
            )
        cfg = load_config(config, set_ or [], imports)
        run_dir = new_run_dir(cfg, out)  # named here, so that an interrupt can say what is left
        existed = run_dir.exists()
        try:
            res = run_experiment(cfg, out=run_dir, progress=False if quiet else None, force=force)
        except KeyboardInterrupt:  # outside the round loop (which stops at a round's end)
            raise _interrupted(run_dir, existed) from None
    _show_summary(res.run_dir, res.summary)


def _interrupted(run_dir: Path, existed: bool) -> RunInterrupted:
    """The sentence for a new run stopped by Ctrl-C outside its round loop. Before its first
    round, what it wrote is removed (the folder is left as it was: absent, or empty)."""
    import shutil

    if (run_dir / "summary.json").exists():
        return RunInterrupted(
            f"interrupted (Ctrl-C) after the last round: the run finished; its metrics and "
            f"summary are in {run_dir} (its curves.png may be missing)"
        )
    metrics = run_dir / "metrics.jsonl"
    rows = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    if rows:
        return RunInterrupted(
            f"interrupted (Ctrl-C) after round {rows}, outside a round: continue with "
            f"pflkit run --resume {run_dir}"
        )
    if run_dir.is_dir():
        shutil.rmtree(run_dir, ignore_errors=True)
        if existed:
            run_dir.mkdir(exist_ok=True)
    return RunInterrupted("interrupted (Ctrl-C) before the first round: nothing was written")


def _resumable(run_dir: Path, overrides: list[str]) -> bool:
    """Whether ``--resume run_dir`` has rounds to run; False (said on stdout) for a finished
    run without a checkpoint at its rounds. Refused: lowering train.rounds below the rounds
    already run (config.yaml would disagree with the metrics and summary), and more rounds for
    a finished run without a checkpoint (it would start again from round 1)."""
    from pflkit.engine.checkpoint import load_checkpoint
    from pflkit.engine.runner import CHECKPOINT, resume_config
    from pflkit.report.results import read_json

    finished, checkpoint = run_dir / "summary.json", run_dir / CHECKPOINT
    if not finished.is_file() and not checkpoint.is_file():
        return True  # stopped before its first checkpoint: it runs again from round 1
    rounds = resume_config(run_dir, overrides).train.rounds
    if checkpoint.is_file():
        if rounds >= resume_config(run_dir, []).train.rounds:
            return True
        done = int(load_checkpoint(checkpoint)["round"])
        what = f"its checkpoint is at round {done}"
    else:
        done = read_json(finished, "run summary").get("rounds")
        if not isinstance(done, int):
            raise PflkitError(f"'{finished}' does not say how many rounds the run has: rerun it")
        what = f"it finished {done} rounds"
    if rounds < done:
        raise PflkitError(
            f"--set train.rounds={rounds} is below the rounds the run in '{run_dir}' has run "
            f"({what}): its config.yaml would disagree with its metrics; give "
            f"train.rounds >= {done}, or start a new run"
        )
    if checkpoint.is_file():
        return True
    if rounds == done:
        out_console.print(
            f"the run in '{run_dir}' has finished its {done} rounds: nothing to resume (it has "
            "no checkpoint, so it cannot be continued for more rounds)",
            highlight=False,
        )
        return False
    raise PflkitError(
        f"the run in '{run_dir}' finished its {done} rounds without a checkpoint "
        f"(output.checkpoint_every: 0), so it cannot continue to round {rounds}: start a new "
        f"run with --set train.rounds={rounds} (and output.checkpoint_every=N to be able to "
        "continue it later)"
    )
