"""Secure aggregation on Flower (``pflkit flower local|run --secagg``): the server learns only
the sum of the SuperNodes' uploads, through Flower's own SecAgg+ protocol (the client mod
``flwr.client.mod.secaggplus_mod`` on the nodes, ``flwr.server.workflow.SecAggPlusWorkflow``
in the ServerApp); pflkit writes no cryptography of its own.

How a round's training phase runs (:func:`secure_phase`):

- Each SuperNode that hosts clients of the round gets one message per SecAgg+ stage (setup,
  share keys, collect masked vectors, unmask). The third carries the payloads of all its
  clients: the node trains them, computes their weighted mean ``M_k`` and its weight ``w_k``
  (the sum of their ``num_samples``, or their count under ``weighting: uniform``) and hands
  ``(M_k, w_k)`` to the mod, which quantizes ``(w_k / W) M_k`` (``W``: the round's total
  weight), masks it and sends only the masked integers. The node is the unit of privacy: its
  clients' uploads are summed on the node, which holds their data anyway.
- The server sums the masked vectors, removes the masks with the shares of the unmask stage and
  dequantizes: the weighted mean of all uploads, without any node's. pflkit hands that mean to
  the algorithm's own ``aggregate`` as the upload of every client of the round (identical
  uploads: any weighted mean of them is the mean itself).

So only an algorithm whose ``aggregate`` needs nothing but the (sample-weighted or uniform)
mean of tensor uploads can run: :func:`declared` reads the upload keys that are summed and the
weightings from the class attributes ``release`` and ``secagg``; ``tests/test_flower_secagg.py``
checks every eligible algorithm against its own aggregate. Others are refused before anything
starts (:func:`secure_keys`).

Quantization error (SecAgg+ sums integers). With clipping range ``c``, quantization range ``T``,
``n`` nodes in the round and ``D`` the securely summed weight share (1 when every node of the
round answers), each entry of the secure mean is within ``4 n c / (T D)`` of the exact
weighted mean (:func:`error_bound`): stochastic rounding of each node's entry costs less than
``2c / T`` each, and rounding each node's weight share to a multiple of ``1/T`` at most as
much again. Every entry of a summed upload must lie in ``[-c, c]`` (a node refuses otherwise:
clipping would bias the mean silently). Integer entries (BatchNorm's step counter) are not
summed: the server keeps the value it sent (0 for an upload that is a delta).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pflkit.errors import PflkitError

if TYPE_CHECKING:
    from pflkit.config import ExperimentConfig

DEFAULT_CLIP = 8.0  # Flower's default clipping range
DEFAULT_QUANTIZATION = 2**22  # Flower's default quantization range
MOD_RANGE = 2**32  # Flower's default (and largest) modulus range: masks are drawn below it
SHARES = 1.0  # every node of the round holds a share of every other's secrets
THRESHOLD = 0.5  # shares needed to unmask: half of them, and at least 2 (Flower's rule)

# why an algorithm cannot run on the sum of the uploads, when its class gives no reason
NEEDS_EACH = "its server step needs each client's upload, not only their sum"

CONFIGS = "pflkit.secagg"  # the node's result record (layout, metrics) inside FitRes.metrics


@dataclass(frozen=True)
class SecAggOptions:
    """SecAgg+'s quantization: every entry of a summed upload lies in ``[-clip, clip]``, which
    is mapped onto the integers ``0 .. quantization``."""

    clip: float = DEFAULT_CLIP
    quantization: int = DEFAULT_QUANTIZATION

    def __post_init__(self) -> None:
        c, q = self.clip, self.quantization
        if isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c <= 0:
            raise PflkitError(
                f"--secagg-clip {c} is not a positive number: give the bound on the magnitude "
                f"of every uploaded entry, e.g. {DEFAULT_CLIP}"
            )
        if isinstance(q, bool) or not isinstance(q, int) or not 2 <= q < MOD_RANGE // 2:
            raise PflkitError(
                f"--secagg-quantization {q} is not an integer from 2 to 2**31 - 1 "
                f"({MOD_RANGE // 2 - 1}): SecAgg+ quantizes to 32-bit integers and sums them "
                f"below 2**32 (Flower's default is 2**22 = {DEFAULT_QUANTIZATION})"
            )

    def check_nodes(self, nodes: int) -> None:
        """The sum of ``nodes`` quantized vectors must stay below the modulus 2**32."""
        if nodes * self.quantization >= MOD_RANGE:
            raise PflkitError(
                f"--secagg-quantization {self.quantization} times {nodes} SuperNodes reaches "
                f"2**32, where SecAgg+'s sum wraps around: give at most "
                f"{(MOD_RANGE - 1) // nodes} (or fewer SuperNodes)"
            )

    def run_config(self) -> dict[str, float]:
        """The run-config keys (``flwr run --run-config``) that switch it on."""
        return {"secagg": 1.0, "secagg-clip": self.clip, "secagg-quantization": self.quantization}

    @classmethod
    def from_run_config(cls, rc: Mapping[str, Any]) -> SecAggOptions | None:
        if not float(rc.get("secagg", 0) or 0):
            return None
        q = float(rc.get("secagg-quantization", DEFAULT_QUANTIZATION))
        return cls(float(rc.get("secagg-clip", DEFAULT_CLIP)), int(q) if q.is_integer() else q)


def error_bound(nodes: int, clip: float, quantization: int, share: float = 1.0) -> float:
    """The largest distance of an entry of the secure mean from the exact weighted mean of the
    same uploads (module docstring): ``4 n c / (T D)``."""
    return 4 * nodes * clip / (quantization * share)


def declared(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(Summed upload keys, weightings) under which ``cls``'s aggregate needs only the mean of
    its uploads: the class attributes ``release`` (the keys) and ``secagg`` (the weightings),
    the latter counted only on the class that defines ``aggregate`` or below it (a subclass
    with its own aggregate declares anew); None: it needs each upload."""
    owner = next(k for k in cls.__mro__ if "aggregate" in vars(k))
    where = next((k for k in cls.__mro__ if "secagg" in vars(k)), None)
    if where is None or not issubclass(where, owner):
        return None
    weightings = tuple(vars(where)["secagg"])
    release = getattr(cls, "release", None)
    return (tuple(release), weightings) if weightings and release else None


