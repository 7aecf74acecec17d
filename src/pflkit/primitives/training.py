"""Shared training helpers: the one local-SGD loop, evaluation, weights as plain dicts.

Algorithms never write their own batch loop: they call :func:`local_sgd` with a pluggable
loss. Data are preloaded tensors and batches are drawn by index permutation (no DataLoader),
so the loop costs what a hand-written PyTorch loop costs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Weights = dict[str, Tensor]
LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]
GradHook = Callable[[list[Tensor]], None]  # edits the optimised tensors' .grad in place


def get_weights(model: nn.Module) -> Weights:
    """A detached copy of the model's state (parameters and buffers)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def set_weights(model: nn.Module, weights: Mapping[str, Tensor], strict: bool = True) -> None:
    """Load ``weights`` into ``model`` in place (no new module, no re-allocation)."""
    state = model.state_dict()
    if strict and state.keys() != weights.keys():
        missing = sorted(set(state) - set(weights))[:3]
        extra = sorted(set(weights) - set(state))[:3]
        raise KeyError(f"weights do not match the model: missing {missing}, unexpected {extra}")
    for k, v in weights.items():
        state[k].copy_(v)


def group(model: nn.Module, weights: Mapping[str, Tensor], name: str) -> Weights:
    """The entries of ``weights`` in the model's parameter group ``name`` (``"body"`` or
    ``"head"``), as the model names them (:meth:`~pflkit.models.PFLModel.group_keys`)."""
    keys = model.group_keys(name)
    return {k: weights[k] for k in keys}


def prefixed(weights: Mapping[str, Tensor], prefix: str) -> Weights:
    """``weights`` with ``prefix`` before every key: several state dicts in one plain dict
    (a personalized model made of parts, for :meth:`Algorithm.personal_model`)."""
    return {prefix + k: v for k, v in weights.items()}


def unprefixed(weights: Mapping[str, Tensor], prefix: str) -> Weights:
    """The entries of ``weights`` whose key starts with ``prefix``, without it."""
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


@dataclass(frozen=True)
class LocalOptim:
    """The optimiser :func:`local_sgd` builds, the factor on its learning rate and its batching:
    a round's ``train.optimizer``, ``train.lr_schedule`` factor and ``train.drop_last``, as the
    round context gives them (:attr:`~pflkit.algorithms.RoundContext.optim`). The default,
    :data:`PLAIN_SGD`, is SGD at the lr given, every batch (server-side training)."""

    optimizer: str = "sgd"  # sgd | adam | adamw (train.optimizer)
    lr_factor: float = 1.0  # the round's learning-rate schedule factor (engine.schedule)
    drop_last: bool = False  # epochs skip their last, incomplete batch (train.drop_last)


PLAIN_SGD = LocalOptim()


def make_optimizer(
    params: list[Tensor],
    lr: float,
    momentum: float,
    weight_decay: float,
    optim: LocalOptim = PLAIN_SGD,
) -> torch.optim.Optimizer:
    """The optimiser ``optim`` names (default: SGD), at ``lr`` times its lr factor."""
    lr = lr * optim.lr_factor
    if optim.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if optim.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


def crop_flip(padding: int) -> Callable[[Tensor], Tensor]:
    """Random crop of each image ``[C, H, W]`` after zero-padding every side by ``padding``,
    then a horizontal flip with probability 1/2. Offsets and flips are drawn on the CPU from
    torch's global RNG (seeded per client and round by the engine), the same on every device."""

    def transform(x: Tensor) -> Tensor:
        n, _, h, w = x.shape
        dy, dx = torch.randint(0, 2 * padding + 1, (2, n), device="cpu").to(x.device)
        flip = (torch.rand(n, device="cpu") < 0.5).to(x.device)
        padded = F.pad(x, (padding,) * 4)
        rows = (dy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, None, :]
        sample = torch.arange(n, device=x.device)[:, None, None, None]
        channel = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
        out = padded[sample, channel, rows, cols]
        return torch.where(flip[:, None, None, None], out.flip(3), out)

    return transform


