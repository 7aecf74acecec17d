"""The algorithm contract.

An algorithm is a small class whose methods exchange **plain data**: dicts of tensors, numbers
and strings. No module, closure or open file crosses the client/server boundary, so the same
code runs in every engine (in-process, process pool, Ray, Flower), the engine counts
communication bytes exactly from the dicts, and every state can be checkpointed with
``torch.save``.

The algorithm object holds only its validated :class:`Algorithm.Params`. Everything else
arrives as an argument, symmetrically on both sides: client-side hooks get that client's
:class:`ClientEnv` and the :class:`RoundContext` of its round (round, phase, seed, the round's
optimiser, learning-rate factor and drop_last, a straggler's work share), server-side hooks the
:class:`ServerEnv` and the :class:`ServerContext` (round, phase, seed;
:mod:`pflkit.algorithms.context`). One round, as the engine runs it (``engine/simulation.py``)::

    for phase in algo.phases(rnd):                      # most algorithms: one phase
        sctx = ServerContext(rnd, phase, seed)
        for cid in selected:                            # same clients for every algorithm
            payload = algo.configure(senv, server, cid, sctx)                # download
        # client runner (in-process, process pool, Ray or Flower), per client:
            upload, state[cid], metrics = algo.client_update(
                envs[cid], payload, state[cid], ctx)                         # client work
        server = algo.aggregate(senv, server, uploads, sctx)

Evaluation is two hooks, one per side, in every engine: the server computes
``view = eval_view(senv, server, cid, sctx)`` (default: the global model; ``cid`` None: the
server's own model, scored on the global test set) and the client scores the module
``personal_model(env, view, state, ctx)`` returns (default: the client's model holding
``view["weights"]``); under MAP's protocol the engine passes the client's last ``upload`` too
(the model right after local training). A held-out client (``data.holdout_clients``) is scored
after ``adapt_holdout(env, payload, state, ctx)``, its personalization step. Per-client
private state (a personal model, a control variate, an HPM) starts as ``client_init(env)`` and
lives with the client; per-client *server* state lives in the server dict.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
from pydantic import Field, ValidationError
from torch import Tensor, nn

from pflkit.algorithms.context import RoundContext as RoundContext
from pflkit.algorithms.context import ServerContext as ServerContext  # re-exported
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.algorithms.records import Empty as Empty  # the base records, re-exported
from pflkit.algorithms.records import Upload as Upload
from pflkit.algorithms.records import WeightsPayload as WeightsPayload
from pflkit.algorithms.records import WeightsServer as WeightsServer
from pflkit.algorithms.records import WeightsUpload as WeightsUpload
from pflkit.errors import PflkitError
from pflkit.models import PFLModel
from pflkit.primitives.training import Weights, get_weights, set_weights
from pflkit.primitives.tree import weighted_sum
from pflkit.registry import Registry
from pflkit.strict import StrictNumbers

State = dict[str, Any]
Payload = dict[str, Any]


class _UpdateFields(NamedTuple):
    upload: Any  # sent to the server (counted as communication): the class's ``upload`` record
    state: Any  # the client's private state after the round (stays on the client): ``state``
    metrics: dict[str, float]  # diagnostics, e.g. training loss (not an upload)


class Update(_UpdateFields):
    """What :meth:`Algorithm.client_update` returns: the named tuple ``(upload, state,
    metrics)``. ``metrics`` left out (or None) is a new empty dict, one per update."""

    __slots__ = ()

    def __new__(cls, upload: Any, state: Any, metrics: dict[str, float] | None = None) -> Update:
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

    payload: ClassVar[object] = WeightsPayload
    """The record (:mod:`pflkit.algorithms.records`) of what :meth:`configure` sends a client:
    a TypedDict, or a ``typing.Union`` of them for a multi-phase algorithm whose payload differs
    by phase. The conformance suite checks every payload against it; so for the next three."""
    upload: ClassVar[object] = Upload
    """The record of what :meth:`client_update` uploads."""
    state: ClassVar[object] = Empty
    """The record of the client's private state (:meth:`client_init`, :meth:`client_update`)."""
    server: ClassVar[object] = WeightsServer
    """The record of the server state (:meth:`server_init`, :meth:`aggregate`)."""

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
    def server_init(self, env: ServerEnv) -> Any:
        """The server state before round 1; default ``{"weights": <the initial model>}``."""
        return {"weights": env.init_weights()}

    def client_init(self, env: ClientEnv) -> Any:
        """A client's private state before its first round (a personal model, a control
        variate, ...); it stays on the client. Default: empty."""
        return {}

    # -- one exchange --------------------------------------------------------------------------
    def configure(self, env: ServerEnv, server: Any, cid: int, ctx: ServerContext) -> Payload:
        """What client ``cid`` downloads for phase ``ctx.phase`` of round ``ctx.round``
        (counted as communication); default the global model as ``{"weights": ...}``."""
        return {"weights": server["weights"]}

    def client_update(self, env: ClientEnv, payload: Any, state: Any, ctx: RoundContext) -> Update:
        """Client work in phase ``ctx.phase`` of round ``ctx.round``. ``payload`` and ``state``
        are typed ``Any`` here so that each algorithm annotates them with its own records."""
        raise NotImplementedError

    def aggregate(
        self, env: ServerEnv, server: Any, uploads: Mapping[int, Any], ctx: ServerContext
    ) -> State:
        """The server state after phase ``ctx.phase`` of round ``ctx.round``, from the
        selected clients' ``uploads`` (client id -> upload). ``server`` and the uploads are
        typed ``Any`` here so that each algorithm annotates them with its own records."""
        raise NotImplementedError

    # -- evaluation ----------------------------------------------------------------------------
    def eval_view(
        self, env: ServerEnv, server: Any, cid: int | None, ctx: ServerContext
    ) -> Payload:
        """What client ``cid`` needs from the server to be scored after round ``ctx.round``
        (sent in every engine), or with ``cid`` None the server's own model, scored on the
        global test set as ``view["weights"]`` (``{}``: the algorithm has none). Default: the
        global model, ``{"weights": server["weights"]}``, for both; ``{}`` when the server
        holds no ``"weights"``."""
        return {"weights": server["weights"]} if "weights" in server else {}

    def personal_model(
        self,
        env: ClientEnv,
        view: Payload,
        state: Any,
        ctx: RoundContext,
        upload: Any = None,
    ) -> nn.Module:
        """The module scored on the client's local test (and validation) split: its
        personalized model after round ``ctx.round`` (``ctx.phase`` is ``"evaluate"``; a
        model that trains first, FedAvg-FT's, trains here). With ``upload`` (MAP's protocol:
        selected clients, scored right after their local training), the model this round's
        local training left, the client's last upload of the round given.

        Default: the client's model holding the uploaded ``upload["weights"]`` under MAP's
        protocol, else the global ``view["weights"]`` (:func:`load_model`). An algorithm whose
        personalized model is more than a :class:`~pflkit.models.PFLModel` (GPFL's conditional
        valve, FedRoD's two heads) builds that module here from its state and the view."""
        weights = view.get("weights") if upload is None else upload.get("weights")
        if weights is None:
            where = "view" if upload is None else "upload"
            raise PflkitError(
                f"algorithm '{self.name}' has no personal model and its {where} holds no "
                "'weights': override personal_model (docs/guide.md)"
            )
        return load_model(env, weights)

    def features(self, model: nn.Module, x: Tensor) -> Tensor:
        """The features of ``x`` that the scoring ``model`` (:meth:`personal_model`) classifies,
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

    def adapt_holdout(self, env: ClientEnv, payload: Any, state: Any, ctx: RoundContext) -> Any:
        """The personalization step of a held-out client (``data.holdout_clients``: a client
        that never trains), run before it is scored with :meth:`personal_model`. The engine
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


