"""A config as text: YAML read within limits, ``--set`` overrides and ``--algorithms``.

What comes before the schema (:mod:`pflkit.config`): every config a command reads (a file, a
run folder's config.yaml, Flower's run config, a ``--set`` value) becomes a plain mapping here,
checked against :data:`LIMITS` before and while it is parsed, and
:func:`pflkit.experiment.load_config` hands the mapping on to be validated. Every problem is one
sentence (:class:`~pflkit.errors.PflkitError`).
"""

from __future__ import annotations

import copy
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from pflkit.config import parse_size
from pflkit.errors import PflkitError

# what reading a config may cost (docs/guide.md, "Limits")
#: limit -> (the environment variable that changes it, its default). Every config a command
#: reads (a file, a run folder's config.yaml, Flower's run config, a --set value) is checked
#: against them before it is used: a file that is no regular file or is too large is refused
#: before a byte is parsed, an alias bomb or a deep nesting as soon as the parser reaches it.
LIMITS: dict[str, tuple[str, int]] = {
    "bytes": ("PFLKIT_CONFIG_MAX_BYTES", 2**20),  # a config file or text
    "set": ("PFLKIT_SET_MAX_CHARS", 10_000),  # one --set, --grid or --algorithms value
    "values": ("PFLKIT_CONFIG_MAX_VALUES", 100_000),  # values, every alias expanded
    "aliases": ("PFLKIT_CONFIG_MAX_ALIASES", 1_000),  # uses of an alias (*name)
    "depth": ("PFLKIT_CONFIG_MAX_DEPTH", 50),  # mappings and lists inside each other
}


def limit(name: str) -> int:
    """The limit ``name`` of :data:`LIMITS`: its environment variable if set (a positive
    whole number; for ``bytes`` also a size such as ``4MiB``), else its default."""
    var, default = LIMITS[name]
    text = os.environ.get(var, "").strip()
    if not text:
        return default
    try:
        value = parse_size(text) if name == "bytes" else int(text)
    except ValueError:
        value = 0
    if not isinstance(value, int) or value < 1:
        raise PflkitError(
            f"{var}={text!r} is not a positive whole number: give e.g. {var}={2 * default}, "
            "or unset it for the default"
        )
    return value


def _size_text(n: int) -> str:
    return f"{n} bytes" if n < 2**20 else f"{n / 2**20:.1f} MiB"


class TooCostly(yaml.YAMLError):
    """A YAML document past a limit of :data:`LIMITS`: ``problem`` says which and how to
    raise it, ``problem_mark`` where the parser stopped."""

    def __init__(self, problem: str, mark: Any):
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


def _too_costly(name: str, what: str, mark: Any) -> TooCostly:
    var, _ = LIMITS[name]
    most = limit(name)
    return TooCostly(f"{what} (more than {most}): simplify it, or raise {var}", mark)


