"""``pflkit analyze``: similarity and privacy of a config's federated setting, features of a
finished run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from pflkit.cli.common import _hush, _lists, _usable_path, out_console
from pflkit.cli.options import ConfigArg, QuietOpt, SeedsOpt, SetOpt
from pflkit.errors import PflkitError
from pflkit.experiment import load_config

analyze = typer.Typer(
    no_args_is_help=True,
    help="Analyses of a config's federated setting (similarity, privacy) or of a finished "
    "run (features).",
)


@analyze.command()
def similarity(
    config: ConfigArg = None,
    set_: SetOpt = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Output folder (default: similarity-<name>)."),
    ] = None,
    steps: Annotated[
        int, typer.Option(help="Local SGD steps per client (pFedSim §3: 20 iterations).")
    ] = 20,
    clients: Annotated[
        int | None, typer.Option(help="Use only the first N clients (default: all).")
    ] = None,
) -> None:
    """pFedSim's measurement study (§3, Table 2): classifier similarity and the other metrics
    against the true data similarity, for the config's partition (table + heatmap)."""
    from pflkit.analysis import similarity_study

    if config is None:
        raise PflkitError("give the experiment config: pflkit analyze similarity CONFIG --out DIR")
    cfg = load_config(config, set_ or [])
    folder = out or _named_folder("similarity", cfg.name)
    _usable_path(folder, "output folder")
    res = similarity_study(cfg, folder, steps=steps, clients=clients)
    for m, s in res["scores"].items():
        rho = "n/a" if s["spearman"] is None else f"{s['spearman']:.3f}"
        out_console.print(f"{m}: Spearman {rho} with data similarity")
    out_console.print(f"written to {folder} (similarity.md, similarity.json, similarity.png)")


