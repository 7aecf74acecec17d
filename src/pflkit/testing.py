"""Toy environments for unit tests: an algorithm's hooks run on a few in-memory tensors, with no
config file and no dataset on disk (plugin authors may use it too).

:func:`toy_envs` builds the :class:`~pflkit.algorithms.ServerEnv` and the clients'
:class:`~pflkit.algorithms.ClientEnv` s that :func:`pflkit.engine.envs.make_envs` builds for a
run, here on given (or random) tensors; :func:`round_ctx` gives a client's
:class:`~pflkit.algorithms.RoundContext` of a round as the engine makes it. One FedAvg round::

    server_env, clients = toy_envs(samples=[3, 5])
    algo = build_algorithm({"name": "fedavg"})
    server = algo.server_init(server_env)
    uploads = {
        c.cid: algo.client_update(c, algo.configure(server_env, server, c.cid, ServerContext(1)),
                                  {}, round_ctx(c)).upload
        for c in clients
    }
    new = algo.aggregate(server_env, server, uploads, ServerContext(1))  # (3 w_0 + 5 w_1) / 8

:func:`check_record` checks a payload, upload or state against the record its algorithm
declares (:mod:`pflkit.algorithms.records`), as ``tests/test_conformance.py`` does for every
registered algorithm::

    check_record(uploads[0], type(algo).upload, "fedavg's upload")
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pflkit.algorithms.base import Algorithm
from pflkit.algorithms.context import RoundContext
from pflkit.algorithms.env import ClientEnv, ModelPool, RunFacts, ServerEnv
from pflkit.config import parse
from pflkit.data.federated import ClientData
from pflkit.errors import PflkitError
from pflkit.models import PFLModel
from pflkit.primitives.training import get_weights

ModelFactory = Callable[[tuple[int, ...], int], PFLModel]
"""A model built by a callable, ``(input shape, classes) -> model``, in place of a name."""


class _FactoryPool(ModelPool):
    """A model pool whose one architecture is built by a callable instead of by name."""

    def __init__(self, factory: ModelFactory, input_shape, num_classes, device):
        super().__init__({"custom": ("custom", {})}, input_shape, num_classes, device)
        self.factory = factory

    def new_model(self, arch: str) -> PFLModel:
        with torch.device("cpu"):
            model = self.factory(self.input_shape, self.num_classes)
        if not isinstance(model, PFLModel):
            raise PflkitError(
                f"toy_envs: the model factory returned a {type(model).__name__}, "
                "not a pflkit.models.PFLModel (body + head)"
            )
        return model.to(self.device)


def _shape(t: Any) -> str:
    return f"shape {list(t.shape)}" if isinstance(t, Tensor) else f"a {type(t).__name__}"


def _check(clients: Sequence[tuple[Tensor, Tensor]], num_classes: int) -> None:
    if not clients:
        raise PflkitError("toy_envs needs at least one client: give num_clients >= 1")
    shape = tuple(clients[0][0].shape[1:])
    for cid, pair in enumerate(clients):
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise PflkitError(f"toy_envs: client {cid} must be an (x, y) pair of tensors")
        x, y = pair
        tensors = isinstance(x, Tensor) and isinstance(y, Tensor) and x.dim() >= 2
        if not tensors or y.dim() != 1 or len(x) != len(y) or len(y) == 0:
            raise PflkitError(
                f"toy_envs: client {cid} needs inputs x [n, ...] and labels y [n] with the same "
                f"n >= 1 (tensors), got {_shape(x)} and {_shape(y)}"
            )
        if tuple(x.shape[1:]) != shape:
            raise PflkitError(
                f"toy_envs: client {cid}'s inputs have shape {list(x.shape[1:])}, "
                f"client 0's {list(shape)}: give every client one input shape"
            )
        if y.dtype != torch.long or int(y.min()) < 0 or int(y.max()) >= num_classes:
            raise PflkitError(
                f"toy_envs: client {cid}'s labels must be integers (torch.long) "
                f"in [0, {num_classes}): set num_classes or fix the labels"
            )


def toy_data(
    samples: int | Sequence[int] = 4,
    num_clients: int = 2,
    input_dim: int = 4,
    num_classes: int = 3,
    seed: int = 0,
) -> list[tuple[Tensor, Tensor]]:
    """Random ``(x, y)`` per client: x standard normal ``[n, input_dim]``, y cycling through the
    classes; ``samples`` is every client's n, or one n per client."""
    counts = [samples] * num_clients if isinstance(samples, int) else list(samples)
    if num_clients < 1 or len(counts) != num_clients or min(counts) < 1:
        raise PflkitError(
            f"toy_envs: {num_clients} clients with samples {samples}: give "
            "num_clients >= 1 and one sample count >= 1 per client"
        )
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, input_dim, generator=g), torch.arange(n) % num_classes) for n in counts]


