"""pflkit's plain data (payloads, uploads, client states) to Flower records and back.

A value is split into a JSON *schema* and a flat dict of NumPy arrays: tensors, NumPy arrays
and NumPy scalars go to the arrays (dtype and shape kept bit for bit), and the schema keeps
everything else (dicts with ``str`` or ``int`` keys, lists, tuples, numbers, strings, bools,
None) plus references to the arrays. On Flower the arrays travel as an ``ArrayRecord`` and the
schema as one string in a ``ConfigRecord``. Anything else (a module, a function) is refused
with a clear error rather than pickled: records cross the network.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

SCHEMA = "schema"


def encode(obj: Any) -> tuple[str, dict[str, np.ndarray]]:
    """``obj`` as (JSON schema, arrays)."""
    arrays: dict[str, np.ndarray] = {}

    def ref(tag: str, array: np.ndarray) -> dict[str, Any]:
        key = str(len(arrays))
        arrays[key] = array
        return {tag: [key, list(array.shape)]}  # the shape too: records turn 0-d into 1-d

    def enc(o: Any, where: str) -> Any:
        if isinstance(o, torch.Tensor):
            return ref("$t", o.detach().cpu().numpy())
        if isinstance(o, np.ndarray):
            return ref("$n", o)
        if isinstance(o, np.generic):
            return ref("$s", np.asarray(o))
        if isinstance(o, dict):
            for k in o:
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise TypeError(f"{where}: dict key {k!r} is not a str or int")
            return {"$d": [[k, enc(v, f"{where}[{k!r}]")] for k, v in o.items()]}
        if isinstance(o, list | tuple):
            items = [enc(v, f"{where}[{i}]") for i, v in enumerate(o)]
            return {"$l" if isinstance(o, list) else "$u": items}
        if o is None or isinstance(o, bool | int | float | str):
            return o
        raise TypeError(
            f"{where} is a {type(o).__name__}: only tensors, arrays, numbers, strings, lists "
            "and dicts can be sent between clients and server"
        )

    return json.dumps(enc(obj, "value")), arrays


def decode(schema: str, arrays: dict[str, np.ndarray], device: Any = None) -> Any:
    """The inverse of :func:`encode`, with tensors on ``device`` (default: the CPU)."""

    def dec(o: Any) -> Any:
        if not isinstance(o, dict):
            return o
        (tag, v), *_ = o.items()
        if tag in ("$t", "$n", "$s"):
            key, shape = v
            array = np.array(arrays[key], copy=True).reshape(shape)
            if tag == "$t":
                return torch.from_numpy(array).to(device)
            return array if tag == "$n" else array[()]
        if tag == "$d":
            return {k: dec(x) for k, x in v}
        if tag == "$l":
            return [dec(x) for x in v]
        return tuple(dec(x) for x in v)

    return dec(json.loads(schema))


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
