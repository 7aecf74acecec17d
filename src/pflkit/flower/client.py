"""The ClientApp: a SuperNode runs pflkit's client work for the clients it hosts.

A SuperNode hosts the clients named by its node config, ``client-ids`` (``"3"``, ``"0,4,8"``
or ``"0-9"``), or else Flower's usual ``partition-id``. Every message carries the resolved
pflkit config, so a node needs only pflkit and the dataset files (it builds the same partition
as the server from ``data.seed``); a client's private state (an HPM, a control variate, a
personal model) lives in the node's ``context.state`` between rounds, one entry per client.

Message types (the server side is :mod:`pflkit.flower.server`):

- ``query``: reply with the hosted client ids;
- ``train``: seed torch exactly as the embedded engine does, run ``client_update`` on the
  payload in the round context the job carries (``ctx``: the server's, never rebuilt here),
  keep the new state, reply with the upload and the metrics;
- ``train`` with SecAgg+'s record (``--secagg``, :mod:`pflkit.flower.secagg`): Flower's
  ``secaggplus_mod`` answers the protocol's stages; in its collect stage the node trains all
  its clients of the round as above and hands the mod the weighted mean of their uploads,
  which leaves the node only quantized and masked;
- ``evaluate``: score the client's personalized model (``personal``) or, for MAP's protocol,
  its model right after this round's local training (``selected``) on its local test split
  (and validation split, ``data.val_fraction``); reply with ``{"test": ..., "val": ...}``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from pflkit.errors import PflkitError

# torch, the engine and the codec are imported by the handlers that need them: a ClientApp
# process starts for every message, and the SecAgg+ stages other than training need neither
# (they start in 0.5 s instead of 3 s).

INFO = "pflkit"  # the ConfigRecord with config text, client id, round, phase


def hosted_clients(node_config: dict[str, Any]) -> list[int]:
    """Client ids from a node config: ``client-ids`` ("3", "0,4,8", "0-9") or ``partition-id``."""
    spec = node_config.get("client-ids")
    if spec is None:
        if "partition-id" not in node_config:
            raise PflkitError(
                "this SuperNode names no clients: start it with --node-config \"client-ids='0-4'\" "
                "(or partition-id=N)"
            )
        return [int(node_config["partition-id"])]
    out: list[int] = []
    try:
        for part in str(spec).replace(" ", "").split(","):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise PflkitError(
            f"node config client-ids={spec!r} is not a list of ids or ranges: use e.g. '0,4,8' "
            "or '0-9'"
        ) from None
    return sorted(set(out))


class Worker:
    """Data, client environments and algorithm built from one config (cached per process),
    with :func:`~pflkit.engine.worker.start_worker` like every runner's workers. The node
    builds every client's environment from the config; it runs only the clients it hosts."""

    _cache: dict[str, Worker] = {}

    def __init__(self, text: str):
        from pflkit.config_io import config_text
        from pflkit.data.federated import build_federated
        from pflkit.engine import worker
        from pflkit.experiment import validate

        # the config crossed the network as text: validated here, once per node process
        self.cfg = validate(config_text(text, "the run config's 'config'"))
        data = build_federated(self.cfg.data)
        self.task = data.task  # how evaluation scores predictions (pflkit.eval.tasks)
        spec = worker.WorkerSpec(self.cfg, threads=self.cfg.threads)
        self.algo, _, self.envs = worker.start_worker(spec, data)

    @classmethod
    def get(cls, text: str) -> Worker:
        key = hashlib.sha256(text.encode()).hexdigest()
        if key not in cls._cache:
            cls._cache = {key: cls(text)}  # one run at a time: drop older configs
        return cls._cache[key]

    def state(self, records: RecordDict, cid: int):
        """Client ``cid``'s state on this node (``client_init`` on first use, seeded as in
        the embedded engine)."""
        from pflkit.engine.clients import init_client
        from pflkit.flower import codec

        state = codec.get(records, f"state.{cid}", device=self.envs[cid].device)
        if state is None:
            state = init_client(self.algo, self.envs[cid], self.cfg.seed)
            codec.put(records, f"state.{cid}", state)
        return state


def _open(msg: Message) -> tuple[dict[str, Any], Worker]:
    """The message's ``pflkit`` record and the worker for its config."""
    info = dict(msg.content[INFO])
    return info, Worker.get(str(info["config"]))


def _reply(msg: Message, **values: Any) -> Message:
    from pflkit.flower import codec

    return Message(content=codec.put_all(RecordDict(), values), reply_to=msg)


app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    return _reply(msg, clients=hosted_clients(dict(context.node_config)))


