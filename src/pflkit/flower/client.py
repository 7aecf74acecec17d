"""The ClientApp: a SuperNode runs pflkit's client work for the clients it hosts.

A SuperNode hosts the clients named by its node config, ``client-ids`` (``"3"``, ``"0,4,8"``
or ``"0-9"``), or else Flower's usual ``partition-id``. Every message carries the resolved
pflkit config, so a node needs only pflkit and the dataset files (it builds the same partition
as the server from ``data.seed``); a client's private state (an HPM, a control variate, a
personal model) lives in the node's ``context.state`` between rounds, one entry per client.

Message types (the server side is :mod:`pflkit.flower.server`):

- ``query``: reply with the hosted client ids;
- ``train``: seed torch exactly as the embedded engine does, run ``client_update`` on the
  payload, keep the new state, reply with the upload and the metrics;
- ``evaluate``: score the client's personalized model (``personal``) or, for MAP's protocol,
  its model right after this round's local training (``selected``) on its local test split
  (and validation split, ``data.val_fraction``); reply with ``{"test": ..., "val": ...}``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import yaml
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from pflkit.algorithms import build_algorithm
from pflkit.data.federated import build_federated
from pflkit.engine.clients import (
    EVALUATE,
    evaluate_client,
    init_client,
    round_context,
    system_draw,
    train_client,
)
from pflkit.engine.envs import make_envs
from pflkit.errors import PflkitError
from pflkit.experiment import validate
from pflkit.flower import codec

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
    """Data, client environments and algorithm built from one config (cached per process).
    The node builds every client's environment from the config; it runs only the clients it
    hosts."""

    _cache: dict[str, Worker] = {}

    def __init__(self, text: str):
        self.cfg = validate(yaml.safe_load(text))
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        _, self.envs = make_envs(self.cfg, build_federated(self.cfg.data))
        self.algo = build_algorithm(self.cfg.algorithm)

    @classmethod
    def get(cls, text: str) -> Worker:
        key = hashlib.sha256(text.encode()).hexdigest()
        if key not in cls._cache:
            cls._cache = {key: cls(text)}  # one run at a time: drop older configs
        return cls._cache[key]

    def state(self, records: RecordDict, cid: int):
        """Client ``cid``'s state on this node (``client_init`` on first use, seeded as in
        the embedded engine)."""
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
    return Message(content=codec.put_all(RecordDict(), values), reply_to=msg)


app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    return _reply(msg, clients=hosted_clients(dict(context.node_config)))


@app.train()
def train(msg: Message, context: Context) -> Message:
    info, w = _open(msg)
    cid, rnd, p = int(info["cid"]), int(info["round"]), int(info["phase_index"])
    state = w.state(context.state, cid)
    payload = codec.get(msg.content, "payload", device=w.envs[cid].device)
    phase = str(info["phase"])
    run = w.envs[cid].run  # a straggler of the round, drawn as the server draws it
    straggler = system_draw(run.system, run.seed, rnd, cid)[1]
    ctx = round_context(run, rnd, phase, straggler)
    update = train_client(w.algo, w.envs[cid], payload, state, ctx, p)
    if update is None:  # train.on_nan: skip_client; the server records a failed client
        raise PflkitError(f"client {cid} diverged in round {rnd}: left out (train.on_nan)")
    upload, state, metrics = update
    codec.put(context.state, f"state.{cid}", state)
    rounds = codec.get(context.state, f"rounds.{cid}", 0) + (p == 0)
    codec.put(context.state, f"rounds.{cid}", rounds)
    if w.cfg.eval.selected_clients:  # MAP's protocol scores it after aggregation
        codec.put(context.state, f"upload.{cid}", upload)
    return _reply(msg, upload=upload, metrics=dict(metrics), state_rounds=rounds)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    info, w = _open(msg)
    cid, rnd = int(info["cid"]), int(info["round"])
    view = codec.get(msg.content, "view", device=w.envs[cid].device)
    state = w.state(context.state, cid)
    selected = info["mode"] == "selected"
    upload = (
        codec.get(context.state, f"upload.{cid}", device=w.envs[cid].device) if selected else None
    )
    e = w.cfg.eval
    ctx = round_context(w.envs[cid].run, rnd, EVALUATE)
    acc = evaluate_client(
        w.algo, w.envs[cid], view, state, ctx, e.batch_size, upload, e.finetune_epochs
    )
    return _reply(msg, accuracy=acc)  # {"test": ..., "val": ...}: split -> accuracy


def info_record(config_text: str, **values: Any) -> ConfigRecord:
    """The ``pflkit`` record of a message: the config and the message's coordinates."""
    return ConfigRecord({"config": config_text, **values})
