"""The records algorithms exchange, as :class:`typing.TypedDict` s.

A record declares the keys of a plain dict and the type of each value; the values stay plain
dicts (the engine counts communication from them, checkpoints ``torch.save`` them, Flower ships
them). Each algorithm names its records in four class attributes of
:class:`~pflkit.algorithms.Algorithm`: ``payload`` (what
:meth:`~pflkit.algorithms.Algorithm.configure` sends a client), ``upload`` (what
:meth:`~pflkit.algorithms.Algorithm.client_update` sends back), ``state`` (the client's private
state, from ``client_init`` and ``client_update``) and ``server`` (the server state, from
``server_init`` and ``aggregate``). A multi-phase algorithm whose records differ by phase
declares a union of one record per phase (``SharePayload | DistillPayload``).
``tests/test_conformance.py`` checks every value a run produces against its declaration
(:func:`pflkit.testing.check_record`).

The records here are the ones the contract's helpers rely on, for algorithms to extend.
"""

from __future__ import annotations

from typing import TypedDict

from pflkit.primitives.training import Weights


class Empty(TypedDict):
    """No keys: an empty payload, upload or state (a client that keeps nothing)."""


class Upload(TypedDict):
    """The base upload: the client's number of training samples, what
    :func:`~pflkit.algorithms.base.weighted_average` weighs by (``n_k``)."""

    num_samples: int


class WeightsUpload(Upload):
    """A trained model and its sample count (FedAvg and most of its descendants)."""

    weights: Weights


class WeightsPayload(TypedDict):
    """The global model, as the default :meth:`~pflkit.algorithms.Algorithm.configure` and
    :meth:`~pflkit.algorithms.Algorithm.eval_view` send it."""

    weights: Weights


class WeightsServer(TypedDict):
    """The default server state: the global model
    (:meth:`~pflkit.algorithms.Algorithm.server_init`)."""

    weights: Weights