@contextmanager
def frozen_except(model: nn.Module, params: Iterable[Tensor]) -> Iterator[None]:
    """Within the block, the parameters of ``model`` that are not in ``params`` and require a
    gradient do not (restored on exit, also after an error): they are not optimised, so
    autograd need not compute their gradients. Gradients of ``params`` are unchanged."""
    keep = {id(t) for t in params}
    off = [t for t in model.parameters() if t.requires_grad and id(t) not in keep]
    for t in off:
        t.requires_grad_(False)
    try:
        yield
    finally:
        for t in off:
            t.requires_grad_(True)


def cross_entropy(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(model(x), y)


@dataclass(frozen=True)
class StackableLoss:
    """A local objective as one function of the model, the batch and the client's own tensors:
    ``fn(model, x, y, tensors, *static)``. Called like any :data:`LossFn`; the vectorised
    engine (:mod:`pflkit.engine.vectorized`) runs one ``fn`` for a whole cohort, stacking the
    clients' ``tensors`` (dicts of tensors) and sharing ``static`` (numbers, the same for
    every client of a round)."""

    fn: Callable[..., Tensor]
    tensors: Mapping[str, Tensor | Mapping[str, Tensor]]
    static: tuple = ()

    def __call__(self, model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        return self.fn(model, x, y, self.tensors, *self.static)


def _proximal(model: nn.Module, x: Tensor, y: Tensor, t: Mapping, mu: float) -> Tensor:
    anchor = t["anchor"]
    prox = sum((p - anchor[name]).pow(2).sum() for name, p in model.named_parameters())
    return cross_entropy(model, x, y) + 0.5 * mu * prox


def proximal_loss(global_weights: Mapping[str, Tensor], mu: float) -> StackableLoss:
    """Cross-entropy plus (mu / 2) * ||w - w_global||^2 over the model's parameters (FedProx's
    local objective, Ditto's personal one); :func:`proximal_pull` adds only the gradient."""
    return StackableLoss(_proximal, {"anchor": global_weights}, (mu,))


def local_sgd(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    loss_fn: LossFn = cross_entropy,
    params: Iterable[Tensor] | None = None,
    steps: int | None = None,
    grad_hooks: Sequence[GradHook] = (),
    transform: Callable[[Tensor], Tensor] | None = None,
    optim: LocalOptim = PLAIN_SGD,
) -> float:
    """Train ``model`` in place with mini-batch steps of the optimiser ``optim`` names
    (default: SGD); return the mean training loss.

    The local objective is ``loss_fn(model, x_batch, y_batch)``. Each epoch visits every
    sample once in a fresh random order drawn from torch's global RNG (the engine seeds it per
    client and round, which makes runs reproducible and resumable). ``steps``, when given,
    replaces ``epochs``: exactly that many mini-batch steps, cycling through fresh permutations
    (MAP's stage lengths are counted in steps). ``params`` restricts which tensors are
    optimised (default: all parameters; :meth:`PFLModel.group_params` names the body and head);
    the model's other parameters are frozen while the loop runs (:func:`frozen_except`), so
    backward computes no gradient for them (FedRep's head epochs skip the body's backward).
    ``grad_hooks`` run in order after each backward pass and before the optimiser step, each
    editing the gradients of ``params`` in place: :func:`clip_grad`, :func:`shift_grad`,
    :func:`proximal_pull`. ``transform`` (e.g. :func:`crop_flip`) augments each input batch.
    ``optim`` also scales ``lr`` and, with ``drop_last``, skips each epoch's incomplete last
    batch (:func:`steps_per_epoch` counts accordingly): a client passes its round's
    (``RoundContext.optim``: ``train.optimizer``, ``train.lr_schedule``, ``train.drop_last``).
    """
    model.train()
    params = list(model.parameters() if params is None else params)
    opt = make_optimizer(params, lr, momentum, weight_decay, optim)
    n = len(y)
    if steps is None:
        steps = epochs * steps_per_epoch(n, batch_size, optim.drop_last)
    total = torch.zeros((), device=x.device)
    done = 0
    with frozen_except(model, params):
        for idx in batch_indices(n, batch_size, steps, optim.drop_last, x.device):
            opt.zero_grad(set_to_none=True)
            xb = x[idx] if transform is None else transform(x[idx])
            loss = loss_fn(model, xb, y[idx])
            loss.backward()
            for hook in grad_hooks:
                hook(params)
            opt.step()
            total += loss.detach()
            done += 1
    return float(total) / max(done, 1)


def batch_indices(
    n: int, batch_size: int, steps: int, drop_last: bool, device: torch.device | str = "cpu"
) -> Iterator[Tensor]:
    """The sample indices of each of ``steps`` mini-batches of :func:`local_sgd`: epoch after
    epoch, a fresh permutation of the ``n`` samples from torch's global RNG (drawn on the CPU
    whatever the device, so a seed gives the same batches everywhere) cut into batches of
    ``batch_size``, with ``drop_last`` without the epoch's incomplete last one (one short batch
    when ``n < batch_size``). Lazy: a permutation is drawn when its epoch starts, so draws the
    caller makes between batches (augmentation) come in the same order as in the loop."""
    done = 0
    # the last batch's start: with drop_last only full batches (one short one when n < batch)
    end = n - batch_size + 1 if drop_last and n >= batch_size else n
    while done < steps:
        perm = torch.randperm(n, device="cpu").to(device)
        for i in range(0, end, batch_size):
            if done == steps:
                return
            yield perm[i : i + batch_size]
            done += 1


# -- gradient hooks (composable: local_sgd applies them in the order given) ----------------------


@dataclass(frozen=True)
class clip_grad:  # noqa: N801 (a hook factory, called like the other hooks' functions)
    """Clip the gradient of all optimised tensors to global L2 norm ``max_norm``
    (``train.grad_clip``). A class, so that the vectorised engine can read ``max_norm``."""

    max_norm: float

    def __call__(self, params: list[Tensor]) -> None:
        torch.nn.utils.clip_grad_norm_(params, self.max_norm)


def shift_grad(shifts: Sequence[tuple[Tensor, Tensor]]) -> GradHook:
    """Add a constant ``d`` to the gradient of each ``(parameter, d)`` pair (SCAFFOLD's drift
    correction c - c_i)."""
    shifts = list(shifts)

    def hook(params: list[Tensor]) -> None:
        for p, d in shifts:
            p.grad.add_(d)

    return hook


def proximal_pull(anchors: Sequence[tuple[Tensor, Tensor]], mu: float) -> GradHook:
    """Add ``mu * (p - anchor)`` to each ``(parameter, anchor)`` pair's gradient: the gradient
    of ``(mu / 2) ||p - anchor||^2`` without adding the term to the reported loss."""
    anchors = list(anchors)

    def hook(params: list[Tensor]) -> None:
        for p, a in anchors:
            p.grad.add_(p.detach() - a, alpha=mu)

    return hook


def steps_per_epoch(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Mini-batches in one epoch of ``n`` samples: ceil(n / batch_size), or, with
    ``drop_last`` (``train.drop_last``), the full batches only (at least one)."""
    if drop_last:
        return max(n // batch_size, 1)
    return -(-n // batch_size)


@torch.inference_mode()
def predict(
    model: nn.Module,
    x: Tensor,
    batch_size: int = 250,
    forward: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Logits of ``model`` (or what ``forward`` computes with it, e.g. its features) on ``x``
    in eval mode, in batches of exactly ``min(len(x),
    batch_size)`` samples: the last batch is the last ``batch_size`` samples (overlapping the
    one before), of which it keeps the new rows. No sample is computed in a small remainder
    batch, whose kernels can round differently; with one torch thread every model in the zoo
    then gives the same logits bit for bit at batch sizes 64, 100 and a whole split of 130
    (tests/test_models.py), and the demo's runs the same metrics at 250 and 1,000, so
    ``eval.batch_size`` is a speed setting."""
    model.eval()
    fn = model if forward is None else forward
    n = len(x)
    if n <= batch_size:
        return fn(x)
    starts = [*range(0, n - batch_size, batch_size), n - batch_size]
    out = [fn(x[i : i + batch_size]) for i in starts]
    covered = (len(starts) - 1) * batch_size  # rows before the last window's new ones
    out[-1] = out[-1][covered - starts[-1] :]
    return torch.cat(out)


def accuracy_and_loss(logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample correctness (bool) and cross-entropy loss."""
    return logits.argmax(1) == y, F.cross_entropy(logits, y, reduction="none")
