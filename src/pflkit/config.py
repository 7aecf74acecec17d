"""The schema of an experiment's configuration: a pydantic model per section, and :func:`parse`.

This module declares and validates; it computes nothing at run time and reads no file. Reading
a YAML file within the limits, ``--set`` overrides and ``--algorithms`` are
:mod:`pflkit.config_io`'s; the device a name stands for is :func:`pflkit.devices.resolve_device`'s;
the learning-rate schedule's factor is :func:`pflkit.engine.schedule.lr_factor`'s
(tests/test_structure.py keeps this module's imports to the standard library, pydantic,
:mod:`pflkit.errors` and :mod:`pflkit.strict`).

Every section is a pydantic model with ``extra="forbid"``, so a misspelt key is an error, not a
silently ignored setting. Algorithm hyper-parameters live under ``algorithm:`` next to its
``name``; this module knows no algorithm: :mod:`pflkit.experiment` (``load_config``,
``validate``) loads the plugins and has that algorithm's own ``Params`` model validate them and
fill in every default. Validation errors are turned into one :class:`PflkitError` sentence.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from pflkit.errors import PflkitError
from pflkit.strict import StrictNumbers

# a seed must fit numpy's and torch's generators; more threads than this is a typo
MAX_SEED = 2**32 - 1
MAX_THREADS = 512
# upper bounds far above any real experiment: a larger value is a typo (an extra zero or an
# exponent) that would otherwise run for ever or exhaust memory (docs/guide.md, "Bounds")
MAX_ROUNDS = 1_000_000  # train.rounds and every count of rounds
MAX_EPOCHS = 10_000  # train.local_epochs, eval.finetune_epochs
MAX_BATCH = 1_000_000  # train.batch_size, eval.batch_size (100000 already means full batch)
MAX_CLIENTS = 1_000_000  # model.per_client[].count


class _Section(StrictNumbers):
    pass


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(v: Any) -> Any:
    """A byte count from a number or a string such as "512MB" or "4 GiB" (anything else is
    left for the field's own validation to refuse)."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", v)
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(
                f"must be a number of bytes or a size such as '512MB' or '4GiB' (got {v!r})"
            )
        return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if isinstance(v, int) and not isinstance(v, bool) and v < 0:
        raise ValueError("must be a number of bytes >= 0")
    return v


def _named(v: dict[str, Any], example: str) -> dict[str, Any]:
    if "name" not in v:
        raise ValueError(f"needs a 'name' (e.g. {example})")
    if not isinstance(v["name"], str):
        raise ValueError(f"'name' must be a name (a string), e.g. {example}")
    return v


class PublicConfig(_Section):
    """Unlabelled public/reference set (KT-pFL, FedMD, FedDF)."""

    dataset: str = "mnist5k"
    size: int = Field(3000, gt=0)
    # The public set's labels are never used, but a class count that differs from the task's
    # is refused unless allowed explicitly (KT-pFL's CIFAR-100 public set for CIFAR-10).
    allow_other_classes: bool = False


class DataConfig(_Section):
    dataset: str = "fashion_mnist"
    root: str | None = None  # default: $PFLKIT_DATA or ~/.cache/pflkit/data
    download: bool = True
    options: dict[str, Any] = {}  # passed to the source loader (e.g. emnist split)
    subset: int | None = Field(None, gt=0)  # keep a random subset of the training set
    num_clients: int = Field(20, gt=0)
    partition: dict[str, Any] = {"name": "dirichlet", "alpha": 0.1}
    test_fraction: float = Field(0.25, gt=0, lt=1)  # each client's local test split
    # each client's local validation split: a share of its samples held out from training
    # (what ``pflkit sweep --select val`` selects on); 0: none
    val_fraction: float = Field(0.0, ge=0, lt=1)
    public: PublicConfig | None = None
    # pFL's generalisation to new clients: this share of the clients (a seeded draw from
    # data.seed) never trains; they are scored after the personalization step their algorithm
    # defines (Algorithm.adapt_holdout; docs/guide.md, "Held-out clients"). 0: none
    holdout_clients: float = Field(0.0, ge=0, lt=1)

    @field_validator("holdout_clients")
    @classmethod
    def _leaves_trainers(cls, v: float, info: Any) -> float:
        k = info.data.get("num_clients")
        if k is not None and round(v * k) >= k:
            raise ValueError(
                f"holds out round({v} x {k}) = {round(v * k)} of the {k} clients and leaves "
                "none to train: lower it, or use more clients"
            )
        return v

    cache: bool = True  # cache partitions on disk, keyed by a hash of their parameters
    seed: int = Field(
        0, ge=0, le=MAX_SEED
    )  # partition seed, separate from the training seed (compare keeps it fixed)

    @field_validator("partition")
    @classmethod
    def _has_name(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _named(v, "{name: dirichlet, alpha: 0.1}")

    @field_validator("val_fraction")
    @classmethod
    def _leaves_training_data(cls, v: float, info: Any) -> float:
        test = info.data.get("test_fraction")
        if test is not None and test + v >= 1:
            raise ValueError(
                f"data.test_fraction + data.val_fraction must be below 1 (got {test} + {v}), "
                "to leave each client samples to train on: lower one of them"
            )
        return v


class ArchSpec(_Section):
    """One architecture of a heterogeneous federation: ``count`` consecutive clients use it."""

    name: str
    options: dict[str, Any] = {}
    count: int = Field(1, gt=0, le=MAX_CLIENTS)


class ModelConfig(_Section):
    name: str = "cnn4"  # the server's / global architecture (and every client's by default)
    options: dict[str, Any] = {}
    # Heterogeneous clients: architectures (a name or {name, options, count}) assigned to
    # clients 0, 1, 2, ... in order, each repeated ``count`` times, the list cycled if shorter
    # than the number of clients. E.g. [{name: lenet5, count: 5}, {name: resnet18, count: 5}].
    per_client: list[str | ArchSpec] | None = None


class TrainConfig(_Section):
    rounds: int = Field(50, gt=0, le=MAX_ROUNDS)
    # the share of the clients sampled each round, max(round(share * K), 1) of them; a range
    # [a, b] draws the share uniformly from [a, b] anew each round, from the seed and the round
    # (GPFL's random participation, its Table 4; pflkit.engine.simulation.round_fraction)
    client_fraction: float | list[float] = 1.0
    local_epochs: int = Field(1, gt=0, le=MAX_EPOCHS)
    batch_size: int = Field(10, gt=0, le=MAX_BATCH)
    lr: float = Field(0.005, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)

    @field_validator("client_fraction", mode="before")
    @classmethod
    def _share_or_range(cls, v: Any) -> Any:
        def share(x: Any) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool) and 0 < x <= 1

        if share(v):
            return v
        if isinstance(v, list | tuple) and len(v) == 2 and all(map(share, v)) and v[0] <= v[1]:
            return [float(x) for x in v]
        raise ValueError(
            "must be a share of the clients in (0, 1], or a range [a, b] with 0 < a <= b <= 1 "
            "(e.g. [0.1, 1.0]) to draw a new share each round"
        )

    @field_validator("lr")
    @classmethod
    def _fits_float32(cls, v: float) -> float:
        if v >= 1e30:
            raise ValueError("must be below 1e30 (a float32 step cannot hold it)")
        return v

    # the local optimiser of every client's training (momentum applies to sgd; adam and adamw
    # use torch's default betas; weight_decay is L2 in sgd and adam, decoupled in adamw)
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    # the learning rate over rounds (pflkit.engine.schedule.lr_factor): constant; step: x lr_gamma every
    # lr_step_rounds rounds (PFLlib's -ld: gamma 0.99 every round); cosine: from lr at round 1
    # down to lr_min after the last round. It scales every local learning rate of the round
    # (an algorithm's own ones too, e.g. Ditto's personal_lr)
    lr_schedule: Literal["constant", "step", "cosine"] = "constant"
    lr_gamma: float = Field(0.99, gt=0, le=1)
    lr_step_rounds: int = Field(1, gt=0, le=MAX_ROUNDS)
    lr_min: float = Field(0.0, ge=0)

    @field_validator("lr_min")
    @classmethod
    def _below_lr(cls, v: float, info: Any) -> float:
        if "lr" in info.data and v > info.data["lr"]:
            raise ValueError(f"must not exceed train.lr ({info.data['lr']})")
        return v

    # data augmentation of the clients' training batches (images only): random crop after
    # zero-padding by crop_padding pixels, plus horizontal flip (FedProto's, pFedSim's CIFAR)
    augment: Literal["none", "crop_flip"] = "none"
    crop_padding: int = Field(4, ge=0, le=64)
    # drop each local epoch's last, incomplete mini-batch (PFLlib's DataLoader drop_last=True);
    # a client with fewer samples than a batch still takes one step on all of them
    drop_last: bool = False
    # clip each local step's gradient to this L2 norm (off by default; the MAP code uses 100)
    grad_clip: float | None = Field(None, gt=0)
    # the server's averaging rule for every algorithm that averages client models (those with a
    # ``weighting`` parameter): null keeps each algorithm's own default; ``uniform`` or
    # ``samples`` imposes one rule on all of them (a comparison states it once, here)
    weighting: Literal["uniform", "samples"] | None = None
    # a client whose training metrics or uploaded weights are not finite: stop the run (one
    # sentence, exit 2) or leave the client out of that round (listed in diverged_clients)
    on_nan: Literal["stop", "skip_client"] = "stop"
    # divergence that stays finite: a round whose mean training loss exceeds max_loss stops the
    # run (one sentence, exit 2; the folder resumes from its last checkpoint). A working run's
    # losses stay far below it (at most 25 in every kept run in results/); null: no bound
    max_loss: float | None = Field(1e4, gt=0)
    # a round in which every selected client dropped out (system.dropout) or was left out by
    # on_nan: skip_client, so that nothing reaches the server: stop the run (one sentence,
    # exit 2) or go on with the server unchanged
    on_empty_round: Literal["stop", "continue"] = "stop"


class SystemConfig(_Section):
    """System heterogeneity, simulated (as PFLlib's ``client_drop_rate`` / ``train_slow_rate``
    and FL-bench's options): each selected client of a round independently drops out with
    probability ``dropout`` (it trains and uploads nothing; listed in ``dropped_clients`` and
    left out of the aggregate, as a failed client is), otherwise is a straggler with probability
    ``stragglers`` (its local training runs ``max(1, floor(straggler_work * steps))`` of its
    steps; listed in ``straggler_clients``). The draws are seeded by (seed, round, client), so
    every runner sees the same ones. A section of its own: these are properties of the
    simulated devices, not training settings. The defaults (0) change nothing."""

    dropout: float = Field(0.0, ge=0, lt=1)
    stragglers: float = Field(0.0, ge=0, lt=1)
    straggler_work: float = Field(0.5, gt=0, le=1)  # a straggler's share of its local steps


class EvalConfig(_Section):
    # evaluate every N rounds (and always at the last round)
    every: int = Field(1, gt=0, le=MAX_ROUNDS)
    # also evaluate every round of the last N rounds; summaries then report the mean over them
    last: int = Field(0, ge=0, le=MAX_ROUNDS)
    # a speed setting: full batches only, whose logits do not depend on the size (predict);
    # 250 was faster than 1,000 on one CPU thread for cnn4 (docs/benchmarks.md)
    batch_size: int = Field(250, gt=0, le=MAX_BATCH)
    global_model: bool = True  # score the server model on the global test set
    # MAP's personalization protocol: also score the round's selected clients with their model
    # right after local training (metric pers_acc_selected, unweighted mean)
    selected_clients: bool = False
    # score every client's personalized model (the global one where it has none) after this
    # many epochs of plain local SGD with cross-entropy on its training split, on a copy that
    # is then thrown away (training is unchanged; global_acc is not fine-tuned): FedProto's
    # code scores clients so (LocalTest.fine_tune, --ft_round 10). Costs K local epochs per
    # client per evaluation (pflkit.engine.clients.evaluate_client)
    finetune_epochs: int = Field(0, ge=0, le=MAX_EPOCHS)
    # which clients' personalized models an evaluation round scores: all of them, or a seeded
    # sample of N (the same for every algorithm of a compare; a new sample each evaluation
    # round); the row then reports the estimate and its standard error (docs/guide.md)
    clients: int | Literal["all"] = "all"
    # the metrics scored: names in pflkit.eval.metrics.METRICS (accuracy, loss, perplexity,
    # f1_macro, balanced_accuracy, ece, and plug-ins'). Accuracy is scored in any case (the
    # pers_acc_* and global_acc fields); each other one adds pers_<key>_mean / _weighted /
    # _std / _worst10 / _clients and global_<key> to the rows (docs/guide.md, "Metrics")
    metrics: list[str] = Field(["accuracy"], min_length=1)

    @field_validator("clients")
    @classmethod
    def _sample_size(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be 'all' or a positive number of clients to sample")
        return v


class EngineConfig(_Section):
    """Where client work runs (:mod:`pflkit.engine.clients`). ``workers``: ``auto`` (default)
    is one worker process per CPU core on CPU (1.9x faster anchor rounds than in-process on 2
    cores) and up to 8 processes sharing a GPU (4.9x on an H100; ``auto_workers``,
    docs/benchmarks.md); 1 runs clients in this process; N > 1 in N worker processes (on an
    accelerator they share it, each with its own context). With one torch thread in this
    process (``threads``) and in each worker (``threads_per_worker``), the defaults, every
    runner and every worker count give the same numbers bit for bit."""

    workers: int | Literal["auto"] = "auto"
    threads_per_worker: int = Field(1, gt=0, le=MAX_THREADS)  # torch threads in each worker process
    # the client runner, by its name in pflkit.engine.runners.RUNNERS (checked when the run
    # starts): pool (this machine's process pool, or this process with workers: 1),
    # in-process, ray (a Ray cluster's workers: ``pip install 'pflkit[ray]'``), flower
    # (Flower's ServerApp only), or one a plug-in registers
    runner: str = "pool"
    # the Ray cluster to join (``ray start --head`` prints it, e.g. 10.0.0.5:6379); null: a
    # cluster started on this machine for the run
    ray_address: str | None = None
    # the resources one Ray worker takes (fractions share a GPU)
    ray_cpus: float = Field(1.0, gt=0)
    ray_gpus: float = Field(0.0, ge=0)
    # bytes of client states kept in memory (an LRU cache); the rest live on disk under the
    # run folder (pflkit.engine.states). A number of bytes or a size such as "512MB", "4GiB"
    state_memory: int = 4 * 2**30
    # a worker trains its share of the cohort as one batched computation (torch.func) and
    # scores the clients' models the same way (pflkit.engine.vectorized; the algorithms that
    # declare vectorize = True). auto: per client for now (slower on CPU; not yet measured on
    # a GPU, docs/benchmarks.md)
    vectorize: bool | Literal["auto"] = "auto"
    # with engine.vectorize: true on a CUDA device, the training steps at which every client
    # still training has a full batch are CUDA graphs, captured in each round and replayed
    # (one launch a step, not one a kernel; pflkit.engine.vectorized.train_graphed)
    cuda_graphs: bool = False

    @field_validator("state_memory", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return parse_size(v)

    @field_validator("workers")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be 'auto' or a positive number of worker processes")
        return v


class OutputConfig(_Section):
    dir: str = "runs"
    # 0: none (one is still written on an interrupt)
    checkpoint_every: int = Field(0, ge=0, le=MAX_ROUNDS)
    progress: bool = True
    # experiment trackers besides metrics.csv (always written): tensorboard, wandb
    trackers: list[Literal["tensorboard", "wandb"]] = []
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"


class CompareConfig(_Section):
    """What ``pflkit compare`` runs: algorithms (a name, or a dict with name and parameters)
    and training seeds. All runs share one partition (``data.seed``)."""

    algorithms: list[str | dict[str, Any]] = Field(["local", "fedavg", "fedavg_ft"], min_length=1)
    seeds: list[Annotated[int, Field(ge=0, le=MAX_SEED)]] = Field([0, 1, 2], min_length=1)

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        twice = sorted({s for s in v if v.count(s) > 1})
        if twice:  # two runs of one seed would share (and collide on) one run folder
            raise ValueError(f"compare.seeds lists seed {twice[0]} twice: list each seed once")
        return v


class SweepConfig(_Section):
    """What ``pflkit sweep`` runs and reports (:mod:`pflkit.report.results`): ``grid`` maps a
    config key to the values to try (``algorithm.<p>`` varies parameter ``p`` of the
    algorithms that have it; ``compare.algorithms`` and ``compare.seeds`` say which
    algorithms and seeds). ``select``: choose each algorithm's setting on the validation
    split (``data.val_fraction`` > 0) or on test accuracy (labelled optimistic); ``metric``
    and ``at`` say which number is compared and reported."""

    grid: dict[str, Annotated[list[Any], Field(min_length=1)]] = {}
    select: Literal["val", "test", "none"] = "val"
    metric: Literal["pers_acc_mean", "pers_acc_weighted", "pers_acc_worst10", "global_acc"] = (
        "pers_acc_mean"
    )
    at: Literal["last", "mean_last", "val_round", "best_test"] = "last"


class ClientDPConfig(_Section):
    """Client-level differential privacy of the uploads (:mod:`pflkit.privacy.client_dp`):
    DP-FedAvg (McMahan et al., ICLR 2018). Each client's update of the parts its algorithm
    releases (its release map) is clipped to L2 norm ``clip``; ``mode: central`` adds Gaussian
    noise of std ``noise_multiplier * clip`` to their sum at the server, ``mode: local`` to
    each client's clipped update. Give ``noise_multiplier`` or ``target_epsilon`` (the noise
    multiplier that spends exactly that epsilon over ``train.rounds``), not both."""

    clip: float = Field(1.0, gt=0)  # C, the initial one with adaptive clipping
    noise_multiplier: float | None = Field(None, ge=0)  # z
    target_epsilon: float | None = Field(None, gt=0)
    target_delta: float | None = Field(None, gt=0, lt=1)  # null: 1 / number of clients
    mode: Literal["central", "local"] = "central"
    accountant: Literal["rdp", "pld"] = "rdp"
    # adaptive clipping (Andrew et al., NeurIPS 2021): C follows the target_quantile of the
    # update norms, C <- C exp(-clip_lr (b - target_quantile)), b the noised clipped fraction
    adaptive: bool = False
    target_quantile: float = Field(0.5, gt=0, lt=1)  # gamma
    clip_lr: float = Field(0.2, gt=0)  # eta_C
    # sigma_b, the std of the noise on the clipped count; null: cohort size / 20 (paper §3)
    count_noise: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_noise(self) -> ClientDPConfig:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                "give exactly one of noise_multiplier (the noise) and target_epsilon (the "
                "privacy budget the noise is calibrated to)"
            )
        return self


class SampleDPConfig(_Section):
    """Sample-level DP-SGD in every client's local training, personal steps included, through
    Opacus (:mod:`pflkit.privacy.dpsgd`): per-sample gradients clipped to ``max_grad_norm``,
    Gaussian noise of std ``noise_multiplier * max_grad_norm`` added to their sum, one
    accountant per client."""

    max_grad_norm: float = Field(1.0, gt=0)
    noise_multiplier: float = Field(1.0, ge=0)
    target_delta: float | None = Field(None, gt=0, lt=1)  # null: 1 / the client's sample count
    accountant: Literal["rdp", "prv", "gdp"] = "rdp"


class PrivacyConfig(_Section):
    """Differential privacy (docs/privacy.md): none unless a section is given."""

    client_dp: ClientDPConfig | None = None
    sample_dp: SampleDPConfig | None = None


class ExperimentConfig(_Section):
    """One experiment, validated: a section per top-level YAML key, each key with a default
    and a misspelt key refused (docs/guide.md, "Configuration", lists them all). Built by
    :func:`pflkit.experiment.load_config` from a file and ``--set`` overrides, or by
    :func:`pflkit.experiment.validate` from a dict; ``dump()`` gives the dict back."""

    name: str = "experiment"
    # modules that register user algorithms, models, datasets, partitioners (pflkit.plugins)
    plugins: list[str] = []
    seed: int = Field(0, ge=0, le=MAX_SEED)
    device: str = "auto"  # auto | cpu | cuda | cuda:N (pflkit.devices.resolve_device)
    # torch threads in this process; 1 (default) gives the same numbers on every machine and
    # runner; None: torch's choice (one per core), whose last bits depend on the core count
    threads: int | None = Field(1, gt=0, le=MAX_THREADS)
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    algorithm: dict[str, Any] = {"name": "fedavg"}
    train: TrainConfig = TrainConfig()
    system: SystemConfig = SystemConfig()
    eval: EvalConfig = EvalConfig()
    engine: EngineConfig = EngineConfig()
    output: OutputConfig = OutputConfig()
    compare: CompareConfig = CompareConfig()
    sweep: SweepConfig = SweepConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    # the algorithm section parsed into its class and typed Params: set by
    # pflkit.experiment.validate, read through pflkit.experiment.algorithm_of (this module
    # knows no algorithm); not a setting: not dumped, but pickled with the config
    _typed_algorithm: Any = PrivateAttr(None)

    @field_validator("algorithm")
    @classmethod
    def _algo_has_name(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _named(v, "{name: fedavg}")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """The resolved config as YAML (what a run folder's config.yaml holds)."""
        return yaml.safe_dump(self.dump(), sort_keys=False)


def need_config(value: Any, where: str) -> ExperimentConfig:
    """``value`` if it is an :class:`ExperimentConfig`, else one sentence: ``where`` (the API
    function) takes a loaded config, not the path, name or dict ``load_config`` reads."""
    if isinstance(value, ExperimentConfig):
        return value
    how = f"load_config('{value}')" if isinstance(value, str | os.PathLike) else "load_config(...)"
    raise PflkitError(
        f"{where} takes a config (an ExperimentConfig), got {type(value).__name__}: "
        f"pass {how}, which reads a file, an example's name or a dict"
    )


_UNION_TAGS = ("str", "int", "float", "bool", "ArchSpec")


def _plain(loc: tuple[Any, ...]) -> list[Any]:
    """``loc`` without the union members' tags, which are no config keys."""
    return [
        p
        for p in loc
        if not (
            isinstance(p, str)
            and (p in _UNION_TAGS or p.startswith(("literal[", "list[", "function-")))
        )
    ]


def _describe(err: ValidationError) -> str:
    errors = err.errors()
    # a value that fits no member of a union (model.per_client's `name | {name, options,
    # count}`, say) has one error per member, each under the member's tag: the deepest one
    # (a bad field of the dict) says most; members as deep (engine.vectorize's `bool | 'auto'`)
    # each name a value that fits, so all of them are said
    e = max(errors, key=lambda e: len(e["loc"]))  # the first of the deepest
    loc = _plain(e["loc"]) if len(errors) > 1 else list(e["loc"])
    where = ".".join(str(p) for p in loc) or "config"
    value = e.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    if e["type"] == "extra_forbidden":
        return f"unknown config key '{where}': remove it or check its spelling"
    msgs = [
        o["msg"].removeprefix("Value error, ")  # our validators' sentences stand alone
        for o in errors
        if len(o["loc"]) == len(e["loc"]) and _plain(o["loc"]) == loc
    ]
    return f"invalid config value '{where}'{shown}: {'; or '.join(dict.fromkeys(msgs))}"


def parse(raw: dict[str, Any]) -> ExperimentConfig:
    """The typed config of ``raw``, every value checked against the schema; a mistake is one
    sentence (:class:`PflkitError`). The ``algorithm`` section stays as given and the device
    is not looked for: :func:`pflkit.experiment.validate` does both."""
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise PflkitError(_describe(err)) from None