def describe(cls: type) -> str:
    """What ``pflkit list --params`` says of --secagg for ``cls`` (one line)."""
    entry = declared(cls)
    if entry is None:
        return f"--secagg: refused, {refusal(cls)}"
    return f"--secagg: sums {', '.join(entry[0])} (weighting: {' or '.join(entry[1])})"


def refusal(cls: type) -> str:
    """Why ``cls`` cannot run on the sum of its uploads (a clause)."""
    each = cls.uses_each_upload and f"its server {cls.uses_each_upload}"
    return cls.secagg_refusal or each or NEEDS_EACH


def eligible() -> list[str]:
    """The registered algorithms that can run with --secagg (some with one weighting only)."""
    from pflkit.algorithms.base import ALGORITHMS

    return sorted(n for n in ALGORITHMS if declared(ALGORITHMS.lookup(n)) is not None)


def secure_keys(cfg: ExperimentConfig | Mapping[str, Any]) -> tuple[tuple[str, ...], bool]:
    """(The upload keys summed, whether the mean is uniform) of a config's algorithm (``cfg``:
    the config, whose parsed section is used, or an algorithm section, parsed here); refuses
    one that needs more than the mean of its uploads with one sentence."""
    from pflkit.algorithms.base import parse_params
    from pflkit.config import ExperimentConfig
    from pflkit.experiment import algorithm_of

    if isinstance(cfg, ExperimentConfig):
        typed = algorithm_of(cfg)
        cls, params = typed.cls, typed.params
    else:
        cls, params = parse_params(cfg)
    name = cls.name
    weighting = getattr(params, "weighting", "samples")
    entry = declared(cls)
    if entry is None:
        why = refusal(cls)
        able = ", ".join(eligible())
        raise PflkitError(
            f"--secagg cannot run '{name}': {why}, while secure aggregation shows the server "
            f"only the sum of the uploads (it can run: {able})"
        )
    keys, weightings = entry
    if weighting not in weightings:
        raise PflkitError(
            f"--secagg cannot run '{name}' with weighting: {weighting}: its server step needs "
            f"the plain sum of the uploads besides their weighted mean; set "
            f"algorithm.weighting=uniform"
        )
    return keys, weighting == "uniform"