def load_model(env: ClientEnv, weights: Weights, slot: int | str = 0) -> PFLModel:
    """The client's reusable model in ``slot`` holding ``weights`` (what
    :meth:`Algorithm.personal_model` returns for a plain personalized model)."""
    model = env.model(slot)
    set_weights(model, weights)
    return model


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
    ups: list[Mapping[str, Any]] = list(uploads.values())  # read by the key ``key``
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


# contract v3's hooks and what replaced them in v4 (issue 55)
RENAMED_HOOKS = {
    "global_weights": "eval_view(env, server, None, ctx)",
    "personal_weights": "personal_model(env, view, state, ctx, upload=None)",
    "trained_weights": "personal_model(env, view, state, ctx, upload)",
    "scoring_model": "personal_model(env, view, state, ctx, upload=None)",
}
SERVER_HOOKS = ("configure", "aggregate", "eval_view")


def check_contract(cls: type[Algorithm]) -> None:
    """Refuse, in one sentence, a class written against contract v3: a removed evaluation hook,
    or a server hook that still takes ``(rnd, phase)`` instead of the ServerContext."""
    for old, new in RENAMED_HOOKS.items():
        if old in vars(cls):
            raise PflkitError(
                f"algorithm '{cls.name}' defines {old}, which contract v4 replaced: define "
                f"{new} instead (docs/guide.md, 'The contract on one screen')"
            )
    for hook in SERVER_HOOKS:
        fn = vars(cls).get(hook)
        params = list(inspect.signature(fn).parameters) if callable(fn) else []
        if "rnd" in params or "phase" in params:
            raise PflkitError(
                f"algorithm '{cls.name}' defines {hook} with (rnd, phase): since contract v4 "
                f"server hooks take one ServerContext ctx (ctx.round, ctx.phase) instead "
                "(docs/guide.md, 'The contract on one screen')"
            )


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: register an algorithm under its ``name`` (:meth:`Registry.add`), after
    :func:`check_contract`."""
    check_contract(cls)
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
) -> tuple[Weights, float]:
    """Load ``weights`` into the client's reusable model, train it locally in round context
    ``ctx`` (:meth:`ClientEnv.train`), return ``(new weights, mean loss)``: the body of every
    FedAvg-like client step."""
    model = load_model(env, weights, slot)
    loss = env.train(model, ctx, **overrides)
    return get_weights(model), loss