def toy_envs(
    clients: Sequence[tuple[Tensor, Tensor]] | None = None,
    *,
    num_clients: int = 2,
    samples: int | Sequence[int] = 4,
    input_dim: int = 4,
    num_classes: int = 3,
    model: str | ModelFactory = "mlp",
    model_options: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    system: dict[str, Any] | None = None,
    public_x: Tensor | None = None,
    selected_eval: bool = False,
    seed: int = 0,
) -> tuple[ServerEnv, list[ClientEnv]]:
    """The server's and the clients' environments of a federation on small in-memory tensors.

    ``clients`` gives each client's ``(x, y)`` (its training and its test split); without it,
    :func:`toy_data` draws ``num_clients`` random ones (``samples``, ``input_dim``, ``seed``).
    ``model`` is a registered model name with ``model_options`` (default ``mlp`` without
    hidden layers: softmax regression, whose gradients are easy to write out by hand) or a
    callable ``(input_shape, num_classes) -> PFLModel``. ``train`` and ``system`` override
    fields of the config sections of those names; ``train`` defaults to full-batch SGD at
    lr 0.1 for one epoch. Everything is on the CPU. Torch's global RNG is seeded with ``seed``
    last, so ``init_weights()`` draws the same start every time. A mistake raises
    :class:`~pflkit.errors.PflkitError` with one sentence.
    """
    if clients is None:
        clients = toy_data(samples, num_clients, input_dim, num_classes, seed)
    _check(clients, num_classes)
    full_batch = max(len(y) for _, y in clients)
    raw = {
        "seed": seed,
        "train": {"batch_size": full_batch, "lr": 0.1, **(train or {})},
        "system": system or {},
    }
    cfg = parse(raw)  # pydantic sections built in code: bad values fail as in a config file
    shape = tuple(clients[0][0].shape[1:])
    cpu = torch.device("cpu")
    if callable(model):
        arch, pool = "custom", _FactoryPool(model, shape, num_classes, cpu)
    else:
        options = {"hidden": []} if model_options is None and model == "mlp" else model_options
        arch = model
        pool = ModelPool({arch: (model, options or {})}, shape, num_classes, cpu)
    pool.model(arch)  # a bad model name or option fails here
    facts = RunFacts(cfg.train, seed, selected_eval, cfg.system)
    server = ServerEnv(
        num_clients=len(clients),
        archs=[arch] * len(clients),
        global_arch=arch,
        num_samples=[len(y) for _, y in clients],
        num_classes=num_classes,
        models=pool,
        run=facts,
        public_x=public_x,
    )
    envs = [
        ClientEnv(cid, ClientData(x, y, x, y), num_classes, arch, pool, facts, public_x)
        for cid, (x, y) in enumerate(clients)
    ]
    torch.manual_seed(seed)
    return server, envs


def round_ctx(
    env: ClientEnv | ServerEnv, rnd: int = 1, phase: str = "train", straggler: bool = False
) -> RoundContext:
    """A client's :class:`~pflkit.algorithms.RoundContext` in phase ``phase`` of round ``rnd``,
    from the environment's run settings, as the engine builds it (a straggler's work share
    from ``system.straggler_work``)."""
    from pflkit.engine.clients import round_context  # the engine's own rule, imported on use

    return round_context(env.run, rnd, phase, straggler)


def personal_weights(
    algo: Algorithm,
    env: ClientEnv,
    view: Mapping[str, Any],
    state: Mapping[str, Any],
    ctx: RoundContext,
    upload: Mapping[str, Any] | None = None,
) -> dict[str, Tensor]:
    """A copy of the weights of the model :meth:`~pflkit.algorithms.Algorithm.personal_model`
    returns (with ``upload``: under MAP's protocol), to check by value in a test; for a scoring
    wrapper (GPFL's CoV, FedRoD's two heads, ...) the weights of the model it wraps
    (``.model``)."""
    model = algo.personal_model(env, view, state, ctx, upload)  # type: ignore[arg-type]
    inner = model if isinstance(model, PFLModel) else model.model
    return get_weights(inner)


