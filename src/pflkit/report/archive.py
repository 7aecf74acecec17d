"""Kept runs in one compressed file: a folder of run folders (a compare, a sweep, a table's
column) packed as ``<folder>.zip``, read in place by ``pflkit report``,
:func:`~pflkit.report.results.load_runs` and the table scripts (``benchmarks/claims.py``,
``paper_table.py``, ...), without unpacking.

``results/`` keeps each table this way (issue 55): one file per table instead of four per run.
A name that is not there but whose ``.zip`` is (``results/pfedsim-dir01``) reads the archive,
so commands written against the folders keep working.

The archive is deterministic: members in name order, a fixed timestamp and mode, deflate at
level 9. Packing the same folder twice gives the same bytes, so git stores a table again only
when a run in it changed. ``zip``/``unzip`` read it (deflate, no extensions).

Command line (what ``benchmarks/keep_runs.sh`` and ``compare_kept.sh`` call)::

    python -m pflkit.report.archive pack FOLDER [ZIP]  # FOLDER -> ZIP (FOLDER.zip), kept
    python -m pflkit.report.archive unpack ZIP DEST    # ZIP -> the folder DEST
"""

from __future__ import annotations

import fnmatch
import os
import sys
import zipfile
from pathlib import Path
from typing import Union

from pflkit.errors import PflkitError

SUFFIX = ".zip"
STAMP = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: no clock in the bytes

# a run folder's place: a real folder, or a folder inside an archive (the same reading API:
# ``/``, ``name``, ``is_file``, ``is_dir``, ``exists``, ``iterdir``, ``read_text``)
Tree = Union[Path, zipfile.Path]  # noqa: UP007 (a runtime alias)


def tree(path: str | Path | zipfile.Path) -> Tree:
    """``path`` to read: an archive as its root folder, a folder name whose archive is kept
    instead (``results/x`` for ``results/x.zip``), anything else unchanged."""
    if isinstance(path, zipfile.Path):
        return path
    if not isinstance(path, str | os.PathLike):
        raise PflkitError(
            f"runs are read from folders given as paths, got {type(path).__name__} {path!r}: "
            "pass run, compare or sweep folders"
        )
    path = Path(path)
    packed = path if path.suffix == SUFFIX else path.with_name(path.name + SUFFIX)
    if packed.is_file() and (packed == path or not path.exists()):
        try:
            return zipfile.Path(zipfile.ZipFile(packed))
        except (zipfile.BadZipFile, OSError) as err:
            raise PflkitError(
                f"the run archive '{packed}' cannot be read ({err}): it is damaged; restore "
                "it from git, or rerun what wrote it"
            ) from None
    return path


def files(folder: str | Path | Tree, name: str, runs: str = "*-s*") -> list[Tree]:
    """The file ``name`` of every run folder of ``folder`` whose name matches ``runs``, in
    run-name order (what ``sorted(folder.glob(f"{runs}/{name}"))`` gives for a folder)."""
    root = tree(folder)
    if not root.is_dir():
        return []
    found = [
        run / name
        for run in root.iterdir()
        if run.is_dir() and fnmatch.fnmatchcase(run.name, runs) and (run / name).is_file()
    ]
    return sorted(found, key=lambda p: p.parent.name if isinstance(p, Path) else str(p))


def pack(folder: Path, out: Path | None = None) -> Path:
    """Write every file under ``folder`` into ``out`` (default ``<folder>.zip``), members
    relative to ``folder`` in name order; returns ``out``."""
    out = out or folder.with_name(folder.name + SUFFIX)
    tmp = out.with_name(out.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            info = zipfile.ZipInfo(path.relative_to(folder).as_posix(), STAMP)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, path.read_bytes(), compresslevel=9)
    tmp.replace(out)
    return out


def unpack(archive: Path, dest: Path) -> Path:
    """Extract ``archive`` into the folder ``dest`` (created; existing files are kept)."""
    with zipfile.ZipFile(archive) as z:
        for member in z.namelist():
            if member.startswith("/") or ".." in Path(member).parts:
                raise PflkitError(f"the run archive '{archive}' holds a path '{member}' outside it")
        z.extractall(dest)
    return dest


def main(argv: list[str]) -> int:
    if len(argv) in (2, 3) and argv[0] == "pack" and Path(argv[1]).is_dir():
        pack(Path(argv[1].rstrip("/")), Path(argv[2]) if len(argv) == 3 else None)
        return 0
    if len(argv) == 3 and argv[0] == "unpack" and Path(argv[1]).is_file():
        unpack(Path(argv[1]), Path(argv[2]))
        return 0
    print(
        "usage: python -m pflkit.report.archive pack FOLDER | unpack ZIP DEST "
        f"(got: {' '.join(argv) or 'nothing'})",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
