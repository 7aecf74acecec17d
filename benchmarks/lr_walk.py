"""The learning rate's walk from the command line into local training (issue 55, "clear layers").

Runs ``pflkit run quickstart_digits --set train.rounds=1 --set train.lr=<MARK> --set
engine.workers=1`` in this process, through the console script's entry point, under
``sys.setprofile``, and follows the learning rate until the first optimiser is built
(``pflkit.primitives.training.make_optimizer`` returns). Definitions:

* a **stop** is one call of a pflkit function whose local variables hold the learning rate, at
  the call or at its return: the value MARK itself (a float no config uses), a string that
  contains it (the ``--set`` text), or a dict, list, tuple, dataclass, pydantic model or plain
  object that holds one of those within two steps (``cfg.train.lr``,
  ``raw["train"]["lr"]``; not ``self.cfg.train.lr``, which every method of the engine holds);
* its **caller** is the nearest pflkit frame below it on the stack (pydantic's, typer's or
  torch's frames in between are skipped);
* a **climb** is a stop whose module sits in a higher layer than its caller's, with the layers
  numbered by :data:`LAYERS` (the first prefix that matches a module wins);
* a **step up** is a stop in a higher layer than the stop before it: the walk, read in order,
  going back up (from config.py's ``lr_factor`` back to the engine, say);
* a **config.py visit** is a stop in ``pflkit/config.py`` whose caller is outside config.py.

Each of the quick start's 10 clients is one more ``round_context`` and, before issue 55, one more
``lr_factor`` call, so the per-client stops repeat; "distinct functions" counts each once.

    PYTHONPATH=src python benchmarks/lr_walk.py            # the numbers
    PYTHONPATH=src python benchmarks/lr_walk.py --chain    # and every stop, climbs marked ^

Measured (torch 2.13 CPU, quickstart_digits): before issue 55's layer changes (04cdafa, with
config.py holding the YAML reading, ``lr_factor`` and ``resolve_device``) 80 stops in 45
functions, 22 of them in config.py over 13 visits, 2 climbs, 16 steps up; after (config.py the
schema only, the command line a package) 80 stops in 45 functions, 4 in config.py over 2 visits,
2 climbs, 7 steps up. The stops stay: the same functions run, in other modules. With the rest of
issue 55 merged (the runners' ``start_worker`` and ``experiment.algorithm_of``, which hands the
section parsed once to the simulation, the worker start-up and the run's fingerprint): 84 stops
in 47 functions, 4 in config.py over 2 visits, 2 climbs, 9 steps up (the two more are returns
from ``algorithm_of``, one layer below the engine, back to the engine).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import types
from pathlib import Path

MARK = 0.0123457  # train.lr of the walk: a value no shipped config uses
TEXT = repr(MARK)
END = ("pflkit/primitives/training.py", "make_optimizer")

# low to high; a call from a lower layer into a higher one is a climb
LAYERS: list[tuple[str, float]] = [
    ("pflkit.primitives", 0),
    ("pflkit.errors", 0),
    ("pflkit.strict", 0),
    ("pflkit.registry", 0),
    ("pflkit.examples", 0),
    ("pflkit.devices", 0),  # resolve_device (in config.py before issue 55)
    ("pflkit.config", 1),  # the schema (and, before issue 55, its runtime helpers)
    ("pflkit.config_io", 1.5),  # a config as text, above the schema (config.py before issue 55)
    ("pflkit.data", 2),
    ("pflkit.models", 2),
    ("pflkit.eval", 2),
    ("pflkit.algorithms", 3),
    ("pflkit.privacy", 3),
    ("pflkit.plugins", 3),
    ("pflkit.experiment", 4),
    ("pflkit.plain", 4),
    ("pflkit.engine", 5),
    ("pflkit.flower", 5),
    ("pflkit.analysis", 5),
    ("pflkit.testing", 5),
    ("pflkit.report", 6),
    ("pflkit.cli", 7),
    ("pflkit.__main__", 7),
    ("pflkit", 0),  # the package's own __init__ (lazy re-exports)
]

SRC = Path(__file__).resolve().parents[1] / "src"


def layer(module: str) -> float:
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return rank
    raise ValueError(f"no layer for {module}: add it to LAYERS")


def holds(value: object, depth: int = 2) -> bool:
    """Whether ``value`` holds the learning rate within ``depth`` steps (see the module)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return value == MARK
    if isinstance(value, str):
        return len(value) < 10_000 and TEXT in value
    if depth == 0 or isinstance(value, int | bytes | type | types.ModuleType):
        return False
    if isinstance(value, dict):
        items = list(value.items())[:100]
        return any(holds(k, depth - 1) or holds(v, depth - 1) for k, v in items)
    if isinstance(value, list | tuple | set | frozenset):
        return any(holds(v, depth - 1) for v in list(value)[:100])
    if callable(value) and not hasattr(value, "__dict__"):
        return False
    if dataclasses.is_dataclass(value):
        fields = [object.__getattribute__(value, f.name) for f in dataclasses.fields(value)]
        return any(holds(v, depth - 1) for v in fields)
    try:
        attrs = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return False
    if not isinstance(attrs, dict) or type(value).__module__.startswith("torch"):
        return False
    return holds(attrs, depth)  # an object's attributes: the same step as the object


