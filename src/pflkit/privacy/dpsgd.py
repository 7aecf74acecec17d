"""Sample-level differential privacy: DP-SGD (Abadi et al., "Deep Learning with Differential
Privacy", CCS 2016) in every client's local training, through Opacus (``privacy.sample_dp``;
docs/dp-sgd.md).

Every local step a client runs on its training split goes through :meth:`ClientEnv.train
<pflkit.algorithms.env.ClientEnv.train>`; with ``privacy.sample_dp`` set, that runs
:func:`dp_sgd` instead of :func:`~pflkit.primitives.training.local_sgd`, for the
shared model and the personal ones alike (Ditto's personal model, FedRep's head epochs, an
HPM's fine-tuning, ...). One step, with B = ``train.batch_size`` and n the client's training
samples:

1. a Poisson batch: every sample joins with probability q = min(B / n, 1), drawn from torch's
   global RNG (which the engine seeds per (seed, round, phase, client));
2. per-sample gradients g_i of the loss through Opacus's hooks (``GradSampleHooks``: the model
   is not wrapped, so an algorithm's loss calls it as before);
3. Opacus's ``DPOptimizer`` clips each g_i to L2 norm C = ``max_grad_norm`` over all the
   optimised tensors together, sums them, adds Gaussian noise of std z C
   (z = ``noise_multiplier``) and divides by the expected batch size q n; the noise comes from a
   ``torch.Generator`` seeded from the global RNG at the start of the loop, so a run is
   deterministic whatever runner or worker trains the client;
4. the gradient of the loss's terms that are not per-sample (a proximal term
   (mu / 2) ||w - w_g||^2, a parameter regulariser) is added after the noise: Opacus gives
   those no per-sample gradient and its optimiser would overwrite them. It is the gradient of
   the loss on one fixed all-zero input with label 0, less that input's own per-sample
   gradient, so it is computed from no private sample at all; the plain cross-entropy has
   none and skips it;
5. the algorithm's gradient hooks (``train.grad_clip``, SCAFFOLD's correction, FedDyn's terms,
   FedAMP's pull) run on that gradient, then the optimiser steps (post-processing).

Accounting: each client has its own accountant. The steps it has run, as
``[noise_multiplier, sampling_rate, steps]`` entries, travel with its state under the reserved
key :data:`HISTORY` (kept beside the algorithm's own state by the engine's job function,
:func:`client_update`, and never shown to the algorithm), so the count survives worker
processes, the on-disk state store, checkpoints and resume. After each training job the
client's epsilon at its delta (``target_delta``, default 1 / n) is in the update's metrics as
``dpsgd_epsilon``, from Opacus's accountant (``rdp``, ``prv`` or ``gdp``).

What is covered and what is refused: :func:`check_sample_dp` (at construction). The client's
sample count n is treated as public (it sets q, and FedAvg weighs uploads by it); the training
loss and the accuracies in the metrics are measurements of the experiment, not releases.
"""

from __future__ import annotations

import contextvars
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from pflkit.config import ExperimentConfig, SampleDPConfig
from pflkit.errors import PflkitError
from pflkit.primitives.training import (
    PLAIN_SGD,
    GradHook,
    LocalOptim,
    LossFn,
    cross_entropy,
    frozen_except,
    make_optimizer,
    steps_per_epoch,
)

if TYPE_CHECKING:
    from pflkit.algorithms.base import Algorithm, Payload, State, Update
    from pflkit.algorithms.context import RoundContext
    from pflkit.algorithms.env import ClientEnv, ServerEnv

HISTORY = "_dpsgd"  # client-state entry: [[noise_multiplier, sampling_rate, steps], ...]

# -- which algorithms DP-SGD covers ------------------------------------------------------------

