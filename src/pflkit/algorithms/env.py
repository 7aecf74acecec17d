"""What an algorithm may see: a :class:`ClientEnv` on the client side, a :class:`ServerEnv` on
the server side. The engine builds them (:func:`pflkit.engine.envs.make_envs`); an algorithm
object itself holds only its validated parameters.

- A **client environment** is one client's world: its own train/test tensors,
  the public set (when the run configures one), a model pool for its architecture, the resolved
  training settings, the run facts an algorithm legitimately needs (rounds, participation rate,
  whether MAP's selected-clients protocol will score its trained model) and
  :meth:`ClientEnv.train`.
  Nothing in it reaches another client's data or the server state: those arrive only in a
  payload.
- A **server environment** holds what a server may know: the number of clients, each client's
  architecture and training-sample count, the number of classes, the public set, a model pool
  and the same settings. No client's samples.

Model pools hand out one reusable model instance per (architecture, slot): load weights into
it in place (:func:`~pflkit.primitives.training.set_weights`) rather than building
models per client per round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from pflkit.algorithms.context import RoundContext
from pflkit.config import SampleDPConfig, SystemConfig, TrainConfig
from pflkit.data.federated import ClientData
from pflkit.models import PFLModel, build_model
from pflkit.primitives.training import (
    Weights,
    clip_grad,
    crop_flip,
    get_weights,
    local_sgd,
    steps_per_epoch,
)


def given(t: Tensor | None, what: str) -> Tensor:
    """``t``, narrowed from ``Tensor | None`` for the type checker where the engine guarantees
    it is there: the public set, once the algorithm's ``check`` refused a run without one, and
    a client's validation split where it has one (a client's train and test splits are typed as
    tensors: ``ClientData`` requires them). None is a bug of the caller, raised as a
    RuntimeError naming ``what``."""
    if t is None:
        raise RuntimeError(f"{what} is missing: the engine guarantees it here")
    return t


class ModelPool:
    """Builds models by architecture key and keeps one reusable instance per (arch, slot)."""

    def __init__(
        self,
        specs: dict[str, tuple[str, dict[str, Any]]],
        input_shape: tuple[int, ...],
        num_classes: int,
        device: torch.device,
    ):
        self.specs = specs
        self.input_shape = input_shape
        self.num_classes = num_classes
        self.device = device
        self._models: dict[tuple[str, int | str], PFLModel] = {}

    def model(self, arch: str, slot: int | str = 0) -> PFLModel:
        """The reusable instance of ``arch`` in ``slot`` (its values are to be overwritten)."""
        key = (arch, slot)
        if key not in self._models:
            # building it must not consume the RNG stream of the step that happens to ask first
            with torch.random.fork_rng(devices=[]):
                self._models[key] = self.new_model(arch)
        return self._models[key]

    def new_model(self, arch: str) -> PFLModel:
        """A freshly initialised model (draws from torch's global RNG, seeded by the engine)."""
        name, options = self.specs[arch]
        with torch.device("cpu"):  # initialised on the CPU: a seed gives the same start anywhere
            model = build_model(name, self.input_shape, self.num_classes, **options)
        return model.to(self.device)

    def init_weights(self, arch: str) -> Weights:
        return get_weights(self.new_model(arch))


@dataclass
class RunFacts:
    """Settings of the run that algorithms may read (never the whole config)."""

    train: TrainConfig  # resolved local-training settings
    seed: int
    selected_eval: bool  # MAP's protocol will score each selected client's trained model
    system: SystemConfig = field(default_factory=SystemConfig)  # dropout and stragglers
    # sample-level DP-SGD in every local step (privacy.sample_dp; None: off)
    sample_dp: SampleDPConfig | None = None

    @property
    def rounds(self) -> int:
        return self.train.rounds

    @property
    def client_fraction(self) -> float:
        """The share of clients per round; for a range ``[a, b]`` (a new share drawn each
        round) its expected value ``(a + b) / 2``."""
        f = self.train.client_fraction
        return float(f) if isinstance(f, int | float) else (f[0] + f[1]) / 2


@dataclass
class ClientEnv:
    """One client's environment (see the module docstring)."""

    cid: int
    """The client's id, 0-based."""
    data: ClientData
    """The client's own train / test (/ validation) tensors."""
    num_classes: int
    """Classes of the task."""
    arch: str
    """The client's architecture key in ``models`` (heterogeneous runs differ per client)."""
    models: ModelPool
    """Reusable model instances of the run's architectures."""
    run: RunFacts
    """The run settings an algorithm may read."""
    public_x: Tensor | None = None
    """The public set's inputs (``data.public``), or None when the run has none."""
    sgd: Callable[..., float] | None = None
    """The loop that runs :meth:`train`'s steps, with local_sgd's signature: None is local_sgd;
    the vectorised engine (engine.vectorize) sets its recorder
    (:class:`pflkit.engine.vectorized.Tape`)."""

    @property
    def num_train(self) -> int:
        """The client's number of training samples."""
        return self.data.size("train")

    @property
    def device(self) -> torch.device:
        """The run's device: where this client's data and models are."""
        return self.models.device

    def model(self, slot: int | str = 0) -> PFLModel:
        """The reusable model of this client's architecture in ``slot`` (load weights into it;
        its values are to be overwritten)."""
        return self.models.model(self.arch, slot)

    def init_weights(self) -> Weights:
        """Freshly initialised weights of this client's architecture."""
        return self.models.init_weights(self.arch)

    def train(self, model: nn.Module, ctx: RoundContext, **overrides: Any) -> float:
        """Local SGD on this client's training split with the run's optimiser settings;
        ``overrides`` replace any of local_sgd's keyword arguments (epochs, lr, loss_fn, ...).
        ``grad_hooks`` given here run after ``train.grad_clip``'s clipping, when it is set;
        ``train.augment`` augments the batches. The round context ``ctx`` gives the optimiser,
        the round's learning-rate factor and drop_last (``ctx.optim``); a straggler (``ctx.work``
        below 1) runs ``ctx.work_steps`` of the steps asked for. With ``privacy.sample_dp`` the
        steps are DP-SGD's (:func:`pflkit.privacy.dpsgd.dp_sgd`: Poisson batches, per-sample
        clipping and noise through Opacus; ``grad_hooks`` run on the noised gradient)."""
        t = self.run.train
        hooks = [clip_grad(t.grad_clip)] if t.grad_clip is not None else []
        hooks += list(overrides.pop("grad_hooks", ()))
        kwargs: dict[str, Any] = dict(
            epochs=t.local_epochs,
            batch_size=t.batch_size,
            lr=t.lr,
            momentum=t.momentum,
            weight_decay=t.weight_decay,
            grad_hooks=hooks,
        )
        if t.augment == "crop_flip":
            kwargs["transform"] = crop_flip(t.crop_padding)
        kwargs.update(overrides)
        if ctx.work < 1:  # a straggler: a share of the steps, counted as local_sgd counts them
            steps = kwargs.get("steps")
            if steps is None:
                per_epoch = steps_per_epoch(self.num_train, kwargs["batch_size"], ctx.drop_last)
                steps = kwargs["epochs"] * per_epoch
            kwargs["steps"] = ctx.work_steps(steps)
        x, y = self.data.train_x, self.data.train_y
        if self.run.sample_dp is not None:
            from pflkit.privacy.dpsgd import dp_sgd  # imports Opacus: only when asked for

            return dp_sgd(model, x, y, self.run.sample_dp, optim=ctx.optim, **kwargs)
        sgd = local_sgd if self.sgd is None else self.sgd
        return sgd(model, x, y, optim=ctx.optim, **kwargs)


@dataclass
class ServerEnv:
    """What the server may know (see the module docstring)."""

    num_clients: int
    """Clients of the run."""
    archs: list[str]
    """Each client's architecture key."""
    global_arch: str
    """The server's / global model's architecture key."""
    num_samples: list[int]
    """Each client's training-sample count."""
    num_classes: int
    """Classes of the task."""
    models: ModelPool
    """Reusable model instances of the run's architectures."""
    run: RunFacts
    """The run settings an algorithm may read."""
    public_x: Tensor | None = None
    """The public set's inputs (``data.public``), or None when the run has none."""

    @property
    def device(self) -> torch.device:
        """The run's device: where the models and the public set are."""
        return self.models.device

    def arch(self, cid: int | None = None) -> str:
        """Client ``cid``'s architecture key; the global model's when ``cid`` is None."""
        return self.global_arch if cid is None else self.archs[cid]

    def model(self, arch: str | None = None, slot: int | str = 0) -> PFLModel:
        """The reusable model of ``arch`` (default the global architecture) in ``slot``."""
        return self.models.model(arch or self.global_arch, slot)

    def init_weights(self, arch: str | None = None) -> Weights:
        """Freshly initialised weights of ``arch`` (default the global architecture)."""
        return self.models.init_weights(arch or self.global_arch)
