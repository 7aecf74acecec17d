"""pflkit's plain data (payloads, uploads, client states) to Flower records and back.

A value is split into a JSON *schema* and a flat dict of NumPy arrays by
:func:`pflkit.plain.flatten` (dtype and shape kept bit for bit). On Flower the arrays travel as an ``ArrayRecord`` and the
schema as one string in a ``ConfigRecord``. Anything else (a module, a function) is refused
with a clear error rather than pickled: records cross the network.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pflkit.plain import flatten, unflatten

SCHEMA = "schema"


def encode(obj: Any) -> tuple[str, dict[str, np.ndarray]]:
    """``obj`` as (JSON schema, arrays) (:func:`pflkit.plain.flatten`, tensors as arrays)."""
    schema, leaves = flatten(obj)
    return schema, {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in leaves.items()}


def decode(schema: str, arrays: dict[str, np.ndarray], device: Any = None) -> Any:
    """The inverse of :func:`encode`, with tensors on ``device`` (default: the CPU)."""
    return unflatten(schema, arrays, device)


def put(records: Any, name: str, obj: Any) -> None:
    """Store ``obj`` in the Flower ``RecordDict`` ``records`` under ``name``."""
    from flwr.app import Array, ArrayRecord, ConfigRecord

    schema, arrays = encode(obj)
    records[f"{name}.arrays"] = ArrayRecord(
        array_dict={k: Array(ndarray=np.ascontiguousarray(a)) for k, a in arrays.items()}
    )
    records[f"{name}.{SCHEMA}"] = ConfigRecord({SCHEMA: schema})


def put_all(records: Any, values: dict[str, Any]) -> Any:
    """:func:`put` each of ``values`` into ``records``; return ``records``."""
    for name, value in values.items():
        put(records, name, value)
    return records


def get(records: Any, name: str, default: Any = None, device: Any = None) -> Any:
    """The value :func:`put` stored under ``name`` (``default`` when there is none), its
    tensors on ``device`` (default: the CPU)."""
    key = f"{name}.{SCHEMA}"
    if key not in records:
        return default
    arrays = {k: a.numpy() for k, a in records[f"{name}.arrays"].items()}
    return decode(str(records[key][SCHEMA]), arrays, device)
