"""The vectorised engine (``engine.vectorize``): a worker trains its share of the cohort as one
batched computation (``torch.func``: ``functional_call``, ``grad``, ``vmap`` over stacked
client parameters) and scores the clients' personalized models the same way.

Training (:func:`train_cohort`). Every client's own ``client_update`` runs as in the per-client
path, but the steps of its :meth:`~pflkit.algorithms.ClientEnv.train` calls go to a recorder,
:class:`Tape`, instead of :func:`~pflkit.primitives.training.local_sgd`: the first call
not answered yet records a :class:`Request` (the model's state, the optimised parameters, the
optimiser settings, the loss, and the batches, drawn from the client's own torch stream exactly
as ``local_sgd`` draws them) and stops the update (:class:`Pending`). When every client has
stopped or finished, the requests are trained together (:func:`train_requests`), and each
stopped update runs again from its start (torch re-seeded as before), its recorded calls now
answered from the tape: the trained state loaded into the model, the mean loss returned and
torch's RNG left where the loop left it. An update with k training calls (Ditto, FedRep: 2)
runs k + 1 times; the Python around the steps is cheap, the steps are the work. No algorithm is
written twice: an algorithm declares ``vectorize = True`` (:func:`~pflkit.algorithms.base.
vectorizable`) when its local work is such steps with ``cross_entropy`` or a
:class:`~pflkit.primitives.training.StackableLoss`.

The requests of one computation share the architecture, the loss function and its static
arguments, the optimised parameters and the optimiser settings; the clients' states are stacked
along a new first dimension, in order of their number of steps (most first) and, among equal
numbers, of their last batch's size (largest first). The clients with a step ``s`` are then the
stack's first rows (the step mask: a client with fewer batches stops updating; the stack
shrinks past it, its trained rows kept), and their batch sizes runs of neighbouring rows (an
epoch's short last batch). Each run takes one ``vmap(grad(loss))`` call and one functional
optimiser step (SGD with momentum and weight decay, Adam, AdamW: torch's update rules,
per-client moments), with ``train.grad_clip``'s per-client clipping in between, on slices of
the stacked tensors: no gather or scatter per step (on a GPU, a kernel per tensor each).
BatchNorm running statistics are buffers of each client's own slice.
Numbers equal the per-client path's within float tolerance, not bit for bit: the batched
kernels sum in another order. With ``engine.cuda_graphs`` (:func:`train_graphed`) the stack
never shrinks, and a step at which every client still training has a full batch steps a
power of two of the first rows under a mask, captured on CUDA as a CUDA graph and replayed.

Evaluation (:func:`evaluate_cohort`): the clients whose ``personal_model`` is a plain client
model (no scoring wrapper, no ``eval.finetune_epochs``, not held out) are scored by one ``vmap`` of the model's forward over
their stacked weights, chunk by chunk of ``eval.batch_size`` samples (a client with fewer samples
is padded, the padding not counted); the others as in the per-client path.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from pflkit.algorithms import ALGORITHMS, Algorithm
from pflkit.algorithms.base import Update, vectorizable
from pflkit.algorithms.env import ClientEnv, ServerEnv
from pflkit.config import ExperimentConfig
from pflkit.devices import resolve_device
from pflkit.errors import PflkitError
from pflkit.primitives.training import (
    PLAIN_SGD,
    GradHook,
    LocalOptim,
    LossFn,
    StackableLoss,
    Weights,
    batch_indices,
    clip_grad,
    cross_entropy,
    set_weights,
    steps_per_epoch,
)

# engine.vectorize: auto picks the vectorised path only on CUDA and only once
# benchmarks/gpu_vectorize.sh has measured it faster there than per-client workers; not
# measured yet, so auto is the per-client path everywhere (on CPU it measured slower:
# docs/benchmarks.md)
AUTO_ON_CUDA = False
MAX_STACK = 256  # clients stacked in one computation, at most (memory: states and activations)
GRAPH_WARMUP = 3  # eager steps before a CUDA graph's capture (cuBLAS, cuDNN, autograd set up)
Tensors = tuple[Tensor, ...] | list[Tensor]  # what torch._foreach_* take and give
Bias = tuple[float, float] | tuple[Tensor, Tensor]  # FunctionalOptimizer.bias: numbers or tensors


def covered() -> list[str]:
    """The registered algorithms that ``engine.vectorize: true`` covers."""
    return sorted(name for name, cls in ALGORITHMS.items() if vectorizable(cls))


def enabled(cfg: ExperimentConfig) -> bool:
    """Whether ``cfg`` runs the vectorised path: ``engine.vectorize`` true, or ``auto`` on CUDA
    where it was measured faster (:data:`AUTO_ON_CUDA`). ``true`` for a run it cannot do is one
    sentence (:class:`PflkitError`); ``auto`` then quietly runs per client."""
    v = cfg.engine.vectorize
    cls = ALGORITHMS.lookup(cfg.algorithm["name"])
    if v == "auto":
        on_cuda = resolve_device(cfg.device) != "cpu"
        return AUTO_ON_CUDA and on_cuda and vectorizable(cls) and why_not(cfg) is None
    if not v:
        return False
    if not vectorizable(cls):
        raise PflkitError(
            f"algorithm '{cls.name}' does not support engine.vectorize: true (its local work is "
            f"not plain optimizer steps the engine can batch; covered: {', '.join(covered())}): "
            "set engine.vectorize: false"
        )
    reason = why_not(cfg)
    if reason is not None:
        raise PflkitError(f"engine.vectorize: true {reason}: set engine.vectorize: false")
    return True


def graphs(cfg: ExperimentConfig) -> bool:
    """Whether ``cfg`` replays the vectorised engine's steps as CUDA graphs
    (``engine.cuda_graphs``); one sentence (:class:`PflkitError`) where it cannot."""
    if not cfg.engine.cuda_graphs:
        return False
    if not enabled(cfg):
        raise PflkitError(
            "engine.cuda_graphs: true replays the vectorised engine's steps, which this run "
            f"does not use (engine.vectorize: {cfg.engine.vectorize}): set engine.vectorize: "
            "true, or engine.cuda_graphs: false"
        )
    device = resolve_device(cfg.device)
    if not device.startswith("cuda"):
        raise PflkitError(
            f"engine.cuda_graphs: true needs a CUDA device, and this run's device is '{device}': "
            "set device: cuda, or engine.cuda_graphs: false"
        )
    return True


def why_not(cfg: ExperimentConfig) -> str | None:
    """Why the vectorised path cannot run ``cfg`` whatever its algorithm (None: it can)."""
    if cfg.privacy.sample_dp is not None:
        return "cannot run privacy.sample_dp's per-sample clipping (DP-SGD runs per client)"
    if cfg.engine.runner not in ("pool", "in-process"):
        return (
            f"runs in this process or the process pool, not on engine.runner: {cfg.engine.runner}"
        )
    return None


def check(cfg: ExperimentConfig) -> None:
    """Refuse, in one sentence (:class:`PflkitError`), ``engine.vectorize: true`` or
    ``engine.cuda_graphs: true`` where they cannot run, whatever the runner."""
    enabled(cfg)
    graphs(cfg)


def check_models(env: ServerEnv) -> None:
    """Refuse a model with active dropout: its masks would be drawn from one stream for the
    whole cohort, not from each client's own."""
    for arch in sorted(set(env.archs)):
        model = env.model(arch)
        if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
            raise PflkitError(
                f"model '{model.name}' has dropout layers, whose random masks the vectorised "
                "engine cannot draw from each client's own stream: set engine.vectorize: false "
                "or pick a model without dropout"
            )