def secagg_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower's SecAgg+ client mod for the messages of the SecAgg+ protocol (they carry its
    record); every other train message goes straight to :func:`train`."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def _train_one(w: Worker, msg: Message, context: Context, cid: int, info: dict[str, Any]):
    """Train client ``cid`` on its payload in ``msg``, in the round context its job carries,
    and keep its new state: (upload, metrics, rounds its state has seen), or None when it
    diverged (``train.on_nan: skip_client``)."""
    from pflkit.engine.clients import train_client
    from pflkit.flower import codec

    p = int(info["phase_index"])
    state = w.state(context.state, cid)
    one = "cids" not in info  # else SecAgg+: one message for the node's clients of the round
    name = "payload" if one else f"payload.{cid}"
    payload = codec.get(msg.content, name, device=w.envs[cid].device)
    ctx = received_context(msg, "ctx" if one else f"ctx.{cid}")
    update = train_client(w.algo, w.envs[cid], payload, state, ctx, p)
    if update is None:
        return None
    upload, state, metrics = update
    codec.put(context.state, f"state.{cid}", state)
    rounds = codec.get(context.state, f"rounds.{cid}", 0) + (p == 0)
    codec.put(context.state, f"rounds.{cid}", rounds)
    if w.cfg.eval.selected_clients:  # MAP's protocol scores it after aggregation
        codec.put(context.state, f"upload.{cid}", upload)
    return upload, dict(metrics), rounds


@app.train(mods=[secagg_mod])
def train(msg: Message, context: Context) -> Message:
    info, w = _open(msg)
    if "cids" in info:  # SecAgg+'s collect stage: this node's clients of the round at once
        return secure_train(msg, context, info, w)
    cid, rnd = int(info["cid"]), int(info["round"])
    result = _train_one(w, msg, context, cid, info)
    if result is None:  # train.on_nan: skip_client; the server records a failed client
        raise PflkitError(f"client {cid} diverged in round {rnd}: left out (train.on_nan)")
    upload, metrics, rounds = result
    return _reply(msg, upload=upload, metrics=metrics, state_rounds=rounds)


def secure_train(msg: Message, context: Context, info: dict[str, Any], w: Worker) -> Message:
    """Train this node's clients of the round and hand the weighted mean of their uploads to
    SecAgg+ as a FitRes (the mod quantizes, masks and sends it; the plain mean never leaves
    the node). The FitRes metrics carry the structure of the mean (no values) and each
    client's training metrics."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat

    from pflkit.flower.secagg import CONFIGS, node_mean

    rnd = int(info["round"])
    hosted = set(hosted_clients(dict(context.node_config)))
    uploads: dict[int, Any] = {}
    clients: dict[str, Any] = {}
    diverged: list[int] = []
    for cid in (int(c) for c in info["cids"]):
        if cid not in hosted:
            raise PflkitError(f"client {cid} is not hosted by this SuperNode")
        result = _train_one(w, msg, context, cid, info)
        if result is None:
            diverged.append(cid)
            continue
        uploads[cid], metrics, rounds = result
        clients[str(cid)] = {"metrics": {k: float(v) for k, v in metrics.items()}, "rounds": rounds}
    if not uploads:
        raise PflkitError(
            f"every client of this SuperNode diverged in round {rnd}: nothing to sum (train.on_nan)"
        )
    keys, uniform = list(info["keys"]), bool(info["uniform"])
    layout, arrays, weight = node_mean(uploads, keys, uniform, float(info["clip"]))
    if weight > float(info["max_weight"]) * (1 + 1e-9):
        raise PflkitError(
            f"this SuperNode's clients weigh {weight:g} in round {rnd}, more than the "
            f"{float(info['max_weight']):g} the server expects for the whole round"
        )
    facts = {"layout": layout, "clients": clients, "diverged": diverged}
    fitres = FitRes(
        status=Status(code=Code.OK, message=""),
        parameters=ndarrays_to_parameters(arrays),
        num_examples=int(round(weight)),
        metrics={CONFIGS: json.dumps(facts)},
    )
    return Message(content=compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    from pflkit.engine.clients import evaluate_client
    from pflkit.eval.metrics import extra
    from pflkit.flower import codec

    info, w = _open(msg)
    cid = int(info["cid"])
    view = codec.get(msg.content, "view", device=w.envs[cid].device)
    state = w.state(context.state, cid)
    selected = info["mode"] == "selected"
    upload = (
        codec.get(context.state, f"upload.{cid}", device=w.envs[cid].device) if selected else None
    )
    e = w.cfg.eval
    ctx = received_context(msg, "ctx")
    metrics = () if selected else extra(e.metrics)  # their statistics, for the server to sum
    acc = evaluate_client(
        w.algo,
        w.envs[cid],
        view,
        state,
        ctx,
        e.batch_size,
        upload,
        e.finetune_epochs,
        metrics=metrics,
        task=w.task,
    )
    return _reply(msg, accuracy=acc)  # {"test": ..., "val": ..., "stats": ...}: split -> accuracy


def context_data(ctx: Any) -> dict[str, Any]:
    """A job's :class:`~pflkit.algorithms.RoundContext` as plain data (its fields: numbers,
    strings, a bool), which crosses Flower's records exactly (:mod:`pflkit.flower.codec`)."""
    import dataclasses

    return dataclasses.asdict(ctx)


def received_context(msg: Message, name: str) -> Any:
    """The :class:`~pflkit.algorithms.RoundContext` the server's job sent under ``name``
    (:func:`context_data`): the node runs in the job's context, never one it rebuilds."""
    from pflkit.algorithms.context import RoundContext
    from pflkit.flower import codec

    return RoundContext(**codec.get(msg.content, name))


def info_record(config_text: str, **values: Any) -> ConfigRecord:
    """The ``pflkit`` record of a message: the config and the message's coordinates."""
    return ConfigRecord({"config": config_text, **values})