_RS = (
    "its restricted softmax scales every sample's logits by the client's class counts, a "
    "statistic of all its samples that per-sample clipping does not bound"
)
_EVAL_TRAINING = (
    "it fine-tunes on the client's data at every evaluation and throws the result away, so "
    "those DP-SGD steps cannot be counted by the client's accountant"
)
# algorithm -> why DP-SGD cannot cover it (one clause), or a function of its parameters that
# says so (None: covered with these parameters)
REFUSED: dict[str, str | Callable[[Any], str | None]] = {
    "fedavg_ft": _EVAL_TRAINING,
    "pfeddf": _EVAL_TRAINING,
    "perfedavg": (
        "its MAML step moves the model with one part of a batch before scoring the other part, "
        "so no sample has a gradient of its own (and it adapts on the client's data at every "
        "evaluation)"
    ),
    "pfedme": (
        "its inner Moreau-envelope steps train the personal model with plain whole-batch "
        "gradients of the client's data, outside DP-SGD"
    ),
    "fedrs": _RS,
    "dittors": _RS,
    "map": _RS,
    "scamap": _RS,
    "scars": _RS,
    "fedrod": (
        "its balanced softmax uses the client's class counts, a statistic of all its samples "
        "that per-sample clipping does not bound"
    ),
    "fedgen": (
        "it uploads the client's label counts, a statistic of its training data computed "
        "outside DP-SGD"
    ),
    "fedproto": (
        "it uploads class prototypes, means of its samples' features computed outside DP-SGD"
    ),
    "pfedpm": (
        "it uploads class prototypes computed outside DP-SGD and trains its relation network "
        "in a loop of its own"
    ),
    "fedfomo": (
        "it weighs the downloaded models by their loss on the client's validation samples, a "
        "use of its data outside DP-SGD"
    ),
    "fedap": (
        "it uploads per-channel statistics of the client's training data computed outside "
        "DP-SGD (and needs BatchNorm, which Opacus refuses)"
    ),
    "flda": (
        "its gate is a raw tensor applied to the input outside any layer, for which Opacus "
        "computes no per-sample gradient"
    ),
    "gpfl": (
        "its conditional valves and global category embeddings are raw tensors outside the "
        "model's layers, for which Opacus computes no per-sample gradient"
    ),
    "fedmmd": lambda p: (
        "its MMD term compares the features of the whole batch, so no sample has a gradient "
        "of its own (lam: 0 is FedAvg and allowed)"
        if p.lam
        else None
    ),
    "fedphp": lambda p: (
        "kt: mmd compares the features of the whole batch, so no sample has a gradient of its "
        "own (kt: kd is allowed)"
        if p.kt == "mmd"
        else "hpm_bn_recompute re-estimates BatchNorm statistics on the client's data outside "
        "DP-SGD"
        if p.hpm_bn_recompute
        else None
    ),
    "fedaws": lambda p: (
        "client_loss: positive reads the classifier's weights outside its layer's forward, "
        "where Opacus computes no per-sample gradient (client_loss: ce is allowed)"
        if p.client_loss == "positive"
        else None
    ),
}

# the class attribute by which an algorithm declares itself covered (docs/dp-sgd.md); an
# algorithm in REFUSED is refused whatever it declares
OPT_IN = "sample_dp_covered"


def covered(cls: type) -> bool:
    """Whether ``cls`` itself (not a base class) declares DP-SGD coverage."""
    return bool(vars(cls).get(OPT_IN, False))


def describe(cls: type[Algorithm]) -> str:
    """What ``pflkit list --params`` says of DP-SGD for ``cls`` (one line)."""
    why = REFUSED.get(cls.name)
    if isinstance(why, str):
        return f"DP-SGD: refused, {why}"
    if not covered(cls):
        return f"DP-SGD: refused, not declared ({OPT_IN})"
    return "DP-SGD: covered" + (" (some parameter values are refused)" if why else "")


def algorithm_refusal(algo: Algorithm) -> str | None:
    """Why DP-SGD cannot cover ``algo`` with its parameters (a clause), or None."""
    why = REFUSED.get(algo.name)
    if callable(why):
        return why(algo.params)
    if why is not None:
        return why
    if covered(type(algo)):
        return None
    return (
        "its local objective has not been checked for DP-SGD (a batch mean of per-sample "
        f"losses trained through ClientEnv.train); set {OPT_IN} = True on its class once it is"
    )