# -- recording the training calls ------------------------------------------------------------------


class Pending(BaseException):  # noqa: N818 (not an error: a client waiting for its steps)
    """Stops a client's update at a training call whose steps are not done yet (a
    BaseException, so that no ``except Exception`` in an algorithm swallows it)."""


def _cross_entropy(model: nn.Module, x: Tensor, y: Tensor, tensors: Mapping[str, Any]) -> Tensor:
    """``cross_entropy``'s mean negative log-likelihood, written as log-softmax and a gather,
    whose ``vmap`` rules dispatch fewer operations than nll_loss's (which also handles
    ignore_index and class weights). The same number within float tolerance."""
    logits: Tensor = model(x)
    return -logits.log_softmax(-1).gather(-1, y.unsqueeze(-1)).mean()


@dataclass
class Request:
    """One client's training call, as :class:`Tape` recorded it."""

    model: nn.Module  # the module trained (its architecture; its values are in ``start``)
    start: Weights  # its state when the call came
    trainable: tuple[str, ...]  # the optimised parameters' names
    loss: StackableLoss
    x: Tensor  # the client's training inputs and labels
    y: Tensor
    batches: list[Tensor]  # each step's sample indices
    inputs: list[Tensor] | None  # each step's augmented inputs (``transform``), else None
    optimizer: str
    lr: float  # times the round's lr factor
    momentum: float
    weight_decay: float
    max_norm: float | None  # train.grad_clip
    rng: Tensor  # torch's CPU RNG state after the batches were drawn

    def key(self) -> tuple[Any, ...]:
        """What requests trained together share."""
        shapes = tuple((k, tuple(v.shape), v.dtype) for k, v in self.start.items())
        hyper = (self.optimizer, self.lr, self.momentum, self.weight_decay, self.max_norm)
        return (type(self.model), shapes, self.trainable, self.loss.fn, self.loss.static, hyper)