def check_rounds(cfg: Any, node_of: Mapping[int, Any], options: SecAggOptions) -> None:
    """Refuse a run in which some round's training clients all live on one SuperNode (its
    sum would be its own upload), or whose SuperNodes overflow the quantization; ``node_of``:
    client -> node."""
    from pflkit.engine.clients import system_draw
    from pflkit.engine.population import held_out
    from pflkit.engine.simulation import sample_clients

    hosts = len(set(node_of.values()))
    if hosts < 2:
        raise PflkitError(
            f"--secagg needs at least 2 SuperNodes, and {hosts} hosts the clients: with a "
            "single node the sum of the uploads is that node's own upload"
        )
    options.check_nodes(hosts)
    holdout = held_out(cfg)
    for rnd in range(1, cfg.train.rounds + 1):
        selected = sample_clients(
            cfg.seed, rnd, cfg.data.num_clients, cfg.train.client_fraction, holdout
        )
        active = [c for c in selected if not system_draw(cfg.system, cfg.seed, rnd, c)[0]]
        nodes = {node_of[c] for c in active}
        if active and len(nodes) < 2:
            raise PflkitError(
                f"--secagg needs each round's clients on at least 2 SuperNodes, but round {rnd} "
                f"trains only client(s) {', '.join(map(str, active[:8]))} on one: host the "
                "clients on more SuperNodes (--nodes) or raise train.client_fraction"
            )


# -- the node's side: the mean of its clients' uploads ---------------------------------------------


def node_mean(
    uploads: Mapping[int, Mapping[str, Any]], keys: Sequence[str], uniform: bool, clip: float
) -> tuple[dict[str, Any], list[np.ndarray], float]:
    """(layout, float64 arrays, weight) of the weighted mean of ``uploads`` (this node's
    clients) over ``keys``: what a node hands to SecAgg+. ``layout`` (structure only, no
    values) tells the server how to rebuild the upload values from the arrays."""
    from pflkit.flower.codec import encode

    layout: dict[str, Any] = {"keys": {}, "floats": []}
    sums: list[np.ndarray] = []
    total = 0.0
    for n, (cid, up) in enumerate(sorted(uploads.items())):
        extra = sorted(set(up) - set(keys) - {"num_samples"}, key=str)
        if extra:
            raise PflkitError(
                f"client {cid} uploads {extra[0]!r}, which secure aggregation does not sum "
                f"(it sums {', '.join(keys)} and num_samples)"
            )
        w = 1.0 if uniform else float(up["num_samples"])
        total += w
        i = 0
        for key in keys:
            schema, leaves = encode(up[key])
            if n == 0:
                if not _only_leaves(json.loads(schema)):
                    raise PflkitError(
                        f"client {cid}'s upload {key!r} holds numbers or strings besides "
                        "tensors: secure aggregation sums tensors only"
                    )
                layout["keys"][key] = {"schema": schema, "dtypes": {}}
            elif schema != layout["keys"][key]["schema"]:
                raise PflkitError(
                    f"client {cid}'s upload {key!r} has another structure than client "
                    f"{min(uploads)}'s on the same SuperNode: secure aggregation sums equal shapes"
                )
            for leaf, a in leaves.items():
                a = np.asarray(a)
                if n == 0:
                    layout["keys"][key]["dtypes"][leaf] = str(a.dtype)
                if not np.issubdtype(a.dtype, np.floating):
                    continue  # integer entries are not summed (module docstring)
                big = float(np.max(np.abs(a))) if a.size else 0.0
                if big > clip:
                    raise PflkitError(
                        f"client {cid}'s upload {key!r} has an entry of magnitude {big:.4g}, "
                        f"beyond --secagg-clip {clip:g}: SecAgg+ would clip it; raise "
                        "--secagg-clip (and --secagg-quantization to keep the precision)"
                    )
                if n == 0:
                    layout["floats"].append([key, leaf])
                    sums.append(np.zeros(a.shape, dtype=np.float64))
                sums[i] += w * a.astype(np.float64)
                i += 1
    means = [s / total for s in sums] if total > 0 else sums
    return layout, means, total


def _only_leaves(node: Any) -> bool:
    """Whether a flatten schema holds nothing but containers of tensor leaves."""
    if isinstance(node, dict):
        (tag, v), *_ = node.items()
        if tag in ("$t", "$n"):
            return True
        if tag == "$d":
            return all(_only_leaves(x) for _, x in v)
        if tag in ("$l", "$u"):
            return all(_only_leaves(x) for x in v)
    return False