def model_refusal(model: nn.Module) -> str | None:
    """Why Opacus cannot compute per-sample gradients of ``model`` (a clause), or None: a layer
    Opacus's validators refuse (BatchNorm), or a trainable layer that holds buffers."""
    from opacus.validators import ModuleValidator

    for name, m in model.named_modules():
        if not any(p.requires_grad for p in m.parameters(recurse=False)):
            continue
        kind = type(m).__name__
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return (
                f"its {kind} layer '{name}' mixes the samples of a batch through batch "
                "statistics, which Opacus refuses: pick a model without BatchNorm"
            )
        validate = ModuleValidator.VALIDATORS.get(type(m))
        errors = validate(m) if validate is not None else []
        if errors:
            return f"Opacus refuses its {kind} layer '{name}' ({errors[0]})"
        if any(True for _ in m.buffers()):
            return (
                f"its {kind} layer '{name}' holds buffers, which Opacus refuses in a "
                "trainable layer"
            )
    return None


def check_sample_dp(cfg: ExperimentConfig, algo: Algorithm, senv: ServerEnv) -> None:
    """Refuse, in one sentence (:class:`PflkitError`), a run with ``privacy.sample_dp`` that
    DP-SGD cannot cover: an algorithm whose use of the client's data is not DP-SGD steps
    (:data:`REFUSED`, or not vetted), a model Opacus refuses (BatchNorm), training that the
    client's accountant cannot count (``eval.finetune_epochs``, ``data.holdout_clients``), or
    Opacus missing. Nothing to do without ``privacy.sample_dp``."""
    if cfg.privacy.sample_dp is None:
        return
    try:
        import opacus  # noqa: F401
    except ImportError:
        raise PflkitError(
            "privacy.sample_dp trains with Opacus, which is not installed: "
            "pip install 'pflkit[privacy]'"
        ) from None
    why = algorithm_refusal(algo)
    if why is not None:
        raise PflkitError(f"privacy.sample_dp cannot cover algorithm '{algo.name}': {why}")
    if cfg.eval.finetune_epochs:
        raise PflkitError(
            "privacy.sample_dp cannot cover eval.finetune_epochs: each evaluation fine-tunes "
            "on the client's data and throws the result away, so its accountant cannot count "
            "those steps; set eval.finetune_epochs: 0"
        )
    if cfg.data.holdout_clients:
        raise PflkitError(
            "privacy.sample_dp cannot cover data.holdout_clients: a held-out client's "
            "personalization step runs again at every evaluation and is thrown away, so its "
            "accountant cannot count it; set data.holdout_clients: 0"
        )
    for arch, (name, _) in senv.models.specs.items():
        why = model_refusal(senv.models.model(arch))
        if why is not None:
            raise PflkitError(f"privacy.sample_dp cannot train model '{name}': {why}")


# -- accounting ----------------------------------------------------------------------------------

History = list[list[float]]  # [[noise_multiplier, sampling_rate, steps], ...]


class Tally:
    """The DP-SGD steps of one training job, as history entries."""

    def __init__(self) -> None:
        self.history: History = []

    def add(self, noise_multiplier: float, sampling_rate: float, steps: int) -> None:
        self.history = merged(self.history, [[noise_multiplier, sampling_rate, steps]])


_TALLY: contextvars.ContextVar[Tally | None] = contextvars.ContextVar("dpsgd_tally", default=None)


@contextmanager
def accounting() -> Iterator[Tally]:
    """Within the block, :func:`dp_sgd` counts its steps in the tally it yields (a client's
    training job); outside one, DP-SGD refuses to train (nothing would count the steps)."""
    tally = Tally()
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


def merged(history: Iterable[Sequence[float]], more: Iterable[Sequence[float]]) -> History:
    """``history`` with the entries of ``more`` added, steps summed per (noise, rate) pair
    (composition does not depend on the order of the steps)."""
    out: dict[tuple[float, float], int] = {}
    for z, q, steps in [*history, *more]:
        key = (float(z), float(q))
        out[key] = out.get(key, 0) + int(steps)
    return [[z, q, s] for (z, q), s in out.items()]


