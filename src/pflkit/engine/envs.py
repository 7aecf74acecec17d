"""Building a run's environments: the :class:`~pflkit.algorithms.env.ServerEnv` and every
client's :class:`~pflkit.algorithms.env.ClientEnv` (what an algorithm may see; the contract is
:mod:`pflkit.algorithms.env`) from the config and the federated data set."""

from __future__ import annotations

import json
from typing import Any

import torch

from pflkit.algorithms.env import ClientEnv, ModelPool, RunFacts, ServerEnv
from pflkit.config import ExperimentConfig, ModelConfig
from pflkit.data.federated import FederatedDataset
from pflkit.devices import resolve_device
from pflkit.errors import PflkitError
from pflkit.experiment import algorithm_of
from pflkit.privacy import dpsgd


def arch_specs(m: ModelConfig) -> tuple[dict[str, tuple[str, dict[str, Any]]], str, list[str]]:
    """Architecture keys of a model config: (specs by key, global key, per-client order)."""
    specs: dict[str, tuple[str, dict[str, Any]]] = {}

    def register(name: str, options: dict[str, Any]) -> str:
        key = name if not options else f"{name}{json.dumps(options, sort_keys=True)}"
        specs[key] = (name, options)
        return key

    global_arch = register(m.name, m.options)
    order: list[str] = []
    for spec in m.per_client or []:
        if isinstance(spec, str):
            order.append(register(spec, {}))
        else:
            order += [register(spec.name, spec.options)] * spec.count
    return specs, global_arch, order


def make_envs(cfg: ExperimentConfig, data: FederatedDataset) -> tuple[ServerEnv, list[ClientEnv]]:
    """The server environment and every client's environment of a run, with the data on the
    run's device. Every architecture is built once here, so a bad model name or option fails
    before anything runs."""
    specs, global_arch, order = arch_specs(cfg.model)
    device = torch.device(resolve_device(cfg.device))
    data = data.to(device)
    pool = ModelPool(specs, data.input_shape, data.num_classes, device)
    for arch in specs:
        pool.model(arch)
    if cfg.train.augment != "none" and len(data.input_shape) != 3:
        raise PflkitError(
            f"train.augment {cfg.train.augment!r} needs images [C, H, W], but "
            f"{cfg.data.dataset} has inputs of shape {list(data.input_shape)}: set train.augment: none"
        )
    n = data.num_clients
    archs = [order[c % len(order)] if order else global_arch for c in range(n)]
    facts = RunFacts(
        cfg.train, cfg.seed, cfg.eval.selected_clients, cfg.system, cfg.privacy.sample_dp
    )
    server = ServerEnv(
        num_clients=n,
        archs=archs,
        global_arch=global_arch,
        num_samples=[c.size("train") for c in data.clients],
        num_classes=data.num_classes,
        models=pool,
        run=facts,
        public_x=data.public_x,
    )
    clients = [
        ClientEnv(c, data.clients[c], data.num_classes, archs[c], pool, facts, data.public_x)
        for c in range(n)
    ]
    if cfg.privacy.sample_dp is not None:  # DP-SGD refuses what it cannot cover, up front
        dpsgd.check_sample_dp(cfg, algorithm_of(cfg).build(), server)
    return server, clients
