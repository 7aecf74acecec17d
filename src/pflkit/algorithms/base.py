"""The algorithm contract.

An algorithm is a small class whose methods exchange **plain data**: dicts of tensors, numbers
and strings. No module, closure or open file crosses the client/server boundary, so the same
code runs in every engine (in-process, process pool, Flower), the engine counts communication
bytes exactly from the dicts, and every state can be checkpointed with ``torch.save``.

The algorithm object holds only its validated :class:`Algorithm.Params`. Everything else
arrives as an argument: client-side methods get that client's :class:`ClientEnv` and the
:class:`RoundContext` of its round (round, phase, seed, the round's optimiser, learning-rate
factor and drop_last, a straggler's work share; :mod:`pflkit.algorithms.context`), server-side
methods the :class:`ServerEnv` (:mod:`pflkit.algorithms.env`) and the round. One round, as the
engine runs it (``engine/simulation.py``)::

    for phase in algo.phases(rnd):                      # most algorithms: one phase
        for cid in selected:                            # same clients for every algorithm
            payload = algo.configure(senv, server, cid, rnd, phase)          # download
        # client runner (in-process, process pool or Flower), per client:
            upload, state[cid], metrics = algo.client_update(
                envs[cid], payload, state[cid], ctx)                         # client work
        server = algo.aggregate(senv, server, uploads, rnd, phase)

Evaluation takes the same inputs in every engine: the server computes
``view = eval_view(senv, server, cid, rnd)`` (default: the global model) and the client scores
``personal_weights(env, view, state, ctx)`` (None: "the global model", ``view["weights"]``);
MAP's protocol scores ``trained_weights(env, view, upload, state, ctx)``; a held-out client
(``data.holdout_clients``) is scored after ``adapt_holdout(env, payload, state, ctx)``, its
personalization step.
``global_weights(senv, server, rnd)`` is the server's model on the global test set.
Per-client private state (a personal model, a control variate, an HPM) starts as
``client_init(env)`` and lives with the client; per-client *server* state lives in the server
dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
from pydantic import Field, ValidationError
from torch import Tensor, nn

from pflkit.primitives.training import Weights, get_weights, set_weights
from pflkit.primitives.tree import weighted_sum
from pflkit.algorithms.context import RoundContext
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.errors import PflkitError
from pflkit.models import PFLModel
from pflkit.registry import Registry
from pflkit.strict import StrictNumbers

State = dict[str, Any]
Payload = dict[str, Any]
Upload = dict[str, Any]


class _UpdateFields(NamedTuple):
    upload: Upload  # sent to the server (counted as communication)
    state: State  # the client's private state after the round (stays on the client)
    metrics: dict[str, float]  # diagnostics, e.g. training loss (not an upload)


class Update(_UpdateFields):
    """What :meth:`Algorithm.client_update` returns: the named tuple ``(upload, state,
    metrics)``. ``metrics`` left out (or None) is a new empty dict, one per update."""

    __slots__ = ()

    def __new__(cls, upload: Upload, state: State, metrics: dict[str, float] | None = None):
        return super().__new__(cls, upload, state, {} if metrics is None else metrics)


def param(default: Any, source: str, **constraints: Any) -> Any:
    """A typed algorithm parameter whose default comes from ``source`` ("paper", "authors'
    code", "MAP §4.2.2", ...); ``pflkit list --params NAME`` prints it. ``constraints`` are
    pydantic's (``gt``, ``ge``, ``le``, ...)."""
    return Field(default, json_schema_extra={"source": source}, **constraints)


class Algorithm:
    """Base class: FedAvg-style defaults that subclasses override piece by piece."""

    name: ClassVar[str]
    """The registry key, e.g. ``"fedavg"`` (``algorithm.name`` in a config)."""
    description: ClassVar[str]
    """One line for ``pflkit list``."""
    release: ClassVar[Mapping[str, str | None] | None] = None
    """The release map: what leaves the client, upload key -> the payload key it updates (the
    update is ``upload[key] - payload[ref]``, e.g. ``{"weights": "weights"}``) or None for a
    statistic released as it is (prototypes, logits). Client-level DP
    (:mod:`pflkit.privacy.client_dp`) clips and noises exactly these; an upload may carry
    nothing else but ``num_samples``. None: not declared, and client-level DP is refused
    with ``release_refusal`` (why its uploads cannot be bounded)."""
    release_refusal: ClassVar[str] = "its release map is not declared yet"
    """Why client-level DP is refused when ``release`` is None."""
    uses_each_upload: ClassVar[str] = ""
    """Why the server needs each client's upload, not only a (weighted) mean of the uploads
    (similarity, attention, distillation, clustering); "" (default): it uses only the mean.
    Central client-level DP and secure aggregation hand the server only the sum, so they are
    refused with this reason."""
    secagg: ClassVar[tuple[str, ...]] = ()
    """The weightings under which ``aggregate`` needs only the (weighted) mean of the released
    uploads: Flower's --secagg (:mod:`pflkit.flower.secagg`) hands it that mean alone. It counts
    on the class that defines ``aggregate`` and its subclasses; () (default): refused, with
    ``secagg_refusal``, else ``uses_each_upload``, as the reason."""
    secagg_refusal: ClassVar[str] = ""
    """Why --secagg is refused, where ``uses_each_upload`` does not say it."""
    sample_dp_covered: ClassVar[bool] = False
    """DP-SGD (:mod:`pflkit.privacy.dpsgd`) covers the class: every use of a client's data is
    local steps through ClientEnv.train on a batch mean of per-sample losses plus data-free
    terms. Counted only on the class that declares it (a subclass may change the loss)."""
    private: ClassVar[tuple[str, ...]] = ()
    """The client-state keys that never leave the client (its personal parts); the privacy
    tests check that no upload carries any of their tensors."""
    vectorize: ClassVar[bool] = False
    """engine.vectorize (:mod:`pflkit.engine.vectorized`): True where the local work is
    optimizer steps through ClientEnv.train with cross_entropy or a StackableLoss, no grad hook
    but train.grad_clip's, so the engine can train the cohort as one batched computation. Read
    from the class's own body only: a subclass that changes the local work does not inherit
    it."""

    class Params(StrictNumbers):
        """The algorithm's hyper-parameters (each declared with :func:`param`)."""

    def __init__(self, params: Params):
        self.params = params
        """The validated hyper-parameters; the object holds nothing else."""

    def check(self, env: ServerEnv) -> None:
        """Refuse a run this algorithm cannot do (no public set, mixed architectures, ...) with
        a :class:`PflkitError`; called once when the engine is built."""

    # -- round structure -------------------------------------------------------------------
    def phases(self, rnd: int) -> Sequence[str]:
        """Names of the exchanges in round ``rnd`` (multi-phase rounds return several)."""
        return ("train",)

    # -- state ---------------------------------------------------------------------------------
    def server_init(self, env: ServerEnv) -> State:
        """The server state before round 1; default ``{"weights": <the initial model>}``."""
        return {"weights": env.init_weights()}

    def client_init(self, env: ClientEnv) -> State:
        """A client's private state before its first round (a personal model, a control
        variate, ...); it stays on the client. Default: empty."""
        return {}

    # -- one exchange --------------------------------------------------------------------------
    def configure(self, env: ServerEnv, server: State, cid: int, rnd: int, phase: str) -> Payload:
        """What client ``cid`` downloads for phase ``phase`` of round ``rnd`` (counted as
        communication); default the global model as ``{"weights": ...}``."""
        return {"weights": server["weights"]}

    def client_update(
        self, env: ClientEnv, payload: Payload, state: State, ctx: RoundContext
    ) -> Update:
        """Client work in phase ``ctx.phase`` of round ``ctx.round``."""
        raise NotImplementedError

    def aggregate(
        self, env: ServerEnv, server: State, uploads: Mapping[int, Upload], rnd: int, phase: str
    ) -> State:
        """The server state after phase ``phase`` of round ``rnd``, from the selected clients'
        ``uploads`` (client id -> upload)."""
        raise NotImplementedError

    # -- evaluation ----------------------------------------------------------------------------
    def global_weights(self, env: ServerEnv, server: State, rnd: int) -> Weights | None:
        """The server's model after round ``rnd``, scored on the global test set (None: the
        algorithm has none)."""
        return server.get("weights")

    def eval_view(self, env: ServerEnv, server: State, cid: int, rnd: int) -> Payload:
        """What client ``cid`` needs from the server to evaluate after round ``rnd``: default
        the global model as ``{"weights": ...}`` (nothing when there is none). Sent in every
        engine."""
        gw = self.global_weights(env, server, rnd)
        return {} if gw is None else {"weights": gw}

    def personal_weights(
        self, env: ClientEnv, view: Payload, state: State, ctx: RoundContext
    ) -> Weights | None:
        """The client's personalized model; ``None`` means the global model. ``ctx`` is the
        evaluation's round context (phase ``"evaluate"``), for a model that trains first."""
        return None

    def scoring_model(self, env: ClientEnv, weights: Weights) -> nn.Module:
        """The module that scores ``weights`` (what :meth:`personal_weights` or
        :meth:`trained_weights` returned) on the client's local test (and validation) split:
        by default the client's model with ``weights`` loaded. An algorithm whose personalized model is more
        than a :class:`~pflkit.models.PFLModel` (GPFL's conditional valve, FedRoD's two heads)
        builds it here from the same plain dict."""
        model = env.model()
        set_weights(model, weights)
        return model

    def features(self, model: nn.Module, x: Tensor) -> Tensor:
        """The features of ``x`` that the scoring ``model`` (:meth:`scoring_model`) classifies,
        ``[B, K]``, for feature maps (``pflkit analyze features``, GPFL Fig. 2): by default the
        body output of its :class:`~pflkit.models.PFLModel`, the model itself or the one a
        scoring wrapper holds as ``model.model`` (FedProto's nearest prototype, FedRoD's two
        heads). An algorithm that classifies something else overrides it (GPFL: its
        personalized route)."""
        inner = model if isinstance(model, PFLModel) else getattr(model, "model", None)
        if not isinstance(inner, PFLModel):
            raise PflkitError(
                f"algorithm '{self.name}' scores a {type(model).__name__} without a body to "
                "take features from: override the algorithm's features(model, x) (docs/guide.md)"
            )
        return inner.features(x)

    def trained_weights(
        self, env: ClientEnv, view: Payload, upload: Upload, state: State, ctx: RoundContext
    ) -> Weights:
        """The client's model right after its local training in this round, for MAP's
        personalization protocol (selected clients, after local training): its personalized
        model if it keeps one, else the model it uploaded."""
        personal = self.personal_weights(env, view, state, ctx)
        return personal if personal is not None else upload["weights"]

    def adapt_holdout(
        self, env: ClientEnv, payload: Payload, state: State, ctx: RoundContext
    ) -> State:
        """The personalization step of a held-out client (``data.holdout_clients``: a client
        that never trains), run before it is scored with :meth:`personal_weights`. The engine
        calls it once per phase of ``phases(round)``, in order, with the payload ``configure``
        gives that client from the server state after the round, ``ctx.phase`` the phase's
        name, and the state the previous call returned (first: ``client_init``); torch is
        seeded from (seed, round, phase index, client). The adapted state is scored, then
        thrown away: nothing is uploaded and the server never sees it.

        Default: the client's own local update, as if it had been selected
        (``client_update(...).state``). A client whose personalized model is the global model
        (FedAvg, FedProx, ...) is then still scored with the global model; Ditto trains its
        personal model, FedRep its head on the received body, Local its own model from its
        first state. An algorithm whose local update needs what a held-out client cannot have
        overrides it (docs/guide.md, "Held-out clients", lists which)."""
        return self.client_update(env, payload, state, ctx).state


def vectorizable(cls: type[Algorithm]) -> bool:
    """Whether ``cls`` itself declares ``vectorize = True`` (not inherited)."""
    return bool(cls.__dict__.get("vectorize", False))


# how the server averages client models: by n_k (FedAvg) or the plain mean (MAP Alg. 1)
Weighting = Literal["samples", "uniform"]


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
    return weighted_sum([u[key] for u in ups], [wu / total for wu in w], like=ups[0][key])


def nbytes(obj: Any) -> int:
    """Exact size of a payload/upload: tensor and array bytes, 8 per number, UTF-8 length of
    strings."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray | np.generic):
        return int(obj.nbytes)
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
ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm")


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: register an algorithm under its ``name`` (:meth:`Registry.add`)."""
    return ALGORITHMS.add(cls)


def parse_params(algo_cfg: Mapping[str, Any]) -> tuple[type[Algorithm], Algorithm.Params]:
    """Look up ``algo_cfg['name']`` and validate the remaining keys as its Params."""
    name = algo_cfg["name"]
    cls = ALGORITHMS.lookup(name)
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


def resolve_params(algo_cfg: Mapping[str, Any], weighting: str | None = None) -> dict[str, Any]:
    """``algo_cfg`` with every parameter validated and every default filled in (what a run's
    config.yaml records; :func:`typed_params` parses it)."""
    cls, params = typed_params(algo_cfg, weighting)
    return {"name": cls.name, **params.model_dump(mode="json")}


def typed_params(
    algo_cfg: Mapping[str, Any], weighting: str | None = None
) -> tuple[type[Algorithm], Algorithm.Params]:
    """The algorithm class and typed parameters of ``algo_cfg``, parsed once
    (:func:`parse_params`). ``weighting`` (``train.weighting``) sets the ``weighting``
    parameter of every algorithm that has one; an algorithm entry that asks for another is
    refused."""
    if weighting is not None:
        cls = ALGORITHMS.lookup(algo_cfg["name"])
        own = algo_cfg.get("weighting", weighting)
        if "weighting" in cls.Params.model_fields:
            if own != weighting:
                raise PflkitError(
                    f"algorithm '{cls.name}' sets weighting: {own}, but train.weighting is "
                    f"{weighting}: remove one of them (train.weighting applies to every algorithm)"
                )
            algo_cfg = {**algo_cfg, "weighting": weighting}
    return parse_params(algo_cfg)


def build_algorithm(algo_cfg: Mapping[str, Any]) -> Algorithm:
    """The algorithm an ``algorithm:`` config entry names (``{"name": "fedprox", "mu":
    0.01}``), with its parameters validated (unknown names and keys are one sentence)."""
    cls, params = parse_params(algo_cfg)
    return cls(params)


def train_from(
    env: ClientEnv, weights: Weights, ctx: RoundContext, slot: int | str = 0, **overrides: Any
):
    """Load ``weights`` into the client's reusable model, train it locally in round context
    ``ctx`` (:meth:`ClientEnv.train`), return ``(new weights, mean loss)``: the body of every
    FedAvg-like client step."""
    model = env.model(slot)
    set_weights(model, weights)
    loss = env.train(model, ctx, **overrides)
    return get_weights(model), loss
