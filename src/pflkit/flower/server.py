"""The ServerApp's client runner: pflkit's round loop, with the client work sent to SuperNodes.

:class:`FlowerRunner` is a :class:`~pflkit.engine.clients.ClientRunner`: the engine's own
:class:`~pflkit.engine.simulation.Simulation` runs the round loop (sampling, seeding,
aggregation, evaluation, the run folder) and hands the client side (training, evaluation) to
this runner as jobs, which it sends out as Flower messages (payload or view, and the job's
round context as plain data: the nodes run in it, they do not rebuild it); the nodes run the
same client functions as every other runner, so a Flower run reproduces the embedded run of the same config
and seed. Client state lives on the nodes: jobs carry none and results return none.

- **Node discovery.** The server asks every connected SuperNode which clients it hosts
  (``query``) until every client of the config has a node, or ``node-wait`` seconds pass.
  The map client -> node follows each node's own config, so it is stable across rounds.
- **Failures.** A message that comes back with an error, or not within ``round-timeout``
  seconds, fails its client: the client is left out of that round's aggregate and listed in
  ``failed_clients`` (with the reason in ``failures``); its node is not asked again. Other
  clients keep their state, which lives on their own nodes.
- **Not resumable.** Client state lives on the SuperNodes, so a Flower run writes no
  checkpoint.
- **Secure aggregation** (``secagg``, :mod:`pflkit.flower.secagg`): a training phase runs as
  Flower's SecAgg+ protocol, one message per stage to each node of the round; the server gets
  only the weighted mean of the uploads and hands it to the algorithm as every client's upload.
- **Traffic.** Each round's log line gives the bytes of the records the server sent to and
  received from the nodes (array data and config values; Flower's framing not counted).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, RecordDict

from pflkit.algorithms.base import Update
from pflkit.devices import resolve_device
from pflkit.engine.clients import ClientRunner, EvalJob, TrainJob
from pflkit.engine.runners import RUNNERS
from pflkit.errors import PflkitError
from pflkit.flower import codec
from pflkit.flower.client import INFO, context_data, info_record
from pflkit.flower.secagg import SecAggOptions, check_rounds, secure_keys, secure_phase


class FlowerRunner(ClientRunner):
    """Client work on Flower SuperNodes (client state lives on the nodes)."""

    keeps_state = False  # nothing to checkpoint here: a Flower run is not resumable

    def __init__(
        self,
        grid: Any,
        *,
        node_wait: float = 60.0,
        round_timeout: float | None = None,
        log=print,
        secagg: SecAggOptions | None = None,
    ):
        self.grid = grid
        self.secagg = secagg
        self.wire = [0, 0]  # bytes of records sent to and received from the nodes, this round
        self.secagg_facts: list[dict[str, Any]] = []  # one per secure phase of the round
        self.node_wait = node_wait
        self.round_timeout = round_timeout
        self.log = log
        self.node_of: dict[int, int] = {}
        self.dead: set[int] = set()
        self.failures: list[dict[str, Any]] = []
        self.state_rounds: dict[int, int] = {}

    def start(self, cfg, data) -> None:
        self.config_text = cfg.to_yaml()
        self.num_clients = data.num_clients
        self.rounds = cfg.train.rounds
        self.device = torch.device(resolve_device(cfg.device))  # where uploads are decoded to
        if self.secagg is not None:  # refuse an algorithm that needs each upload before waiting
            self.secure_keys, self.uniform = secure_keys(cfg)
        self.discover(self.node_wait)
        if self.secagg is not None:
            check_rounds(cfg, self.node_of, self.secagg)
            self.train_sizes = [c.size("train") for c in data.clients]

    # -- nodes -----------------------------------------------------------------------------
    def discover(self, wait: float) -> None:
        """Map every client to the SuperNode that hosts it."""
        n = self.num_clients
        asked: set[int] = set()
        deadline = time.monotonic() + wait
        while True:
            new = [nid for nid in self.grid.get_node_ids() if nid not in asked]
            asked.update(new)
            messages = [self._message("query", nid, RecordDict()) for nid in new]
            remaining = max(deadline - time.monotonic(), 30.0)  # a node answers a query at once
            for i, reply in self._exchange(messages, timeout=remaining).items():
                if reply is None or reply.has_error():
                    continue
                for cid in codec.get(reply.content, "clients"):
                    if 0 <= cid < n:
                        self.node_of.setdefault(cid, new[i])
            missing = [c for c in range(n) if c not in self.node_of]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise PflkitError(
                    f"no SuperNode hosts client(s) {short(missing)} of the {n} in the config "
                    f"after {wait:.0f} s: start SuperNodes with --node-config "
                    "\"client-ids='...'\" covering 0-" + str(n - 1)
                )
            time.sleep(1.0)
        nodes = sorted(set(self.node_of.values()))
        self.log(f"pflkit: {n} clients on {len(nodes)} SuperNodes")

    def _message(self, kind: str, node_id: int, content: RecordDict) -> Message:
        return Message(content=content, dst_node_id=node_id, message_type=kind)

    def _exchange(
        self, messages: list[Message], timeout: float | None
    ) -> dict[int, Message | None]:
        """Push ``messages`` and collect their replies: reply (or None: none in time) by the
        message's position. Polls quickly (Flower's send_and_receive sleeps 3 s per poll)."""
        self.wire[0] += sum(record_bytes(m.content) for m in messages)
        ids = list(self.grid.push_messages(messages)) if messages else []
        pending = {mid: i for i, mid in enumerate(ids) if mid}
        replies: dict[int, Message | None] = dict.fromkeys(range(len(ids)))
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.02
        while pending:
            for reply in self.grid.pull_messages(list(pending)):
                i = pending.pop(reply.metadata.reply_to_message_id, None)
                if i is not None:
                    replies[i] = reply
                    self.wire[1] += 0 if reply.has_error() else record_bytes(reply.content)
            if not pending or (deadline is not None and time.monotonic() > deadline):
                break
            time.sleep(pause)
            pause = min(pause * 1.5, 0.5)
        return replies

    def _send(
        self, kind: str, rnd: int, jobs: dict[int, dict[str, Any]], **info: Any
    ) -> dict[int, RecordDict]:
        """Send one ``kind`` message per client of ``jobs`` (values: what to put in it) and
        return the replies' content per client; failed clients are recorded and left out."""
        cids, messages = [], []
        for cid, values in jobs.items():
            node = self.node_of[cid]
            if node in self.dead:
                self._fail(rnd, cid, kind, "its SuperNode failed earlier")
                continue
            record = info_record(self.config_text, cid=cid, round=rnd, **info)
            content = codec.put_all(RecordDict({INFO: record}), values)
            cids.append(cid)
            messages.append(self._message(kind, node, content))
        out: dict[int, RecordDict] = {}
        for i, reply in self._exchange(messages, self.round_timeout).items():
            cid = cids[i]
            if reply is not None and not reply.has_error():
                out[cid] = reply.content
                continue
            self.dead.add(self.node_of[cid])
            reason = (
                f"no reply within {self.round_timeout} s"
                if reply is None
                else f"error {reply.error.code}: {reply.error.reason}"
            )
            self._fail(rnd, cid, kind, reason)
        return out

    def _fail(self, rnd: int, cid: int, kind: str, reason: str) -> None:
        self.failures.append(
            {"client": cid, "node": self.node_of[cid], "step": kind, "reason": reason}
        )
        self.log(f"pflkit: round {rnd}: client {cid} failed ({kind}): {reason}")

    # -- the client side of the round loop -------------------------------------------------------
    def run(self, algo, envs, jobs, meanwhile=None):
        """The jobs as messages to the nodes that host their clients (``algo`` and ``envs``
        are the nodes' own)."""
        if meanwhile is not None:
            meanwhile()
        if not jobs:
            return {}
        if isinstance(jobs[0], TrainJob):
            return self.train(jobs)
        return self.evaluate(jobs)

    def train(self, jobs: list[TrainJob]) -> dict[int, Update]:
        """Each node trains its clients and keeps their new states: per client, its upload
        and metrics (an :class:`~pflkit.algorithms.Update` without state)."""
        if self.secagg is not None:
            return self.secure_train(jobs)
        ctx = jobs[0].ctx  # one phase: the same round and phase for every job
        replies = self._send(
            "train",
            ctx.round,
            {job.cid: {"payload": job.payload, "ctx": context_data(job.ctx)} for job in jobs},
            phase_index=jobs[0].phase_index,
            phase=ctx.phase,
        )
        out = {}
        for cid, content in replies.items():
            upload = codec.get(content, "upload", device=self.device)
            out[cid] = Update(upload, None, codec.get(content, "metrics"))
            self.state_rounds[cid] = codec.get(content, "state_rounds")
        return out

    def secure_train(self, jobs: list[TrainJob]) -> dict[int, Update | None]:
        """One training phase through SecAgg+ (:func:`~pflkit.flower.secagg.secure_phase`):
        each node of the round trains its clients and SecAgg+ sums their weighted means; every
        trained client's upload is the secure mean (None: it diverged). Clients of a node that
        fails or drops out of the protocol fail for the round, and the node is not asked again."""
        ctx = jobs[0].ctx
        rnd = ctx.round
        by_node: dict[int, list[TrainJob]] = {}
        for job in jobs:
            node = self.node_of[job.cid]
            if node in self.dead:
                self._fail(rnd, job.cid, "train", "its SuperNode failed earlier")
                continue
            by_node.setdefault(node, []).append(job)
        if not by_node:
            return {}
        weight = {
            job.cid: 1.0 if self.uniform else float(self.train_sizes[job.cid])
            for js in by_node.values()
            for job in js
        }
        total = sum(weight.values())
        contents = {}
        for node, js in by_node.items():
            record = info_record(
                self.config_text,
                cids=[j.cid for j in js],
                round=rnd,
                phase_index=js[0].phase_index,
                phase=ctx.phase,
                keys=list(self.secure_keys),
                uniform=self.uniform,
                clip=float(self.secagg.clip),
                max_weight=total,
            )
            values = {f"payload.{j.cid}": j.payload for j in js}
            values |= {f"ctx.{j.cid}": context_data(j.ctx) for j in js}
            contents[node] = codec.put_all(RecordDict({INFO: record}), values)
        if len(by_node) < 2:  # earlier failures left one node: its sum would be its upload
            for js in by_node.values():
                for job in js:
                    reason = "secure aggregation needs 2 SuperNodes in a round; the others failed"
                    self._fail(rnd, job.cid, "train", reason)
            return {}
        outcome = secure_phase(
            self._exchange,
            contents,
            weight,
            rnd,
            self.secagg,
            jobs[0].payload,
            self.round_timeout,
            self.device,
        )
        self.dead |= outcome.dead
        for node, reason in outcome.failed.items():
            for job in by_node[node]:
                self._fail(rnd, job.cid, "train", reason)
        self.secagg_facts.append(outcome.facts)
        out: dict[int, Update | None] = {cid: None for cid in outcome.diverged}
        for cid, upload in outcome.uploads.items():
            out[cid] = Update(upload, None, outcome.metrics[cid])
            self.state_rounds[cid] = outcome.state_rounds[cid]
        return out

    def evaluate(self, jobs: list[EvalJob]) -> dict[int, dict[str, float]]:
        """Each node scores its clients itself (a client whose personalized model is the
        global model is scored with the view's global weights); MAP's protocol (jobs with an
        upload) uses the upload each node kept from the round's training. Per client: its
        accuracy per split (``"test"``, and ``"val"`` with a validation split)."""
        mode = "personal" if jobs[0].upload is None else "selected"
        views = {job.cid: {"view": job.view, "ctx": context_data(job.ctx)} for job in jobs}
        replies = self._send("evaluate", jobs[0].ctx.round, views, mode=mode)
        return {cid: codec.get(content, "accuracy") for cid, content in replies.items()}

    def row_extras(self, row: dict[str, Any]) -> dict[str, Any]:
        rnd = row["round"]
        shown = [f"{k} {row[k]:.4f}" for k in ("global_acc", "pers_acc_mean") if k in row]
        sent, received = self.wire
        shown.append(f"(records: {sent} bytes sent, {received} received)")
        self.log(f"pflkit: round {rnd}/{self.rounds} " + " ".join(shown))
        self.wire = [0, 0]
        row = {}
        if self.secagg_facts:  # secure aggregation: the protocol facts of each phase
            row["secagg"], self.secagg_facts = self.secagg_facts, []
        if self.failures:
            row["failures"], self.failures = self.failures, []
        # Flower only: how many rounds each trained client's state on its node has seen
        row["node_state_rounds"] = {str(c): n for c, n in sorted(self.state_rounds.items())}
        self.state_rounds = {}
        return row


