"""The algorithm contract.

An algorithm is a small class whose methods exchange **plain data**: dicts of tensors, numbers
and strings. No module, closure or open file crosses the client/server boundary, so the same
code runs in the embedded engine and on Flower, the engine counts communication bytes exactly
from the dicts, and every state can be checkpointed with ``torch.save``.

One round, as the engine runs it (``engine/simulation.py``)::

    for phase in algo.phases(rnd):                      # most algorithms: one phase
        for cid in selected:                            # same clients for every algorithm
            payload = algo.configure(server, cid, rnd, phase)          # download
            upload, state[cid], metrics = algo.client_update(
                cid, payload, state[cid], rnd, phase)                  # client work, upload
        server = algo.aggregate(server, uploads, rnd, phase)

Evaluation asks ``global_weights(server)`` (the server's model, or None) and
``personal_weights(server, cid, state)`` (a client's personalized model, or None for "the
global model"); on a Flower SuperNode, where the client's state lives, ``server`` is the view
``eval_payload(server, cid)``. Per-client private state (a personal model, a control variate,
an HPM) starts as ``client_init(cid)`` and lives with the client; per-client *server* state
lives in the server dict.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import Tensor, nn

from pflkit.algorithms.training import Weights, get_weights, local_sgd, set_weights
from pflkit.config import ExperimentConfig
from pflkit.data.federated import ClientData, FederatedDataset
from pflkit.errors import PflkitError, unknown_name
from pflkit.models import PFLModel, build_model

State = dict[str, Any]
Payload = dict[str, Any]
Upload = dict[str, Any]


class Update(NamedTuple):
    """What :meth:`Algorithm.client_update` returns."""

    upload: Upload  # sent to the server (counted as communication)
    state: State  # the client's private state after the round (stays on the client)
    metrics: dict[str, float] = {}  # diagnostics, e.g. training loss (not an upload)


@dataclass
class Context:
    """What an algorithm may use: config, data, models, device. Built by the engine."""

    cfg: ExperimentConfig
    data: FederatedDataset
    device: torch.device = torch.device("cpu")
    _models: dict[tuple[str, int | str], PFLModel] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        m = self.cfg.model
        self._specs: dict[str, tuple[str, dict[str, Any]]] = {}
        self._global_arch = self._register(m.name, m.options)
        order: list[str] = []
        for spec in m.per_client or []:
            if isinstance(spec, str):
                order.append(self._register(spec, {}))
            else:
                order += [self._register(spec.name, spec.options)] * spec.count
        self._client_arch = order
        for arch in self._specs:  # fail on a bad name or option now, before anything runs
            self.model(arch)

    def _register(self, name: str, options: dict[str, Any]) -> str:
        key = name if not options else f"{name}{json.dumps(options, sort_keys=True)}"
        self._specs[key] = (name, options)
        return key

    def arch(self, cid: int | None = None) -> str:
        """Architecture key of client ``cid`` (``None``: the server's/global architecture)."""
        if cid is None or not self._client_arch:
            return self._global_arch
        return self._client_arch[cid % len(self._client_arch)]

    def model(self, arch: str | None = None, slot: int | str = 0) -> PFLModel:
        """A reusable model instance per (architecture, slot); load weights into it in place."""
        key = (arch or self._global_arch, slot)
        if key not in self._models:
            # its initial values are always overwritten, so building it must not consume the
            # RNG stream of the client step that happens to build it first
            with torch.random.fork_rng(devices=[]):
                self._models[key] = self.new_model(key[0])
        return self._models[key]

    def new_model(self, arch: str | None = None) -> PFLModel:
        """A freshly initialised model (uses torch's global RNG, seeded by the engine)."""
        name, options = self._specs[arch or self._global_arch]
        d = self.data
        return build_model(name, d.input_shape, d.num_classes, **options).to(self.device)

    def init_weights(self, arch: str | None = None) -> Weights:
        return get_weights(self.new_model(arch))

    def client(self, cid: int) -> ClientData:
        return self.data.clients[cid]

    def train(self, model: nn.Module, cid: int, **overrides: Any) -> float:
        """Local SGD on client ``cid``'s training split with the config's optimiser settings;
        ``overrides`` replace any of local_sgd's keyword arguments (epochs, lr, loss_fn, ...)."""
        t = self.cfg.train
        kwargs: dict[str, Any] = dict(
            epochs=t.local_epochs,
            batch_size=t.batch_size,
            lr=t.lr,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            grad_clip=t.grad_clip,
        )
        kwargs.update(overrides)
        c = self.client(cid)
        return local_sgd(model, c.train_x, c.train_y, **kwargs)


class Algorithm:
    """Base class: FedAvg-style defaults that subclasses override piece by piece."""

    name: ClassVar[str]
    description: ClassVar[str]

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, ctx: Context, params: Params):
        self.ctx = ctx
        self.params = params

    # -- round structure -------------------------------------------------------------------
    def phases(self, rnd: int) -> Sequence[str]:
        """Names of the exchanges in round ``rnd`` (multi-phase rounds return several)."""
        return ("train",)

    # -- state ---------------------------------------------------------------------------------
    def server_init(self) -> State:
        return {"weights": self.ctx.init_weights()}

    def client_init(self, cid: int) -> State:
        return {}

    # -- one exchange --------------------------------------------------------------------------
    def configure(self, server: State, cid: int, rnd: int, phase: str) -> Payload:
        return {"weights": server["weights"]}

    def client_update(
        self, cid: int, payload: Payload, state: State, rnd: int, phase: str
    ) -> Update:
        raise NotImplementedError

    def aggregate(
        self, server: State, uploads: Mapping[int, Upload], rnd: int, phase: str
    ) -> State:
        raise NotImplementedError

    # -- evaluation ----------------------------------------------------------------------------
    def global_weights(self, server: State) -> Weights | None:
        return server.get("weights")

    def personal_weights(self, server: State, cid: int, state: State) -> Weights | None:
        """Client ``cid``'s personalized model; ``None`` means the global model."""
        return None

    def eval_payload(self, server: State, cid: int) -> Payload:
        """What a client needs from the server to evaluate its personalized model where its
        state lives (a Flower SuperNode): a view of ``server`` that ``personal_weights``,
        ``global_weights`` and ``trained_weights`` accept for this client. Default: the whole
        server state; override when it holds large per-client entries."""
        return server

    def trained_weights(self, server: State, cid: int, upload: Upload, state: State) -> Weights:
        """Client ``cid``'s model right after its local training in this round, for MAP's
        personalization protocol (selected clients, after local training): its personalized
        model if it keeps one, else the model it uploaded."""
        personal = self.personal_weights(server, cid, state)
        return personal if personal is not None else upload["weights"]