@dataclass(frozen=True)
class Done:
    """A training call's outcome: the module's state after the steps, the mean loss, and
    torch's RNG state after the batches were drawn."""

    weights: Weights
    loss: float
    rng: Tensor


class Tape:
    """:func:`~pflkit.primitives.training.local_sgd`'s stand-in for one client: calls
    already done are answered from ``done``, the next one is recorded (``request``) and stops
    the update (:class:`Pending`)."""

    def __init__(self, done: list[Done]):
        self.done = done
        self.calls = 0
        self.request: Request | None = None

    def __call__(
        self,
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
        params: Sequence[Tensor] | None = None,
        steps: int | None = None,
        grad_hooks: Sequence[GradHook] = (),
        transform: Callable[[Tensor], Tensor] | None = None,
        optim: LocalOptim = PLAIN_SGD,
    ) -> float:
        model.train()
        i, self.calls = self.calls, self.calls + 1
        if i < len(self.done):
            d = self.done[i]
            set_weights(model, d.weights)
            torch.set_rng_state(d.rng)
            return d.loss
        names = {id(p): k for k, p in model.named_parameters()}
        chosen = model.parameters() if params is None else params
        trainable = tuple(sorted(names[id(p)] for p in chosen))
        n = len(y)
        if steps is None:
            steps = epochs * steps_per_epoch(n, batch_size, optim.drop_last)
        batches: list[Tensor] = []
        inputs: list[Tensor] = []  # with a transform only
        for idx in batch_indices(n, batch_size, steps, optim.drop_last, x.device):
            batches.append(idx)
            if transform is not None:
                inputs.append(transform(x[idx]))
        self.request = Request(
            model=model,
            start={k: v.detach().clone() for k, v in model.state_dict().items()},
            trainable=trainable,
            loss=_stackable(loss_fn),
            x=x,
            y=y,
            batches=batches,
            inputs=None if transform is None else inputs,
            optimizer=optim.optimizer,
            lr=lr * optim.lr_factor,
            momentum=momentum,
            weight_decay=weight_decay,
            max_norm=_max_norm(grad_hooks),
            rng=torch.get_rng_state(),
        )
        raise Pending


def _stackable(loss_fn: LossFn) -> StackableLoss:
    if loss_fn is cross_entropy:
        return StackableLoss(_cross_entropy, {})
    if isinstance(loss_fn, StackableLoss):
        return loss_fn
    raise RuntimeError(
        f"the vectorised engine needs cross_entropy or a StackableLoss, got {loss_fn!r}: an "
        "algorithm that declares vectorize = True must pass one"
    )


def _max_norm(hooks: Sequence[GradHook]) -> float | None:
    norms = [h.max_norm for h in hooks if isinstance(h, clip_grad)]
    if len(norms) != len(hooks) or len(norms) > 1:
        raise RuntimeError(
            "the vectorised engine applies train.grad_clip's clipping only, got the gradient "
            f"hooks {list(hooks)!r}: an algorithm that declares vectorize = True must add none"
        )
    return norms[0] if norms else None


# -- the cohort -------------------------------------------------------------------------------------


def train_cohort(
    algo: Algorithm,
    envs: Sequence[ClientEnv],
    jobs: Sequence[Any],
    check: Callable[[ClientEnv, Update, Any], Update | None],
    seed_torch: Callable[..., None],
    graphs: bool = False,
) -> dict[int, Update | None]:
    """Every training job's update by client, in job order, as the per-client path computes
    it (module docstring). ``check(env, update, ctx)`` is the per-client path's check of a
    finished update (its non-finite metrics and uploads), ``seed_torch(*keys)`` its seeding;
    ``graphs``: steps replayed as CUDA graphs (:func:`train_graphed`)."""
    tapes: dict[int, list[Done]] = {job.cid: [] for job in jobs}
    out: dict[int, Update | None] = {}
    pending = list(jobs)
    while pending:
        requests: dict[int, Request] = {}
        for job in pending:
            env, ctx = envs[job.cid], job.ctx
            tape = Tape(tapes[job.cid])
            seed_torch(ctx.seed, ctx.round, job.phase_index, job.cid)
            try:
                update = algo.client_update(replace(env, sgd=tape), job.payload, job.state, ctx)
            except Pending:
                assert tape.request is not None  # the tape records a request, then raises Pending
                requests[job.cid] = tape.request
                continue
            out[job.cid] = check(env, update, ctx)
        for cid, done in train_requests(requests, graphs).items():
            tapes[cid].append(done)
        pending = [job for job in pending if job.cid in requests]
    return {job.cid: out[job.cid] for job in jobs}


