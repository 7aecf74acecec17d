"""Plain data (payloads, uploads, client states) split into a JSON *schema* and a flat dict of
array leaves, and joined back: the one layout that both the Flower codec
(:mod:`pflkit.flower.codec`, over the network) and the client-state store
(:mod:`pflkit.engine.states`, on disk) use.

Tensors, NumPy arrays and NumPy scalars become leaves (dtype, shape and bits kept); the schema
keeps everything else (dicts with ``str`` or ``int`` keys, lists, tuples, numbers, strings,
bools, None) plus a tagged reference to each leaf: ``$t`` a tensor, ``$n`` an array, ``$s`` a
NumPy scalar, ``$d`` a dict, ``$l`` a list, ``$u`` a tuple. Anything else (a module, a
function) is refused with a clear error rather than pickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

Leaf = torch.Tensor | np.ndarray


def flatten(obj: Any) -> tuple[str, dict[str, Leaf]]:
    """``obj`` as (JSON schema, leaves): tensors detached on the CPU, arrays as they are."""
    leaves: dict[str, Leaf] = {}

    def ref(tag: str, leaf: Leaf) -> dict[str, Any]:
        key = str(len(leaves))
        leaves[key] = leaf
        return {tag: [key, list(leaf.shape)]}  # the shape too: records turn 0-d into 1-d

    def enc(o: Any, where: str) -> Any:
        if isinstance(o, torch.Tensor):
            return ref("$t", o.detach().cpu())
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
            "and dicts can be sent between clients and server or stored"
        )

    return json.dumps(enc(obj, "value")), leaves


def unflatten(schema: str, leaves: Mapping[str, Leaf], device: Any = None) -> Any:
    """The inverse of :func:`flatten`, with tensors on ``device`` (default: the CPU). A leaf
    may come back as an array or a tensor, whatever its tag: each is converted (copied) to the
    type its tag names."""

    def array(leaf: Leaf) -> np.ndarray:
        return leaf.numpy() if isinstance(leaf, torch.Tensor) else np.array(leaf, copy=True)

    def dec(o: Any) -> Any:
        if not isinstance(o, dict):
            return o
        (tag, v), *_ = o.items()
        if tag in ("$t", "$n", "$s"):
            key, shape = v
            leaf = leaves[key]
            if tag == "$t":
                t = leaf if isinstance(leaf, torch.Tensor) else torch.from_numpy(array(leaf))
                return t.reshape(shape).to(device)
            a = array(leaf).reshape(shape)
            return a if tag == "$n" else a[()]
        if tag == "$d":
            return {k: dec(x) for k, x in v}
        if tag == "$l":
            return [dec(x) for x in v]
        return tuple(dec(x) for x in v)

    return dec(json.loads(schema))