@dataclasses.dataclass
class Stop:
    module: str
    function: str
    line: int
    caller: Stop | None  # the nearest pflkit frame below it (a Stop record even if it holds none)
    lr: bool = False

    @property
    def climb(self) -> bool:
        return self.caller is not None and layer(self.module) > layer(self.caller.module)

    @property
    def in_config(self) -> bool:
        return self.module == "pflkit.config"


class Walk:
    def __init__(self) -> None:
        self.frames: dict[int, Stop] = {}  # id(frame) -> its record, while it runs
        self.stops: list[Stop] = []
        self.codes: dict[object, str | None] = {}  # code object -> module name or None
        self.done = False

    def module(self, code: types.CodeType) -> str | None:
        if code not in self.codes:
            path = Path(code.co_filename)
            try:
                rel = path.resolve().relative_to(SRC)
            except ValueError:
                rel = None
            name = None
            if rel is not None and rel.parts[0] == "pflkit":
                parts = rel.with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            self.codes[code] = name
        return self.codes[code]

    def __call__(self, frame: types.FrameType, event: str, arg: object) -> None:
        if event not in ("call", "return") or self.done:
            return
        module = self.module(frame.f_code)
        if module is None:
            return
        if event == "call":
            caller, f = None, frame.f_back
            while f is not None and caller is None:
                caller = self.frames.get(id(f))
                f = f.f_back
            record = Stop(module, frame.f_code.co_qualname, frame.f_lineno, caller)
            self.frames[id(frame)] = record
        else:
            record = self.frames.pop(id(frame), None)
            if record is None:
                return
        if not record.lr and any(holds(v) for v in frame.f_locals.values()):
            record.lr = True
            self.stops.append(record)
        if (
            event == "return"
            and (frame.f_code.co_filename.endswith(END[0]))
            and (frame.f_code.co_name == END[1])
        ):
            self.done = True
            sys.setprofile(None)


def walk(config: str = "quickstart_digits") -> list[Stop]:
    from pflkit.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["pflkit", "run", config, "--set", "train.rounds=1", "--set", f"train.lr={TEXT}"]
        argv += ["--set", "engine.workers=1", "--out", str(Path(tmp) / "run"), "-q"]
        sys.argv, w = argv, Walk()
        sys.setprofile(w)
        try:
            main()
        except SystemExit as e:
            if e.code not in (0, None):
                raise
        finally:
            sys.setprofile(None)
    if not w.done:
        raise SystemExit("the walk never reached make_optimizer: check END")
    return w.stops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chain", action="store_true", help="print every stop, climbs marked ^")
    p.add_argument("--config", default="quickstart_digits")
    args = p.parse_args()
    stops = walk(args.config)
    if args.chain:
        for i, s in enumerate(stops, 1):
            via = f"  <- {s.caller.module}.{s.caller.function}" if s.caller else ""
            mark = "^" if s.climb else " "
            print(f"{i:3} {mark} L{layer(s.module)} {s.module}.{s.function}:{s.line}{via}")
    visits = sum(s.in_config and not (s.caller and s.caller.in_config) for s in stops)
    print(f"stops: {len(stops)}")
    print(f"distinct functions: {len({(s.module, s.function) for s in stops})}")
    print(f"config.py stops: {sum(s.in_config for s in stops)}")
    print(f"config.py visits: {visits}")
    print(f"climbs (calls from a lower layer into a higher one): {sum(s.climb for s in stops)}")
    ups = sum(layer(b.module) > layer(a.module) for a, b in zip(stops, stops[1:], strict=False))
    print(f"steps up (a stop in a higher layer than the one before): {ups}")


if __name__ == "__main__":
    main()