def train_requests(requests: Mapping[int, Request], graphs: bool = False) -> dict[int, Done]:
    """The outcome of every request, those with the same :meth:`Request.key` trained as one
    computation (at most :data:`MAX_STACK` at a time); ``graphs``: by :func:`train_graphed`."""
    groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    for cid, req in requests.items():
        groups[req.key()].append(cid)
    train = train_graphed if graphs else train_stacked
    out: dict[int, Done] = {}
    for cids in groups.values():
        for i in range(0, len(cids), MAX_STACK):
            part = cids[i : i + MAX_STACK]
            out.update(zip(part, train([requests[c] for c in part]), strict=True))
    return out


class _Objective(nn.Module):
    """The loss as a module, so that ``functional_call`` swaps the model's tensors for one
    client's: ``loss.fn(model, x, y, tensors, *loss.static)``."""

    def __init__(self, model: nn.Module, loss: StackableLoss):
        super().__init__()
        self.model = model
        self.fn, self.static = loss.fn, loss.static

    def forward(self, x: Tensor, y: Tensor, tensors: Mapping[str, Any]) -> Tensor:
        return self.fn(self.model, x, y, tensors, *self.static)


def stack(trees: Sequence[Any]) -> Any:
    """The clients' dicts of tensors (nested) stacked leaf by leaf along a new first dim."""
    first = trees[0]
    if isinstance(first, Mapping):
        return {k: stack([t[k] for t in trees]) for k in first}
    return torch.stack(list(trees))


def _take(tree: dict[str, Tensor], idx: Tensor | None) -> dict[str, Tensor]:
    return tree if idx is None else {k: v[idx] for k, v in tree.items()}


def _rows(tree: Any, rows: slice) -> Any:
    """The clients ``rows`` of stacked tensors (nested dicts): views."""
    if isinstance(tree, Mapping):
        return {k: _rows(v, rows) for k, v in tree.items()}
    return tree[rows]


def _put(
    tree: dict[str, Tensor],
    rows: slice,
    new: dict[str, Tensor],
    static: bool = False,
    mask: Tensor | None = None,
) -> None:
    """``new`` as the clients ``rows`` of ``tree``: copied into those rows, or, where the rows
    are all of them and ``static`` is False, the new tensors themselves. With ``mask`` (one
    bool a row), only the rows it marks take their new values."""
    for k, v in new.items():
        if mask is not None:
            v = torch.where(mask.view(-1, *([1] * (v.dim() - 1))), v, tree[k][rows])
        if not static and rows.start == 0 and rows.stop == len(tree[k]):
            tree[k] = v
        else:
            tree[k][rows] = v


def _keep(tree: dict[str, Tensor], n: int) -> dict[str, Tensor]:
    return {k: v[:n] for k, v in tree.items()}


