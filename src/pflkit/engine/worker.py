"""The one start-up of whatever runs client work: the simulation in this process, a pool's
worker process, a Ray actor and a Flower SuperNode all build their algorithm and client
environments with :func:`start_worker`, from a :class:`WorkerSpec` of the run's validated
config.

The spec carries the typed config with its algorithm section already parsed
(:func:`pflkit.experiment.algorithm_of`): a worker neither validates the config again nor
parses the algorithm's parameters. Pickled (a process pool started from a fork server, Ray),
it imports the config's plugins before it unpickles the config, whose parameters may be
typed by a plug-in's class.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from pflkit.algorithms import Algorithm
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.config import ExperimentConfig
from pflkit.data.federated import FederatedDataset
from pflkit.engine.envs import make_envs
from pflkit.experiment import algorithm_of
from pflkit.plugins import load_plugins


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker starts from: the run's validated ``cfg``, the torch ``threads`` to run
    with (None: leave torch's setting alone) and the ``device`` to build on in place of
    ``cfg.device`` (None: ``cfg.device``; a Ray actor: the GPU or CPU Ray gave it)."""

    cfg: ExperimentConfig
    threads: int | None = None
    device: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        # the config as bytes, opened after its plugins are imported (__setstate__)
        cfg = pickle.dumps(self.cfg, pickle.HIGHEST_PROTOCOL)
        return {"plugins": list(self.cfg.plugins), "cfg": cfg, "rest": (self.threads, self.device)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        load_plugins(state["plugins"])
        object.__setattr__(self, "cfg", pickle.loads(state["cfg"]))
        object.__setattr__(self, "threads", state["rest"][0])
        object.__setattr__(self, "device", state["rest"][1])


class Built(NamedTuple):
    """What :func:`start_worker` builds: the algorithm, the server's environment and every
    client's environment."""

    algo: Algorithm
    server: ServerEnv
    envs: list[ClientEnv]


def start_worker(spec: WorkerSpec, data: FederatedDataset) -> Built:
    """The algorithm (from the config's parsed section) and the environments of the run
    ``spec`` describes, on ``data`` (moved to the run's device), with ``spec.threads`` torch
    threads."""
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    cfg = spec.cfg
    if spec.device is not None:
        cfg = cfg.model_copy(update={"device": spec.device})
    server, envs = make_envs(cfg, data)
    return Built(algorithm_of(cfg).build(), server, envs)
