"""The example configs shipped inside the package: the files of ``pflkit/configs/`` (in a
clone, ``configs/`` at the repository root is a link to that folder, so both paths name the
same files).

An example's *name* is its path under that folder without ``.yaml``: ``quickstart``,
``quickstart_digits``, ``gpfl/fmnist_practical_cpu``. Its *description* is the comment on the
file's first line. :func:`pflkit.experiment.load_config` (and so every
command that takes a CONFIG) accepts a name wherever it accepts a path::

    pflkit examples                              # names and descriptions
    pflkit examples copy quickstart my-configs   # my-configs/quickstart.yaml, to edit
    pflkit run quickstart_digits                 # runs the bundled file itself
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pflkit.errors import PflkitError, unknown_name

__all__ = ["EXAMPLES_DIR", "copy_example", "describe", "example_path", "examples", "resolve"]

EXAMPLES_DIR = Path(__file__).resolve().parent / "configs"
SUFFIXES = (".yaml", ".yml")


def examples() -> dict[str, str]:
    """Every bundled example's name and one-line description, sorted by name."""
    return {
        path.relative_to(EXAMPLES_DIR).with_suffix("").as_posix(): describe(path)
        for path in sorted(EXAMPLES_DIR.rglob("*.yaml"))
    }


def describe(path: Path) -> str:
    """The one-line description of an example: the text of its first line, which is a comment
    (an empty string when the first line is not one)."""
    with path.open(encoding="utf-8") as f:
        first = f.readline().rstrip("\n")
    return first.removeprefix("#").strip() if first.startswith("#") else ""


def example_path(name: str) -> Path:
    """The bundled file of example ``name``; an unknown name is one sentence that suggests the
    closest one."""
    path = EXAMPLES_DIR / f"{name}.yaml"
    if name and not name.startswith(("/", ".")) and ".." not in name and path.is_file():
        return path
    raise unknown_name("example", name, examples(), listing="pflkit examples")


def resolve(config: str | Path) -> Path:
    """The file a CONFIG argument names: ``config`` itself when it exists, or when it ends in
    ``.yaml``/``.yml`` (a missing one is reported when it is read, unless it is a repository
    path of a bundled example, such as ``configs/quickstart.yaml`` outside a clone: then one
    sentence gives the example's name); otherwise the bundled example of that name
    (:func:`example_path`)."""
    path = Path(config)
    if path.exists():
        return path
    if path.suffix in SUFFIXES:
        name = path.with_suffix("").as_posix().removeprefix("configs/")
        if not path.is_absolute() and (EXAMPLES_DIR / f"{name}.yaml").is_file():
            raise PflkitError(
                f"config file '{config}' does not exist here; it is the bundled example "
                f"'{name}': give that name instead (e.g. pflkit run {name})"
            )
        return path
    return example_path(str(config))


def copy_example(name: str, directory: str | Path) -> Path:
    """Copy example ``name`` into ``directory`` (created if missing) as ``<last part of the
    name>.yaml`` and return the new file's path. An existing file of that name is left alone:
    one sentence, nothing written."""
    source = example_path(name)
    directory = Path(directory)
    target = directory / source.name
    if directory.exists() and not directory.is_dir():
        raise PflkitError(f"'{directory}' is a file, not a folder: give a folder to copy into")
    if target.exists():
        raise PflkitError(f"'{target}' exists already: remove it, or copy into another folder")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    except OSError as err:
        raise PflkitError(
            f"cannot copy example '{name}' to '{target}' ({err.strerror or err}): choose "
            "another folder"
        ) from None
    return target