@analyze.command()
def privacy(
    config: ConfigArg = None,
    set_: SetOpt = None,
    attack: Annotated[
        str,
        typer.Option(
            help="The attack: dlg (Zhu et al. 2019), or mia: membership inference (loss, "
            "calibrated) and label inference; or a comma list of loss, calibrated, label."
        ),
    ] = "dlg",
    round_: Annotated[
        int | None,
        typer.Option(
            "--round",
            help="The attacked round; rounds before it train as a run would (default: dlg 1, "
            "mia the last).",
        ),
    ] = None,
    victims: Annotated[
        str | None,
        typer.Option(
            help="How many clients to attack (the first N that upload in that round), or "
            "their ids: 0,3,7 (one id: 7,) (default: dlg 4, mia every one that uploads)."
        ),
    ] = None,
    iterations: Annotated[
        int, typer.Option(help="L-BFGS iterations per attacked batch (PFLlib: 100).")
    ] = 100,
    batches: Annotated[int, typer.Option(help="Batches attacked per victim (PFLlib: 2).")] = 2,
    batch_size: Annotated[
        int | None,
        typer.Option(help="Samples in an attacked batch (default: train.batch_size)."),
    ] = None,
    seeds: SeedsOpt = None,
    targets: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated: full, fe, sfe, sm for dlg; upload, personal for mia "
            "(default: every one the algorithm allows)."
        ),
    ] = None,
    algorithms: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated algorithms, chosen as compare's --algorithms chooses them "
            "(default: the config's algorithm)."
        ),
    ] = None,
    references: Annotated[
        int,
        typer.Option(help="mia: reference models per victim (the calibrated attack; 2N trained)."),
    ] = 2,
    ref_epochs: Annotated[
        int | None,
        typer.Option(
            help="mia: epochs of each reference model (default: round x train.local_epochs)."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Output folder (default: privacy-<name>)."),
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """Attacks of a semi-honest server (CONFIG: a config, or a run folder whose config.yaml
    is retrained): GPFL's DLG study (§4.7, Table 5; --attack dlg, PSNR per target) or
    membership and label inference (--attack mia; AUC and TPR at 1% FPR per target)."""
    _hush(quiet)
    from pflkit.analysis import privacy_study

    if config is None:
        raise PflkitError("give the experiment config: pflkit analyze privacy CONFIG --out DIR")
    if config.is_dir():
        if not (config / "config.yaml").is_file():
            raise PflkitError(
                f"'{config}' is a folder without config.yaml: give a config or a run folder"
            )
        config = config / "config.yaml"
    mia = [a.strip() for a in attack.split(",") if a.strip()]
    if attack != "dlg" and (not mia or not set(mia) <= {"mia", "loss", "calibrated", "label"}):
        raise PflkitError(
            f"unknown --attack '{attack}': use --attack dlg (Deep Leakage from Gradients) or "
            "--attack mia (membership and label inference; or a comma list of loss, "
            "calibrated, label)"
        )
    cfg = load_config(config, _lists(set_, seeds), algorithms=algorithms)
    folder = out or _named_folder("privacy", cfg.name)
    _usable_path(folder, "output folder")
    common = {  # the options both studies take
        "seeds": cfg.compare.seeds if seeds else None,
        "targets": [t.strip() for t in targets.split(",") if t.strip()] if targets else None,
        "algorithms": cfg.compare.algorithms if algorithms else None,
        "progress": None if quiet else lambda line: print(line, file=sys.stderr, flush=True),
    }
    if attack != "dlg":
        from pflkit.analysis.membership import membership_study

        res = membership_study(
            cfg,
            folder,
            attacks=mia,
            rnd=round_,
            victims=None if victims is None else _client_ids(victims, "--victims"),
            references=references,
            ref_epochs=ref_epochs,
            **common,
        )
        for row in res["rows"]:
            out_console.print(
                f"{row['algorithm']}-{row['target']} {row['attack']}: AUC {row['auc']:.3f}, "
                f"TPR {row['tpr_at_1fpr']:.3f} at 1% FPR (members={row['members']})",
                highlight=False,
            )
        for row in res["label_rows"]:
            auc = "n/a" if row["held_auc"] is None else f"{row['held_auc']:.3f}"
            out_console.print(
                f"{row['algorithm']} label inference ({row['source']}): held-class AUC {auc}, "
                f"majority class {row['top1_acc']:.3f} (guess {row['top1_acc_prior']:.3f})",
                highlight=False,
            )
        out_console.print(f"written to {folder} (membership.md, membership.json, membership.png)")
        return
    res = privacy_study(
        cfg,
        folder,
        attack=attack,
        rnd=1 if round_ is None else round_,
        victims=_client_ids("4" if victims is None else victims, "--victims"),
        iterations=iterations,
        batches=batches,
        batch_size=batch_size,
        **common,
    )
    for row in res["rows"]:
        out_console.print(
            f"{row['algorithm']}-{row['target']}: PSNR {row['psnr_mean']:.2f} ± "
            f"{row['psnr_std']:.2f} dB (n={row['n']})",
            highlight=False,
        )
    out_console.print(f"written to {folder} (privacy.md, privacy.json, privacy.png)")


def _named_folder(kind: str, name: str) -> Path:
    """The default output folder of a study, ``<kind>-<name>`` in the current folder, the
    config's name made safe (:func:`~pflkit.engine.folder.folder_name`)."""
    from pflkit.engine.folder import folder_name, under

    return under(Path(f"{kind}-{folder_name(name)}"), Path.cwd(), f"{kind} folder")


def _client_ids(text: str, option: str) -> int | list[int]:
    """``--victims``, ``--clients``: a count (``4``) or client ids (``0,3,7``; one id as
    ``7,``)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) == 1:
            return int(parts[0])
        return [int(p) for p in parts if p]
    except ValueError:
        raise PflkitError(
            f"{option} '{text}' is not a count or a list of client ids: write e.g. "
            f"{option} 4 or {option} 0,3,7"
        ) from None


@analyze.command()
def features(
    run_dir: Annotated[
        Path | None,
        typer.Argument(
            help="A finished run's folder (its final state is kept when "
            "output.checkpoint_every > 0).",
            show_default=False,
        ),
    ] = None,
    clients: Annotated[
        str | None,
        typer.Option(help="How many clients (the first N), or their ids: 0,3,7 (one id: 7,)."),
    ] = None,
    method: Annotated[
        str, typer.Option(help="The projection: tsne (scikit-learn) or umap (umap-learn).")
    ] = "tsne",
    per_client: Annotated[
        int, typer.Option(help="Test samples per client (a seeded choice; all if it has fewer).")
    ] = 200,
    seed: Annotated[int, typer.Option(help="Seeds the choice of samples and the projection.")] = 0,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Output folder (default: features-<run folder>)."),
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """GPFL's feature maps (§4.2, Fig. 2): each client's test features under its own evaluated
    model, projected together to 2-D (colour: class, marker: client), with silhouette scores."""
    _hush(quiet)
    from pflkit.analysis import feature_map
    from pflkit.analysis.features import OUTPUTS

    if run_dir is None:
        raise PflkitError("give a finished run's folder: pflkit analyze features RUN_DIR --out DIR")
    folder = out or Path(f"features-{run_dir.name}")
    _usable_path(folder, "output folder")
    res = feature_map(
        run_dir,
        folder,
        clients=None if clients is None else _client_ids(clients, "--clients"),
        method=method,
        per_client=per_client,
        seed=seed,
        progress=None if quiet else lambda line: print(line, file=sys.stderr, flush=True),
    )
    for space, scores in res["silhouette"].items():
        shown = ", ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in scores.items())
        out_console.print(f"silhouette on the {space}: {shown}", highlight=False)
    out_console.print(f"written to {folder} ({', '.join(OUTPUTS)})", highlight=False)