class _Loader(yaml.SafeLoader):
    """YAML as a user means it: ``1e-1`` is a number (YAML 1.1 wants ``1.0e-1``), and a key
    given twice in one mapping is an error rather than silently the last value. Within
    :data:`LIMITS`: while the parser composes the document, every node's size with its aliases
    expanded (``values``), the aliases used and the nesting depth are counted, and the first
    one past its limit stops it (:class:`TooCostly`); so does an alias inside its own anchor.
    Aliases still share one value: the count is what a consumer walking the config would see."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self._most = {k: limit(k) for k in ("values", "aliases", "depth")}
        self._depth = self._aliases = 0
        self._sizes: dict[int, int] = {}  # id(node) -> its size, every alias expanded

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            self._aliases += 1
            if self._aliases > self._most["aliases"]:
                raise _too_costly("aliases", "it uses too many aliases", event.start_mark)
            node = super().compose_node(parent, index)
            if id(node) not in self._sizes:  # its anchor is still being composed
                raise TooCostly(
                    f"alias *{event.anchor} is used inside its own anchor &{event.anchor}, so "
                    "the value would contain itself: repeat the value instead",
                    event.start_mark,
                )
            return node
        self._depth += 1
        if self._depth > self._most["depth"]:
            raise _too_costly("depth", "it nests too deep", self.peek_event().start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        size = 1 + sum(self._sizes[id(c)] for c in children)
        self._sizes[id(node)] = size
        if size > self._most["values"]:
            raise _too_costly(
                "values", "it holds too many values once its aliases are expanded", node.end_mark
            )
        return node


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, f"key '{key}' appears twice", mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(text: str) -> Any:
    """The value of the YAML document ``text``, within :data:`LIMITS` (its size is the
    caller's to check); a yaml.YAMLError (:class:`TooCostly` past a limit) otherwise."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def _short_enough(text: str, what: str) -> None:
    most = limit("set")
    if len(text) > most:
        raise PflkitError(
            f"a {what} value of {len(text)} characters is above the limit of {most}: put it in "
            f"the config file, or raise {LIMITS['set'][0]}"
        )


def parse_value(text: str, what: str = "--set") -> Any:
    """Parse a ``--set`` value (``what``: the option it came from) as YAML (numbers, booleans,
    lists, dicts), else keep the string; one sentence for a value past :data:`LIMITS`."""
    _short_enough(text, what)
    try:
        return load_yaml(text)
    except TooCostly as err:
        shown = text if len(text) <= 40 else f"{text[:37]}..."
        raise PflkitError(f"{what} value {shown!r} is refused: {err.problem}") from None
    except yaml.YAMLError:
        return text


def config_text(text: str, what: str, written: bool = False) -> dict[str, Any]:
    """The config mapping of the YAML ``text`` (``what`` names it in an error, e.g. "config
    file 'x.yaml'"), within :data:`LIMITS`; every problem is one sentence. ``written``: pflkit
    wrote it (a run's config.yaml, a compare's manifest), so an empty one is damage."""
    most = limit("bytes")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > most:
        raise PflkitError(
            f"{what} is {_size_text(size)}, above the {_size_text(most)} limit of a config: "
            f"check that it is the right file, or raise {LIMITS['bytes'][0]}"
        )
    try:
        raw = load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        if isinstance(err, TooCostly):
            raise PflkitError(f"{what} is refused{at}: {err.problem}") from None
        problem = getattr(err, "problem", None) or "fix the syntax"
        raise PflkitError(f"{what} is not valid YAML{at}: {problem}") from None
    if raw is None:  # an empty file (a slip, or a cut write) must not run every default
        fix = (
            "it is damaged; restore it, or rerun what wrote it"
            if written
            else "give the settings it changes, e.g. 'train: {rounds: 5}', "
            "or '{}' for every default"
        )
        raise PflkitError(f"{what} is empty (no settings, or only comments): {fix}")
    if not isinstance(raw, dict):
        raise PflkitError(
            f"{what} is not a mapping: a config must be a mapping of sections, not a "
            f"{type(raw).__name__}"
        )
    return raw


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a raw config dict (returns a new dict)."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        if not isinstance(item, str):
            raise PflkitError(
                f"invalid --set {item!r}: give key=value strings, e.g. 'train.rounds=5'"
            )
        key, sep, value = item.partition("=")
        _short_enough(item, "--set")  # before it is shown in a sentence
        if not sep or not key:
            raise PflkitError(f"invalid --set {item!r}: write it as key=value, e.g. train.rounds=5")
        parts = key.split(".")
        if len(parts) > limit("depth"):
            raise PflkitError(
                f"--set key {key[:40] + '...'!r} has {len(parts)} parts, deeper than any config "
                f"(more than {limit('depth')}): check it, or raise {LIMITS['depth'][0]}"
            )
        node = raw
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise PflkitError(f"invalid --set '{item}': '{p}' is not a section")
            node = child
        node[parts[-1]] = parse_value(value)
    return raw


def select_algorithms(raw: dict[str, Any], text: str) -> dict[str, Any]:
    """``--algorithms``: set ``compare.algorithms`` from a comma-separated list (returns a new
    dict). An item that is the ``name`` or ``label`` of entries of the config's own
    ``compare.algorithms`` selects those entries, parameters and all (``fedrep`` selects
    ``{name: fedrep, head_epochs: 1}``; every entry of that name, in the config's order); any
    other item is an entry of its own: a name (the algorithm at its defaults) or
    ``{name: ..., param: value}``."""
    items = parse_value(f"[{text}]", "--algorithms")
    if not isinstance(items, list):
        raise PflkitError(
            f"invalid --algorithms '{text}': give comma-separated names, e.g. fedavg,fedprox"
        )
    raw = copy.deepcopy(raw)
    compare = raw.setdefault("compare", {})
    if not isinstance(compare, dict):
        raise PflkitError(f"invalid --algorithms '{text}': the config's compare is not a section")
    entries = compare.get("algorithms") or []

    def keys(entry: Any) -> set[Any]:
        if isinstance(entry, dict):
            return {entry.get("name"), entry.get("label")} - {None}
        return {entry}

    chosen = []
    for item in items:
        matches = [e for e in entries if isinstance(item, str) and item in keys(e)]
        chosen += matches or [item]
    compare["algorithms"] = chosen
    return raw


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_yaml(path: str | Path, what: str = "config file", written: bool = False) -> dict[str, Any]:
    """The config mapping of the YAML file ``path`` (``what`` it is, in an error): a regular
    file of at most ``limit("bytes")`` bytes (checked before it is read: a folder, a pipe or a
    device such as /dev/zero is refused at once, and so is a large file), within
    :data:`LIMITS`."""
    path = Path(path)
    what = f"{what} '{path}'"
    try:  # non-blocking: opening a named pipe must not wait for a writer
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise PflkitError(f"cannot read {what}: {err.strerror or err}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
            raise PflkitError(f"{what} is {kind}, not a regular file: give a YAML file")
        most = limit("bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(most + 1)  # a file that grows, or a /proc file that says size 0
    except OSError as err:
        raise PflkitError(f"cannot read {what}: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if len(data) > most:
        size = max(os.stat(path).st_size, len(data))
        raise PflkitError(
            f"{what} is {_size_text(size)}, above the {_size_text(most)} limit of a config: "
            f"check that it is the right file, or raise {LIMITS['bytes'][0]}"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise PflkitError(f"{what} is not UTF-8 text: save it as UTF-8") from None
    return config_text(text, what, written)