def epsilon(history: Sequence[Sequence[float]], delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` after the steps of ``history``, from Opacus's accountant
    (``rdp``, ``prv`` or ``gdp``); 0 before any step, inf without noise."""
    steps = [(float(z), float(q), int(s)) for z, q, s in history if int(s) > 0]
    if not steps:
        return 0.0
    if any(z == 0 for z, _, _ in steps):
        return math.inf
    from opacus.accountants import create_accountant

    if accountant == "gdp" and len(steps) > 1:
        raise PflkitError(
            "the gdp accountant composes one (noise multiplier, sampling rate) pair, but this "
            f"client trained with {len(steps)}: set privacy.sample_dp.accountant: rdp"
        )
    with warnings.catch_warnings():  # gdp's "experimental" warning, prv's numerics
        warnings.simplefilter("ignore")
        acc = create_accountant(accountant)
        acc.history = steps
        return float(acc.get_epsilon(delta))


def client_delta(dp: SampleDPConfig, num_train: int) -> float:
    """The client's delta: ``target_delta``, or 1 / its training-sample count."""
    return dp.target_delta if dp.target_delta is not None else 1.0 / max(num_train, 1)


def without_history(state: State) -> State:
    """The algorithm's part of a client state (the reserved :data:`HISTORY` entry left out)."""
    if HISTORY not in state:
        return state
    return {k: v for k, v in state.items() if k != HISTORY}


def client_update(
    algo: Algorithm, env: ClientEnv, payload: Payload, state: State, ctx: RoundContext
) -> Update:
    """``algo.client_update`` with DP-SGD's accounting around it (the engine's job function
    calls it when ``privacy.sample_dp`` is set): the algorithm gets its state without the
    reserved :data:`HISTORY` entry; the returned state carries the entry with this job's steps
    added, and the metrics ``dpsgd_steps`` (all the client's steps so far) and
    ``dpsgd_epsilon`` (its epsilon at its delta; left out without noise, where it is
    infinite)."""
    dp = env.run.sample_dp
    assert dp is not None
    before = (state or {}).get(HISTORY, [])
    with accounting() as tally:
        update = algo.client_update(env, payload, without_history(state), ctx)
    history = merged(before, tally.history)
    metrics = {**update.metrics, "dpsgd_steps": float(sum(int(s) for *_, s in history))}
    if dp.noise_multiplier > 0:
        metrics["dpsgd_epsilon"] = epsilon(history, client_delta(dp, env.num_train), dp.accountant)
    return update._replace(state={**update.state, HISTORY: history}, metrics=metrics)


class EpsilonTable:
    """The engine's view of every client's epsilon (the latest ``dpsgd_epsilon`` of each
    client that has trained), for the ``dpsgd_*`` fields of each metrics row; checkpointed
    with :meth:`state` / :meth:`load`."""

    def __init__(self) -> None:
        self.eps: dict[int, float] = {}

    def record(self, cid: int, metrics: dict[str, float]) -> None:
        if "dpsgd_epsilon" in metrics:
            self.eps[int(cid)] = float(metrics["dpsgd_epsilon"])

    def row(self) -> dict[str, float]:
        if not self.eps:
            return {}
        values = list(self.eps.values())
        return {
            "dpsgd_epsilon_max": max(values),
            "dpsgd_epsilon_mean": sum(values) / len(values),
        }

    def state(self) -> dict[int, float]:
        return dict(self.eps)

    def load(self, state: dict[int, float] | None) -> None:
        self.eps = {int(k): float(v) for k, v in (state or {}).items()}


# -- the DP-SGD loop -----------------------------------------------------------------------------


def dp_sgd(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    dp: SampleDPConfig,
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
    """:func:`~pflkit.primitives.training.local_sgd`'s contract (same arguments, the
    same number of steps, the mean training loss) as DP-SGD with ``dp``'s clipping norm and
    noise (module docstring); the steps are counted in the open :func:`accounting` block."""
    from opacus.grad_sample import GradSampleHooks
    from opacus.optimizers import DPOptimizer

    tally = _TALLY.get()
    if tally is None:
        raise PflkitError(
            "privacy.sample_dp: DP-SGD trained outside a client's training job (at evaluation?), "
            "where the client's accountant cannot count the steps"
        )
    model.train()
    params = list(model.parameters() if params is None else params)
    owned = {id(p) for p in model.parameters()}
    if any(id(p) not in owned for p in params):
        raise PflkitError(
            "privacy.sample_dp: the algorithm trains tensors outside the model's layers, for "
            "which Opacus computes no per-sample gradient"
        )
    n = len(y)
    if steps is None:
        steps = epochs * steps_per_epoch(n, batch_size, optim.drop_last)
    if n == 0 or steps == 0:
        return 0.0
    q = min(batch_size / n, 1.0)
    # noise from a stream of its own, seeded from the engine-seeded global RNG
    seed = int(torch.randint(0, 2**62, (1,), device="cpu"))
    gen = torch.Generator(device=x.device).manual_seed(seed)
    regularised = loss_fn is not cross_entropy  # terms without per-sample gradients, maybe
    total = torch.zeros((), device=x.device)
    batches = 0
    with frozen_except(model, params), warnings.catch_warnings():
        # the first layer's input needs no gradient: torch says so on every backward pass
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        hooks = GradSampleHooks(model, loss_reduction="mean")
        opt = DPOptimizer(
            make_optimizer(params, lr, momentum, weight_decay, optim),
            noise_multiplier=dp.noise_multiplier,
            max_grad_norm=dp.max_grad_norm,
            expected_batch_size=q * n,
            loss_reduction="mean",
            generator=gen,
        )
        try:
            for _ in range(steps):
                extra = _data_free_grads(model, loss_fn, x, y, params, opt) if regularised else None
                opt.zero_grad(set_to_none=True)
                # Poisson sampling, drawn on the CPU: the same batches on every device
                idx = torch.nonzero(torch.rand(n, device="cpu") < q)[:, 0].to(x.device)
                if len(idx):
                    xb = x[idx] if transform is None else transform(x[idx])
                    loss = loss_fn(model, xb, y[idx])
                    loss.backward()
                    total += loss.detach()
                    batches += 1
                for p in params:  # a tensor this batch did not reach: no per-sample gradient
                    if getattr(p, "grad_sample", None) is None:
                        p.grad_sample = torch.zeros(
                            (len(idx), *p.shape), device=p.device, dtype=p.dtype
                        )
                opt.pre_step()  # clip, sum, noise, divide by q n (Opacus)
                if extra is not None:
                    for p, g in zip(params, extra, strict=True):
                        if g is not None:
                            p.grad.add_(g)
                for hook in grad_hooks:
                    hook(params)
                opt.original_optimizer.step()
        finally:
            opt.zero_grad(set_to_none=True)
            hooks.cleanup()
            for p in params:
                if hasattr(p, "summed_grad"):
                    del p.summed_grad
            for m in model.modules():  # what Opacus's hooks leave on the layers
                for attr in ("activations", "max_batch_len"):
                    if hasattr(m, attr):
                        delattr(m, attr)
    tally.add(dp.noise_multiplier, q, steps)
    return float(total) / max(batches, 1)


def _data_free_grads(
    model: nn.Module, loss_fn: LossFn, x: Tensor, y: Tensor, params: list[Tensor], opt: Any
) -> list[Tensor | None]:
    """The gradient of the loss's terms that have no per-sample gradient (a proximal term, a
    regulariser), per tensor of ``params``: the loss's gradient on one all-zero input with
    label 0 less that input's per-sample gradient. No private sample enters it."""
    opt.zero_grad(set_to_none=True)
    loss_fn(model, torch.zeros_like(x[:1]), torch.zeros_like(y[:1])).backward()
    out: list[Tensor | None] = []
    for p in params:
        if p.grad is None:
            out.append(None)
            continue
        gs = getattr(p, "grad_sample", None)
        out.append(p.grad.detach().clone() if gs is None else p.grad.detach() - gs[0])
    return out
