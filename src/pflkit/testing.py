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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

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