def record_bytes(content: RecordDict) -> int:
    """Bytes of a message's records: array data, config values (numbers 8 bytes, strings and
    bytes their length), metric values (8 bytes each); Flower's own framing is not counted."""

    def size(v: Any) -> int:
        if isinstance(v, bytes):
            return len(v)
        if isinstance(v, str):
            return len(v.encode())
        if isinstance(v, list):
            return sum(size(x) for x in v)
        return 8

    n = 0
    for record in content.values():
        if isinstance(record, ArrayRecord):
            n += sum(len(a.data) for a in record.values())
        else:
            n += sum(size(v) + len(k) for k, v in record.items())
    return n


def short(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:8])) + (" ..." if len(ids) > 8 else "")


@RUNNERS.register("flower", "Flower SuperNodes, from Flower's ServerApp (pflkit flower local/run)")
def flower_runner(cfg: Any, grid: Any = None, **options: Any) -> FlowerRunner:
    """``engine.runner: flower``: a :class:`FlowerRunner` on Flower's ``grid`` of SuperNodes,
    with ``options`` (``node_wait``, ``round_timeout``, ``log``, ``secagg``). Only Flower's
    ServerApp (:mod:`pflkit.flower.apps`) has a grid; without one, one sentence."""
    if grid is None:
        raise PflkitError(
            "engine.runner: flower sends the clients' work from Flower's ServerApp, which a "
            "plain run does not start: run the config with `pflkit flower local` or `pflkit "
            "flower run`, or set engine.runner: pool"
        )
    return FlowerRunner(grid, **options)