def weighted_average(
    uploads: Mapping[int, Upload], key: str = "weights", uniform: bool = False
) -> Weights:
    """Mean of the uploads' ``key`` dicts, weighted by ``num_samples`` (or ``uniform``).

    Floating-point entries are averaged; integer buffers (e.g. BatchNorm's step counter) are
    taken from the first upload.
    """
    ups = list(uploads.values())
    w = [1.0 if uniform else float(u["num_samples"]) for u in ups]
    total = sum(w)
    out: Weights = {}
    for k, v in ups[0][key].items():
        if not v.is_floating_point():
            out[k] = v.clone()
            continue
        acc = torch.zeros_like(v)
        for u, wu in zip(ups, w, strict=True):
            acc.add_(u[key][k], alpha=wu / total)
        out[k] = acc
    return out


def nbytes(obj: Any) -> int:
    """Exact size of a payload/upload: tensor bytes, 8 per number, UTF-8 length of strings."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(nbytes(v) for v in obj)
    if isinstance(obj, str):
        return len(obj.encode())
    if isinstance(obj, bool | int | float):
        return 8
    if obj is None:
        return 0
    raise TypeError(f"payloads must be plain data (tensors, numbers, strings), got {type(obj)}")


# -- registry ------------------------------------------------------------------------------------
ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    ALGORITHMS[cls.name] = cls
    return cls


def parse_params(algo_cfg: Mapping[str, Any]) -> tuple[type[Algorithm], Algorithm.Params]:
    """Look up ``algo_cfg['name']`` and validate the remaining keys as its Params."""
    name = algo_cfg["name"]
    if name not in ALGORITHMS:
        raise unknown_name("algorithm", name, ALGORITHMS)
    cls = ALGORITHMS[name]
    raw = {k: v for k, v in algo_cfg.items() if k != "name"}
    try:
        return cls, cls.Params.model_validate(raw)
    except ValidationError as err:
        e = err.errors()[0]
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            known = ", ".join(cls.Params.model_fields) or "none"
            raise PflkitError(
                f"algorithm '{name}' has no parameter '{key}'; it takes: {known}"
            ) from None
        raise PflkitError(
            f"invalid algorithm parameter '{name}.{key}' (got {e.get('input')!r}): {e['msg']}"
        ) from None


def build_algorithm(ctx: Context) -> Algorithm:
    cls, params = parse_params(ctx.cfg.algorithm)
    return cls(ctx, params)


def train_from(ctx: Context, cid: int, weights: Weights, slot: int = 0, **overrides: Any):
    """Load ``weights`` into the client's reusable model, train it locally, return
    ``(new weights, mean loss)``: the body of every FedAvg-like client step."""
    model = ctx.model(ctx.arch(cid), slot)
    set_weights(model, weights)
    loss = ctx.train(model, cid, **overrides)
    return get_weights(model), loss