class _Cohort:
    """Requests of one :meth:`Request.key` stacked for training (module docstring): the
    clients sorted by step count, most first, and among equal counts by the size of their last
    batch, largest first. A step's clients are then the first rows of the stack (the step mask)
    and its batch sizes runs of neighbouring rows, so every step reads and writes slices, never
    gathers (on a GPU each gather or scatter is one more kernel a tensor). ``static``: the
    stacked tensors are updated in place, never replaced (a CUDA graph reads them by address)."""

    def __init__(self, reqs: Sequence[Request], static: bool = False):
        self.order = sorted(
            range(len(reqs)), key=lambda i: (-len(reqs[i].batches), -_last(reqs[i]))
        )
        self.reqs = [reqs[i] for i in self.order]
        self.static = static
        r0 = self.reqs[0]
        model = r0.model.train()
        objective = _Objective(model, r0.loss)
        param_names = {k for k, _ in model.named_parameters()}
        self.state = {k: torch.stack([r.start[k] for r in self.reqs]) for k in r0.start}
        self.train = {k: self.state[k] for k in r0.trainable}
        self.frozen = {k: self.state[k] for k in param_names if k not in self.train}
        self.buffers = {k: v for k, v in self.state.items() if k not in param_names}
        self.tensors = stack([r.loss.tensors for r in self.reqs])
        self.opt = FunctionalOptimizer(r0, self.train, static)

        def client_loss(
            train: Weights, frozen: Weights, buffers: Weights, x: Tensor, y: Tensor, tensors: Any
        ) -> tuple[Tensor, tuple[Tensor, Weights]]:
            buffers = {k: v.clone() for k, v in buffers.items()}  # BatchNorm updates them in place
            swapped = {f"model.{k}": v for d in (train, frozen, buffers) for k, v in d.items()}
            loss = functional_call(objective, swapped, (x, y, tensors))
            return loss, (loss.detach(), buffers)

        self.grad = vmap(grad(client_loss, has_aux=True))
        self.device = r0.x.device
        # every client's inputs and labels of the whole call in step order, gathered once: a
        # step's batch is then a view (one gather per client, not one per client and step)
        self.xs = [r.x[_order(r)] if not r.inputs else torch.cat(r.inputs) for r in self.reqs]
        self.ys = [r.y[_order(r)] for r in self.reqs]
        self.sizes = [[len(b) for b in r.batches] for r in self.reqs]
        self.ends = [list(itertools.accumulate(s)) for s in self.sizes]
        self.counts = [len(r.batches) for r in self.reqs]
        self.total = torch.zeros(len(reqs), device=self.device)  # each client's summed loss

    def active(self, s: int) -> int:
        """The number of clients with a step ``s``: they are the first rows."""
        return sum(n > s for n in self.counts)

    def runs(self, s: int, active: int) -> Iterator[tuple[slice, int]]:
        """The runs of rows (and their batch size) among the first ``active`` at step ``s``."""
        lo = 0
        for size, run in itertools.groupby(self.sizes[i][s] for i in range(active)):
            hi = lo + len(list(run))
            yield slice(lo, hi), size
            lo = hi

    def batch(self, s: int, rows: slice, size: int) -> tuple[Tensor, Tensor]:
        """The batches of step ``s`` of the clients ``rows``, all of ``size`` samples."""
        i = range(rows.start, rows.stop)
        x = torch.stack([self.xs[j][self.ends[j][s] - size : self.ends[j][s]] for j in i])
        y = torch.stack([self.ys[j][self.ends[j][s] - size : self.ends[j][s]] for j in i])
        return x, y

    def step(
        self, rows: slice, x: Tensor, y: Tensor, bias: Bias, mask: Tensor | None = None
    ) -> None:
        """One step of the clients ``rows`` on their batches ``x``, ``y``; with ``mask``, only
        the rows it marks take it."""
        train = _rows(self.train, rows)
        grads, (loss, buffers) = self.grad(
            train, _rows(self.frozen, rows), _rows(self.buffers, rows), x, y,
            _rows(self.tensors, rows),
        )  # fmt: skip
        _put(self.train, rows, self.opt.step(train, grads, rows, bias, mask), self.static, mask)
        _put(self.buffers, rows, buffers, self.static, mask)
        self.total[rows] += loss if mask is None else loss * mask

    def written(self) -> list[Tensor]:
        """The tensors a step writes: the trained parameters, BatchNorm's buffers, the
        optimiser's moments and the loss sums."""
        return [*self.train.values(), *self.buffers.values(), *self.opt.tensors(), self.total]

    def done(self, final: Sequence[Weights]) -> list[Done]:
        """Every request's outcome in the requests' order, given each client's trained tensors
        (``final``, in stack order; a tensor not there is the client's row of the stack)."""
        counts = torch.tensor([max(c, 1) for c in self.counts], device=self.device)
        losses = (self.total / counts).tolist()
        done = {}
        for i, r in enumerate(self.reqs):
            weights = {k: final[i][k] if k in final[i] else self.state[k][i] for k in r.start}
            done[self.order[i]] = Done(weights, losses[i], r.rng)
        return [done[i] for i in range(len(self.reqs))]


def train_stacked(reqs: Sequence[Request]) -> list[Done]:
    """Train requests of one :meth:`Request.key` together (module docstring): the stack
    shrinks as clients finish, each step one :meth:`_Cohort.step` per run of batch sizes."""
    c = _Cohort(reqs)
    final: list[Weights] = [{} for _ in reqs]  # each client's trained tensors, once it is done

    def finish(lo: int, hi: int) -> None:
        """Clients ``lo`` to ``hi`` are done: their rows kept (copied: the stack shrinks)."""
        if lo < hi:
            rows = {k: v[lo:hi].clone() for k, v in {**c.train, **c.buffers}.items()}
            for i in range(lo, hi):
                final[i] = {k: v[i - lo] for k, v in rows.items()}

    active = len(reqs)
    for s in range(max(c.counts) + 1):
        now = c.active(s)
        if now < active:
            finish(now, active)
            c.train, c.buffers, active = _keep(c.train, now), _keep(c.buffers, now), now
            c.opt.keep(now)
        for rows, size in c.runs(s, active):
            c.step(rows, *c.batch(s, rows, size), c.opt.bias(s + 1))
    return c.done(final)


