"""``pflkit list`` (algorithms, datasets, partitioners, models; one algorithm's parameters) and
``pflkit examples`` (the bundled example configs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pflkit.cli.common import out_console
from pflkit.cli.options import ImportOpt


def list_(
    params: Annotated[
        str | None,
        typer.Option(
            "--params",
            help="Show one algorithm's parameters: type, default and where the default comes from.",
        ),
    ] = None,
    imports: ImportOpt = None,
) -> None:
    """List algorithms, datasets, partitioners and models (or one algorithm's parameters)."""
    from pflkit.plugins import load_plugins

    load_plugins(imports or [])
    from pflkit.algorithms import ALGORITHMS
    from pflkit.data.partition import PARTITIONERS
    from pflkit.data.sources import SOURCES
    from pflkit.models import MODELS

    if params is not None:
        _show_params(params)
        return
    for title, items in (
        ("algorithms", ALGORITHMS.descriptions()),
        ("datasets", SOURCES.descriptions()),
        ("partitioners", PARTITIONERS.descriptions()),
        ("models", MODELS.descriptions()),
    ):
        out_console.print(f"[bold]{title}[/bold]")
        width = max(map(len, items))
        for name in sorted(items):
            out_console.print(f"  {name:<{width}}  {items[name]}", highlight=False, markup=False)


examples = typer.Typer(
    help="The example configs bundled with pflkit: list them, copy one to edit.",
    invoke_without_command=True,
    no_args_is_help=False,
)


@examples.callback()
def examples_list(ctx: typer.Context) -> None:
    """List the example configs bundled with pflkit (name and description). Any command that
    takes a CONFIG takes a name too: pflkit run quickstart_digits."""
    if ctx.invoked_subcommand is not None:
        return
    from pflkit.examples import examples as bundled

    items = bundled()
    width = max(map(len, items))
    for name, description in items.items():
        out_console.print(f"{name:<{width}}  {description}", highlight=False, markup=False)


@examples.command("copy")
def examples_copy(
    name: Annotated[str, typer.Argument(help="The example's name (`pflkit examples`).")],
    directory: Annotated[Path, typer.Argument(help="Folder to copy it into (created if missing).")],
) -> None:
    """Copy one bundled example config into DIRECTORY, to edit and run."""
    from pflkit.examples import copy_example

    out_console.print(f"wrote {copy_example(name, directory)}", highlight=False, markup=False)


def _show_params(name: str) -> None:
    """Print algorithm ``name``'s parameters as a table."""
    from rich.table import Table

    from pflkit.algorithms import ALGORITHMS
    from pflkit.flower import secagg
    from pflkit.privacy import dpsgd
    from pflkit.privacy.client_dp import describe_release

    cls = ALGORITHMS.lookup(name)
    privacy = [*describe_release(cls), dpsgd.describe(cls), secagg.describe(cls)]
    if not cls.Params.model_fields:
        out_console.print(f"algorithm '{name}' takes no parameters")
        out_console.print("\n".join(privacy), highlight=False)
        return
    t = Table(title=f"{name}: {cls.description}", title_justify="left")
    for col in ("parameter", "type", "default", "source of the default"):
        t.add_column(col)
    for key, field in cls.Params.model_fields.items():
        kind = str(field.annotation).replace("typing.", "").replace("<class '", "")
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        t.add_row(key, kind.replace("'>", ""), repr(field.default), str(extra.get("source", "")))
    out_console.print(t)
    out_console.print("\n".join(privacy), highlight=False)