def rebuild(
    layout: Mapping[str, Any],
    arrays: Sequence[np.ndarray],
    payload: Mapping[str, Any],
    device: Any = None,
) -> dict[str, Any]:
    """The upload values (key -> value) from the secure mean ``arrays`` in ``layout``'s
    order, cast to each leaf's dtype; an integer leaf is the payload's (same key, same
    structure) or else 0."""
    from pflkit.flower.codec import decode, encode

    at = {(key, leaf): i for i, (key, leaf) in enumerate(layout["floats"])}
    out: dict[str, Any] = {}
    for key, spec in layout["keys"].items():
        schema, dtypes = spec["schema"], spec["dtypes"]
        sent: dict[str, Any] = {}
        if key in payload:
            theirs, leaves = encode(payload[key])
            sent = leaves if theirs == schema else {}
        leaves = {}
        for leaf, dtype in dtypes.items():
            if (key, leaf) in at:
                leaves[leaf] = np.asarray(arrays[at[key, leaf]]).astype(dtype)
            else:
                shape = json_shape(schema, leaf)
                have = sent.get(leaf)
                leaves[leaf] = (
                    np.array(have, copy=True) if have is not None else np.zeros(shape, dtype)
                )
        out[key] = decode(schema, leaves, device)
    return out


def json_shape(schema: str, leaf: str) -> list[int]:
    """The shape a flatten ``schema`` records for ``leaf``."""
    found: list[list[int]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            (tag, v), *_ = node.items()
            if tag in ("$t", "$n", "$s"):
                if v[0] == leaf:
                    found.append(v[1])
            elif tag == "$d":
                for _, x in v:
                    walk(x)
            else:
                for x in v:
                    walk(x)

    walk(json.loads(schema))
    return found[0]


def secure_uploads(
    mean: Mapping[str, Any], cids: Sequence[int], weight: float
) -> dict[int, dict[str, Any]]:
    """The upload the server's ``aggregate`` gets for each client of ``cids``: the secure mean
    itself (identical uploads, so any weighted mean of them is the mean), with
    ``num_samples`` the mean weight (the server does not learn any client's own)."""
    share = max(int(round(weight / max(len(cids), 1))), 1)
    return {cid: {**mean, "num_samples": share} for cid in cids}


# -- the server's side: one training phase through SecAgg+ -----------------------------------------


@dataclass
class Outcome:
    """What one secure phase gave the server: per trained client its (identical) upload,
    metrics and node state rounds; the clients that diverged (``train.on_nan: skip_client``);
    the failed nodes with the reason; the round's protocol facts for the metrics row."""

    uploads: dict[int, dict[str, Any]]
    metrics: dict[int, dict[str, float]]
    state_rounds: dict[int, int]
    diverged: list[int]
    failed: dict[int, str]  # node -> reason
    dead: set[int]  # the failed nodes that broke (an error, no reply), not halted with others
    facts: dict[str, Any]


def secure_phase(
    exchange: Any,
    contents: Mapping[int, Any],
    weights: Mapping[int, float],
    rnd: int,
    options: SecAggOptions,
    payload: Mapping[str, Any],
    timeout: float | None,
    device: Any = None,
) -> Outcome:
    """Run SecAgg+ for one training phase. ``contents``: node -> the RecordDict of its
    collect-stage message (pflkit's job: config, coordinates, its clients' payloads);
    ``weights``: client -> the weight it carries in the mean (``num_samples`` or 1), as the
    server knows it (the sum is the round's ``W``, SecAgg+'s ``max_weight``);
    ``exchange(messages, timeout)``: push messages and return the replies by position (None:
    none in time), pflkit's fast poll instead of Grid.send_and_receive's 3-s sleeps;
    ``payload``: one client's payload (integer leaves come from it)."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.common import FitIns, Parameters, parameters_to_ndarrays
    from flwr.server import LegacyContext, SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.strategy import Strategy
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

    failed: dict[int, str] = {}

    class Fast:
        """The Grid as the workflow uses it (send_and_receive), on pflkit's exchange; records
        why a node dropped out."""

        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            out = []
            for i, reply in exchange(messages, timeout).items():
                node = messages[i].metadata.dst_node_id
                if reply is None:
                    failed.setdefault(node, f"no SecAgg+ reply within {timeout} s")
                    continue
                if reply.has_error():
                    failed.setdefault(node, f"error {reply.error.code}: {reply.error.reason}")
                out.append(reply)  # the workflow counts an error reply as a failure itself
            return out

    class Adapter(Strategy):
        """The legacy Strategy the workflow drives: its fit step is pflkit's training job on
        each node; its aggregate keeps the securely summed mean for pflkit's algorithm."""

        results: list = []

        def configure_fit(self, server_round, parameters, client_manager):
            empty = FitIns(Parameters(tensors=[], tensor_type=""), {})
            return [(proxy, empty) for proxy in proxies]

        def aggregate_fit(self, server_round, results, failures):
            self.results = results
            return (results[0][1].parameters if results else None), {}

        def initialize_parameters(self, client_manager):
            return None

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    class Workflow(SecAggPlusWorkflow):
        contributors: set[int] = set()

        def collect_masked_vectors_stage(self, grid, context, state):
            for nid, fitins in state.nid_to_fitins.items():  # pflkit's job rides along
                for name, record in contents[nid].items():
                    fitins[name] = record
            return super().collect_masked_vectors_stage(grid, context, state)

        def unmask_stage(self, grid, context, state):
            self.contributors = set(state.active_node_ids)  # whose masked vectors were summed
            return super().unmask_stage(grid, context, state)

    total = float(sum(weights.values()))
    workflow = Workflow(
        SHARES,
        THRESHOLD,
        max_weight=total,
        clipping_range=float(options.clip),
        quantization_range=int(options.quantization),
        modulus_range=MOD_RANGE,
        timeout=timeout,
    )
    strategy = Adapter()
    state_records = RecordDict(
        {
            MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd}),
            MAIN_PARAMS_RECORD: ArrayRecord(),
        }
    )
    base = Context(run_id=0, node_id=0, node_config={}, state=state_records, run_config={})
    proxies = [GridClientProxy(nid, None, 0) for nid in contents]  # the nodes of the round
    manager = SimpleClientManager()
    for proxy in proxies:
        manager.register(proxy)
    context = LegacyContext(base, strategy=strategy, client_manager=manager)
    state = WorkflowState()
    grid = Fast()
    halted = None
    for step in (
        workflow.setup_stage,
        workflow.share_keys_stage,
        workflow.collect_masked_vectors_stage,
        workflow.unmask_stage,
    ):
        try:
            ok = step(grid, context, state)
        except ZeroDivisionError:  # every client of the round diverged: a weight of 0
            ok = False
        if not ok:
            halted = step.__name__.removesuffix("_stage").replace("_", " ")
            break
    facts = {
        "nodes": len(contents),
        "threshold": state.threshold,
        "clip": float(options.clip),
        "quantization": int(options.quantization),
    }
    dead = set(failed)
    results = strategy.results if halted is None else []
    infos = {proxy.node_id: json.loads(str(res.metrics[CONFIGS])) for proxy, res in results}
    if halted is not None:
        for nid in contents:
            failed.setdefault(
                nid,
                f"secure aggregation halted in its {halted} stage: fewer than "
                f"{state.threshold} SuperNodes of the round answered",
            )
    for nid in contents:
        if nid not in infos and nid not in failed:
            failed[nid] = "dropped out of the SecAgg+ protocol"
    out = Outcome({}, {}, {}, [], failed, dead, facts)
    if not infos:
        return out
    layouts = {json.dumps(info["layout"], sort_keys=True) for info in infos.values()}
    if len(layouts) > 1:
        raise PflkitError(
            "the SuperNodes' uploads have different structures: secure aggregation sums "
            "uploads of one shape (a model per architecture is not supported)"
        )
    layout = next(iter(infos.values()))["layout"]
    mean = rebuild(layout, parameters_to_ndarrays(results[0][1].parameters), payload, device)
    trained: list[int] = []
    for info in infos.values():
        out.diverged += [int(c) for c in info["diverged"]]
        for cid, facts_c in info["clients"].items():
            trained.append(int(cid))
            out.metrics[int(cid)] = facts_c["metrics"]
            out.state_rounds[int(cid)] = facts_c["rounds"]
    share = sum(weights[c] for c in trained) / total  # D: the weight that was summed
    out.facts["error_bound"] = error_bound(len(infos), options.clip, options.quantization, share)
    out.uploads = secure_uploads(mean, sorted(trained), share * total)
    return out
