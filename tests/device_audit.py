"""A stand-in for a second device on CPU-only machines.

On a GPU, a tensor that pflkit creates without naming its device lands on the CPU while the
run's data and models sit on the GPU, and the first operation mixing the two fails. CPU-only
CI cannot see that bug, because there the run's device *is* the default device.
:class:`DefaultDeviceElsewhere` makes the two differ: every tensor that pflkit's own code
creates without a ``device=`` argument (factory functions, ``torch.from_numpy``) lands on the
``meta`` device instead, so mixing it with the run's CPU tensors, or reading a value from it,
fails at once. Code that names its device (``device=x.device``, ``torch.zeros_like(x)``, ``.to``)
is unaffected. Data loading (``pflkit.data``) is exempt: it builds CPU tensors by design, which
the engine then moves to the run's device once.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_leaves

FACTORIES = _device_constructors()


def _from_pflkit_code() -> bool:
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name.startswith("pflkit.") and not name.startswith("pflkit.data")


class DefaultDeviceElsewhere(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.is_meta for t in tensors) and any(not t.is_meta and t.dim() for t in tensors):
            # indexing a CPU tensor with a meta index does not fail by itself: make every mix fail
            raise RuntimeError(
                f"{func.__name__}: a tensor created without a device meets the run's"
            )
        if func in FACTORIES and kwargs.get("device") is None and _from_pflkit_code():
            kwargs["device"] = "meta"
        out = func(*args, **kwargs)
        if func is torch.from_numpy and _from_pflkit_code():
            out = out.to("meta")
        return out