def train_graphed(reqs: Sequence[Request]) -> list[Done]:
    """Train requests of one :meth:`Request.key` together as :func:`train_stacked` does, but
    on a stack that never shrinks, so that steps have a few fixed shapes
    (``engine.cuda_graphs``).

    A step at which every client still training has a full batch (the largest batch size of
    the requests) steps the stack's first ``m`` rows, ``m`` the number of those clients
    rounded up to a power of two (at most all rows): a step mask keeps the rows of the done
    clients among them as they are (they compute on a stand-in batch, whose result is
    dropped). On CUDA the step of each ``m`` is captured as a CUDA graph the first time it is
    needed (after warm-up steps on a side stream, whose effect is then undone) and replayed at
    every such step: one launch a step instead of one a kernel; its batch is picked on the
    device, from a table of sample indices, by the step number it reads from a tensor.
    Elsewhere it runs as written (the tests' check of the same arithmetic). The other steps (a
    client's short last batch of an epoch) run as in :func:`train_stacked`, on the stack's
    rows in place."""
    c = _Cohort(reqs, static=True)
    n, steps = len(reqs), max(c.counts)
    full = max(max(s, default=0) for s in c.sizes)
    # the table of sample indices (into every client's inputs laid end to end) of each step
    # and client: a short batch is padded with its last sample (such a step runs unmasked, off
    # the table), a done client's batch is sample 0 (masked: a client steps while now < count)
    offsets = [0, *itertools.accumulate(len(x) for x in c.xs)]
    index = torch.zeros(steps, n, full, dtype=torch.long)
    for i in range(n):
        k = c.counts[i]
        sizes = torch.tensor(c.sizes[i], dtype=torch.long)
        first = offsets[i] + torch.tensor(c.ends[i], dtype=torch.long) - sizes
        offs = torch.arange(full).expand(k, full).minimum(sizes[:, None] - 1)
        index[:k, i] = first[:, None] + offs
    index, counts = index.to(c.device), torch.tensor(c.counts, device=c.device)
    pool_x, pool_y = torch.cat(c.xs), torch.cat(c.ys)
    biases = torch.tensor([c.opt.bias(s + 1) for s in range(steps)], device=c.device)
    now = torch.zeros(1, dtype=torch.long, device=c.device)  # the step number, for the graph

    def masked(m: int) -> Callable[[], None]:
        """The masked step of the first ``m`` rows, at step ``now``."""

        def step() -> None:
            idx = index.index_select(0, now)[0, :m].reshape(-1)
            x = pool_x.index_select(0, idx).view(m, full, *pool_x.shape[1:])
            y = pool_y.index_select(0, idx).view(m, full)
            b = biases.index_select(0, now)[0]
            c.step(slice(0, m), x, y, (b[0], b[1]), counts[:m] > now)

        return step

    regular: dict[int, Callable[[], None]] = {}  # the masked step of m rows, made when needed
    for s in range(steps):
        active = c.active(s)
        if all(c.sizes[i][s] == full for i in range(active)):
            m = min(n, 1 << (active - 1).bit_length())
            now.fill_(s)
            if m not in regular:
                regular[m] = _graphed(masked(m), c)
            regular[m]()
        else:  # a short batch: the runs of this step's rows, unmasked, as train_stacked steps
            for rows, size in c.runs(s, active):
                c.step(rows, *c.batch(s, rows, size), c.opt.bias(s + 1))
    return c.done([{} for _ in reqs])


