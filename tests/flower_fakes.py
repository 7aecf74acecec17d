"""In-process Flower fakes shared by test_flower.py and test_conformance.py: a Grid that
delivers each message to its node's ClientApp handler at once, and row comparison helpers."""

from __future__ import annotations

import math

import pytest
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from pflkit.engine.runner import run_experiment
from pflkit.flower import client as client_app
from pflkit.flower.server import FlowerRunner


def task_identity():
    """Flower's message constructor needs a task identity outside a real SuperLink."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = None


HANDLERS = {"query": client_app.query, "train": client_app.train, "evaluate": client_app.evaluate}


class FakeGrid:
    """Delivers each pushed message to its node's ClientApp handler; a node in ``dead`` (or
    killed by ``kill_at``) answers nothing, as a killed SuperNode does."""

    def __init__(self, node_configs: dict[int, dict], kill_at=None):
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config=nc, state=RecordDict(), run_config={})
            for nid, nc in node_configs.items()
        }
        self.dead: set[int] = set()
        self.kill_at = kill_at  # (node, message type, round): the node dies on that message
        self.replies: dict[str, Message] = {}

    def get_node_ids(self):
        return [n for n in self.contexts if n not in self.dead]

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            ids.append(msg.metadata.message_id)
            node = msg.metadata.dst_node_id
            if self.kill_at and msg.metadata.message_type != "query":
                n, kind, rnd = self.kill_at
                if (
                    node == n
                    and msg.metadata.message_type == kind
                    and msg.content["pflkit"]["round"] == rnd
                ):
                    self.dead.add(node)
            if node not in self.dead:
                reply = HANDLERS[msg.metadata.message_type](msg, self.contexts[node])
                self.replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def flower_run(cfg, tmp_path, nodes, name="flower", **kw):
    grid = kw.pop("grid", None) or FakeGrid(nodes)
    runner = FlowerRunner(grid, node_wait=0, round_timeout=1.0, log=lambda s: None)
    return run_experiment(cfg, out=tmp_path / name, runner=runner), grid


def comparable(row: dict) -> dict:
    flower_only = ("failures", "node_state_rounds")
    return {k: v for k, v in row.items() if not k.startswith("seconds_") and k not in flower_only}


def assert_rows_close(a: dict, b: dict) -> None:
    a, b = comparable(a), comparable(b)
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], float):
            assert math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-9), k
        elif k == "pers_acc_clients":
            assert a[k] == pytest.approx(b[k], rel=1e-6), k
        else:
            assert a[k] == b[k], k