def same_weights(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> bool:
    """Whether two weight dicts hold the same keys and exactly equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_record(value: Any, record: Any, where: str) -> None:
    """Check ``value`` against ``record``, the record an algorithm declares
    (``Algorithm.payload``, ``upload``, ``state`` or ``server``): a TypedDict, a Union of
    them, or any type below. A TypedDict value is a dict with every required key, no key the
    record does not declare, and each value of its declared type; the types understood are
    Tensor, numpy arrays, int, float (an int passes), str, bool, None, ``Any``, ``Literal``,
    ``list[X]``, ``tuple[X, ...]``, ``dict[K, V]`` (so ``Weights``), Optional and Union, and
    nested TypedDicts. A mismatch raises :class:`~pflkit.errors.PflkitError`, one sentence that
    starts with ``where`` (say the algorithm and the record) and names the key."""
    problem = _mismatch(value, record, _name(record))
    if problem is not None:
        raise PflkitError(f"{where}: {problem}")


def _name(tp: Any) -> str:
    if _is_union(tp):
        return " | ".join(_name(m) for m in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", None) or repr(tp).replace("typing.", "")


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _mismatch(value: Any, tp: Any, at: str) -> str | None:
    """Why ``value`` is not a ``tp`` (``at`` names where it sits), or None when it is."""
    if tp is Any or tp is object:
        return None
    if typing.is_typeddict(tp):
        return _record_mismatch(value, tp, at)
    if _is_union(tp):
        members = typing.get_args(tp)
        problems = [_mismatch(value, m, at if len(members) == 1 else _name(m)) for m in members]
        if any(p is None for p in problems):
            return None
        if all(typing.is_typeddict(m) for m in members):  # one record per phase: say each
            return f"{at} matches none of its records (" + "; ".join(map(str, problems)) + ")"
        return f"{at} is a {type(value).__name__}, not {_name(tp)}"
    if tp is None or tp is type(None):
        return None if value is None else f"{at} is a {type(value).__name__}, not None"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return None if value in args else f"{at} is {value!r}, not one of {list(args)}"
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            return f"{at} is a {type(value).__name__}, not a dict"
        for k, v in value.items():
            problem = _mismatch(k, args[0], f"a key of {at}") or _mismatch(
                v, args[1], f"{at}[{k!r}]"
            )
            if problem is not None:
                return problem
        return None
    if origin in (list, tuple):
        if not isinstance(value, origin):
            return f"{at} is a {type(value).__name__}, not a {origin.__name__}"
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                return f"{at} has {len(value)} items, not {len(args)}"
            pairs = zip(args, value, strict=True)
        else:
            pairs = ((args[0], v) for v in value)
        for i, (item_tp, v) in enumerate(pairs):
            if (problem := _mismatch(v, item_tp, f"{at}[{i}]")) is not None:
                return problem
        return None
    return _scalar_mismatch(value, tp, at)


def _scalar_mismatch(value: Any, tp: Any, at: str) -> str | None:
    if tp is float:  # an int is a float (the numeric tower), a bool is neither
        ok = isinstance(value, int | float | np.floating) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
    elif isinstance(tp, type):
        ok = isinstance(value, tp)
    else:
        raise PflkitError(f"check_record: {at} is declared as {tp!r}, a type it cannot check")
    return None if ok else f"{at} is a {type(value).__name__}, not {_name(tp)}"


def _fields(record: Any) -> tuple[dict[str, Any], set[str]]:
    """A TypedDict's value types by key, and its required keys. Read from the annotations:
    ``__required_keys__`` counts a postponed ``NotRequired[...]`` as required (Python 3.11)."""
    hints, required = {}, set()
    for key, tp in typing.get_type_hints(record, include_extras=True).items():
        origin = typing.get_origin(tp)
        if origin in (typing.NotRequired, typing.Required):
            hints[key] = typing.get_args(tp)[0]
            if origin is typing.Required:
                required.add(key)
        else:
            hints[key] = tp
            if record.__total__:
                required.add(key)
    return hints, required


def _record_mismatch(value: Any, record: Any, at: str) -> str | None:
    if not isinstance(value, dict):
        return f"{at} is a {type(value).__name__}, not a dict"
    hints, required = _fields(record)
    missing = [k for k in hints if k in required and k not in value]
    if missing:
        return f"{_name(record)} lacks key {missing[0]!r} (it has {sorted(map(str, value))})"
    extra = [k for k in value if k not in hints]
    if extra:
        return (
            f"key {extra[0]!r} is not declared in {_name(record)} "
            f"(it declares {sorted(hints)}): declare it or remove it"
        )
    for key, v in value.items():
        if (problem := _mismatch(v, hints[key], f"{_name(record)}[{key!r}]")) is not None:
            return problem
    return None