def _graphed(fn: Callable[[], None], c: _Cohort) -> Callable[[], None]:
    """``fn`` (one step of the cohort ``c``, its tensors updated in place) captured as a CUDA
    graph on CUDA, and its replay; elsewhere ``fn`` itself. The warm-up runs ``fn`` for real:
    the cohort's tensors are put back."""
    if c.device.type != "cuda":
        return fn
    state = c.written()
    saved = [t.clone() for t in state]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # cuBLAS, cuDNN and autograd set up outside the capture
        for _ in range(GRAPH_WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:  # thread_local: another thread's CUDA calls (a copy to disk) do not break the capture
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except RuntimeError as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PflkitError(
            f"engine.cuda_graphs: the vectorised step could not be captured as a CUDA graph "
            f"({why}): set engine.cuda_graphs: false"
        ) from e
    torch._foreach_copy_(state, saved)
    return graph.replay


def _last(req: Request) -> int:
    return len(req.batches[-1]) if req.batches else 0


def _order(req: Request) -> Tensor:
    """The request's sample indices of every step, in step order."""
    if not req.batches:
        return torch.zeros(0, dtype=torch.long, device=req.y.device)
    return torch.cat(req.batches)


class FunctionalOptimizer:
    """torch's SGD (momentum, weight decay), Adam and AdamW update rules on stacked parameters,
    each client with its own moments; ``train.grad_clip`` clips each client's gradient to its
    own global norm first (torch's ``clip_grad_norm_``). ``static``: the moments are updated in
    place, never replaced (:class:`_Cohort`)."""

    BETAS = (0.9, 0.999)  # torch's defaults, which make_optimizer keeps
    EPS = 1e-8

    def __init__(self, req: Request, params: dict[str, Tensor], static: bool = False):
        self.kind, self.lr, self.static = req.optimizer, req.lr, static
        self.momentum, self.wd, self.max_norm = req.momentum, req.weight_decay, req.max_norm
        zeros = {k: torch.zeros_like(v) for k, v in params.items()}
        self.moments: list[dict[str, Tensor]] = []
        if self.kind in ("adam", "adamw"):
            self.moments = [zeros, {k: v.clone() for k, v in zeros.items()}]
        elif self.momentum:
            self.moments = [zeros]

    def bias(self, t: int) -> tuple[float, float]:
        """Adam's step size and the square root of its second bias correction at step ``t``
        (1-based), in double precision as torch's Adam computes them (SGD: unused)."""
        b1, b2 = self.BETAS
        return self.lr / (1 - b1**t), (1 - b2**t) ** 0.5

    def step(
        self,
        params: dict[str, Tensor],
        grads: dict[str, Tensor],
        rows: slice,
        bias: Bias,
        mask: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The parameters after a step of the clients ``rows`` of the stack, given their
        gradients and :meth:`bias` of the step (the same for every client stepping: numbers,
        or tensors a CUDA graph reads); with ``mask``, only the rows it marks update their
        moments (the caller keeps their parameters)."""
        if self.max_norm is not None:
            grads = clipped(grads, self.max_norm)
        moments = [_rows(m, rows) for m in self.moments]
        if self.kind == "sgd":
            new = self._sgd(params, grads, moments)
        else:
            new = self._adam(params, grads, moments, bias)
        for m, mine in zip(self.moments, moments, strict=True):
            _put(m, rows, mine, self.static, mask)
        return new

    def keep(self, n: int) -> None:
        """Only the first ``n`` clients step from now on (the others are done)."""
        self.moments = [_keep(m, n) for m in self.moments]

    def tensors(self) -> list[Tensor]:
        """The moments' tensors."""
        return [v for m in self.moments for v in m.values()]

    # torch._foreach_* (what torch's optimisers use on a GPU): each line below is one
    # operation over all the parameters, a kernel or two on a GPU rather than one per tensor

    def _sgd(self, params: Weights, grads: Weights, moments: list[Weights]) -> Weights:
        p: Tensors = list(params.values())
        g: Tensors = [grads[k] for k in params]
        if self.wd:
            g = torch._foreach_add(g, p, alpha=self.wd)
        if self.momentum:  # torch: buf = g at the first step, then buf * momentum + g
            g = torch._foreach_add(torch._foreach_mul(_of(moments[0], params), self.momentum), g)
            moments[0].update(zip(params, g, strict=True))
        return dict(zip(params, torch._foreach_add(p, g, alpha=-self.lr), strict=True))

    def _adam(self, params: Weights, grads: Weights, moments: list[Weights], bias: Bias) -> Weights:
        b1, b2 = self.BETAS
        step_size, bc2_sqrt = bias
        p: Tensors = list(params.values())
        g: Tensors = [grads[k] for k in params]
        if self.wd and self.kind == "adamw":
            p = torch._foreach_mul(p, 1 - self.lr * self.wd)
        elif self.wd:
            g = torch._foreach_add(g, p, alpha=self.wd)
        m = torch._foreach_lerp(_of(moments[0], params), g, 1 - b1)
        v = torch._foreach_addcmul(torch._foreach_mul(_of(moments[1], params), b2), g, g, 1 - b2)
        moments[0].update(zip(params, m, strict=True))
        moments[1].update(zip(params, v, strict=True))
        denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt(v), bc2_sqrt), self.EPS)
        step = torch._foreach_mul(torch._foreach_div(m, denom), step_size)
        return dict(zip(params, torch._foreach_sub(p, step), strict=True))


def _of(tree: Weights, like: Weights) -> list[Tensor]:
    return [tree[k] for k in like]


def clipped(grads: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    """Each client's gradients scaled to global L2 norm at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` scales one client's (coefficient max_norm / (norm +
    1e-6), at most 1)."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], 1).norm(dim=1)
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {k: g * coef.view(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}


# -- batched evaluation -----------------------------------------------------------------------------


@torch.no_grad()
def batched_accuracy(
    model: nn.Module,
    weights: dict[str, Tensor],
    splits: Sequence[tuple[Tensor, Tensor]],
    batch_size: int,
) -> list[float]:
    """The accuracy of each client's stacked ``weights`` (loaded into ``model``'s architecture,
    eval mode) on its own ``(x, y)`` of ``splits``: one vmapped forward per chunk of at most
    ``batch_size`` samples of every client; a client with fewer samples left is padded with
    its last one, not counted (eval mode: every sample's logits are its own)."""
    model.eval()
    forward = vmap(lambda w, x: functional_call(model, w, (x,)))
    sizes = [len(y) for _, y in splits]
    device = splits[0][1].device
    hits = torch.zeros(len(splits), device=device)
    for start in range(0, max(sizes, default=0), batch_size):
        members = [i for i, n in enumerate(sizes) if n > start]
        b = min(batch_size, max(sizes[i] for i in members) - start)
        rows = start + torch.arange(b, device=device)
        picks = [rows.clamp(max=sizes[i] - 1) for i in members]
        x = torch.stack([splits[i][0][r] for i, r in zip(members, picks, strict=True)])
        y = torch.stack([splits[i][1][r] for i, r in zip(members, picks, strict=True)])
        valid = rows[None, :] < torch.tensor([sizes[i] for i in members], device=device)[:, None]
        idx = torch.tensor(members, device=device)
        logits = forward(_take(weights, idx), x)
        hits[idx] += ((logits.argmax(-1) == y) & valid).sum(1).to(hits.dtype)
    return [h / max(n, 1) for h, n in zip(hits.tolist(), sizes, strict=True)]


def _split(x: Tensor | None, y: Tensor | None) -> tuple[Tensor, Tensor]:
    """A client's split as ``(x, y)``; evaluate_cohort asks only for splits the client has
    (every client has a test split; the validation split where ``val_y`` is set)."""
    assert x is not None and y is not None
    return x, y


def evaluate_cohort(
    algo: Algorithm,
    envs: Sequence[ClientEnv],
    jobs: Sequence[Any],
    scored_weights: Callable[..., Weights | None],
    one: Callable[[Any], dict[str, float]],
) -> dict[int, dict[str, float]]:
    """Every evaluation job's accuracies by client, in job order. ``scored_weights(job)``: the
    weights the job's client is scored with where the default scoring model scores them (else
    None); ``one(job)``: the per-client path's evaluation."""
    out: dict[int, dict[str, float]] = {}
    groups: dict[tuple[Any, ...], list[tuple[int, Weights]]] = defaultdict(list)
    for job in jobs:
        weights = scored_weights(job)
        if weights is None:
            out[job.cid] = one(job)
            continue
        env = envs[job.cid]
        shapes = tuple((k, tuple(v.shape)) for k, v in weights.items())
        groups[(env.arch, shapes)].append((job.cid, weights))
    for members in groups.values():
        for i in range(0, len(members), MAX_STACK):
            part = members[i : i + MAX_STACK]
            model = envs[part[0][0]].model()
            stacked = stack([w for _, w in part])
            batch = jobs[0].batch_size
            data = [envs[cid].data for cid, _ in part]
            test = batched_accuracy(
                model, stacked, [_split(d.test_x, d.test_y) for d in data], batch
            )
            for (cid, _), acc in zip(part, test, strict=True):
                out[cid] = {"test": acc}
            with_val = [(j, d) for j, d in enumerate(data) if d.val_y is not None]
            if with_val:
                sub = {k: v[[j for j, _ in with_val]] for k, v in stacked.items()}
                vals = [_split(d.val_x, d.val_y) for _, d in with_val]
                val = batched_accuracy(model, sub, vals, batch)
                for (j, _), acc in zip(with_val, val, strict=True):
                    out[part[j][0]]["val"] = acc
    return {job.cid: out[job.cid] for job in jobs}
