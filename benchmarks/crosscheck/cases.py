"""The cross-check cases: one per (algorithm, reference library), with the reference's
command-line arguments and the pflkit options that reproduce the reference's code.

The shared settings (data, model, rounds, clients per round, batch size, lr, local epochs,
evaluation every round) come from the config and are passed to both sides by
``crosscheck.py``; a case adds only the algorithm's own settings, each with its source.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    key: str  # the row name, e.g. "fedrep"
    library: str  # "pfllib" or "flbench"
    ref_name: str  # the reference's algorithm name (PFLlib -algo, FL-bench method)
    ref_args: tuple[str, ...]  # the reference's algorithm arguments
    pflkit: dict = field(default_factory=dict)  # pflkit's algorithm section
    note: str = ""  # where each setting comes from
    settings: dict = field(default_factory=dict)  # other pflkit config sections, e.g. train
    # added to the reference's round labels to give pflkit's round: 1 where the reference
    # scores after local training (PFLlib's FedPHP), 0 where it scores before, as pflkit does
    round_shift: int = 0


_PFLLIB = "PFLlib main.py"
_FLB = "FL-bench config/defaults.yaml and get_hyperparams"
CASES: dict[str, Case] = {
    c.key: c
    for c in [
        Case("fedavg", "pfllib", "FedAvg", (), {"name": "fedavg"}, f"{_PFLLIB} defaults."),
        Case(
            "fedprox",
            "pfllib",
            "FedProx",
            ("-mu", "0.01"),
            {"name": "fedprox", "mu": 0.01},
            "mu 0.01 on both sides (pflkit's default, FedProx's grid; PFLlib's -mu default is 0).",
        ),
        Case("fedper", "pfllib", "FedPer", (), {"name": "fedper"}, f"{_PFLLIB} defaults."),
        Case(
            "local",
            "pfllib",
            "Local",
            (),
            {"name": "local"},
            f"{_PFLLIB} defaults: each client trains its own model, nothing is shared (the "
            "control for FedAMP, whose PFLlib clients train the same way).",
        ),
        Case(
            "fedrep",
            "pfllib",
            "FedRep",
            ("-pls", "1"),
            {"name": "fedrep", "head_epochs": 1},
            "One head epoch a round: PFLlib's -pls default (main.py), not pflkit's 10.",
        ),
        Case("fedrod", "pfllib", "FedROD", (), {"name": "fedrod"}, f"{_PFLLIB} defaults."),
        Case(
            "ditto",
            "pfllib",
            "Ditto",
            ("-mu", "0.1", "-pls", "1"),
            {"name": "ditto", "lam": 0.1, "personal_epochs": 1, "weighting": "samples"},
            "lambda 0.1 (pflkit's default; PFLlib's -mu), one personal epoch (PFLlib's -pls "
            "default); PFLlib weights every upload by training samples.",
        ),
        Case(
            "gpfl",
            "pfllib",
            "GPFL",
            ("-lam", "0.01", "-mu", "0.1"),
            {
                "name": "gpfl",
                "lam": 0.01,
                "mu": 0.1,
                "mlg": "batch_frobenius",
                "regulariser": "weight_decay",
                "cond_source": "local_previous",
            },
            "The authors' code forms (L_mlg as a batch Frobenius norm, mu as weight decay, the "
            "condition from the local previous round) with run_me.sh's lambda 0.01, mu 0.1.",
        ),
        Case(
            "perfedavg",
            "pfllib",
            "PerAvg",
            (),
            {"name": "perfedavg", "weighting": "samples"},
            "alpha = beta = lr (clientperavg.py: beta is the learning rate, -bt is ignored); "
            "PFLlib trains every selected client twice a round (serverperavg.py lines 35-36), "
            "hence two local epochs in pflkit; uploads weighted by samples (serverbase.py).",
            {"train": {"local_epochs": 2}},
        ),
        Case(
            "pfedme",
            "pfllib",
            "pFedMe",
            ("-lam", "15", "-lrp", "0.01", "-K", "5", "-bt", "1"),
            {
                "name": "pfedme",
                "lam": 15.0,
                "personal_lr": 0.01,
                "inner_steps": 5,
                "beta": 1.0,
                "weighting": "samples",
                "theta_decay": 0.001,
                "scored": "global",
            },
            "lambda 15, K 5, beta 1 (pFedMe's code), personal lr 0.01 (PFLlib's -lrp, as the "
            "GPFL config); uploads weighted by training samples (serverbase.py). PFLlib's code "
            "forms: its inner step adds 0.001 theta (fedoptimizer.py lines 34, 45: theta_decay "
            "0.001) and its 'personalized' accuracy scores the global model (clientpFedMe.py "
            "lines 56, 68, 74-77; serverpFedMe.py lines 31, 41: scored global).",
        ),
        Case(
            "scaffold",
            "pfllib",
            "SCAFFOLD",
            ("-slr", "1.0"),
            {"name": "scaffold", "eta_g": 1.0, "weighting": "uniform", "control_scale": "paper"},
            "Server lr 1 (-slr), model deltas averaged over the round's clients, control variates "
            "by |S|/N (serverscaffold.py lines 129-131); PFLlib scores the global model. The "
            "config's train.weighting (samples, PFLlib's other averages) is lifted for this case.",
            settings={"train": {"weighting": None}},
        ),
        Case(
            "moon",
            "pfllib",
            "MOON",
            ("-mu", "1", "-tau", "0.5"),
            {"name": "moon", "mu": 1.0, "tau": 0.5, "first_prev": "initial"},
            "mu 1 and tau 0.5 on both sides (pflkit's defaults, MOON's paper; PFLlib's -mu "
            "default 0 is FedAvg). PFLlib's previous model starts as the initial model "
            "(clientmoon.py line 17): first_prev initial (with every client in every round it "
            "changes only round 1's reported loss, by mu log 2). Known difference: PFLlib runs "
            "its reference models in train mode (clientmoon.py lines 43-44, 53), which the "
            "4-layer CNN (no BatchNorm, no dropout) does not notice.",
        ),
        Case(
            "fedproto",
            "pfllib",
            "FedProto",
            ("-lam", "1"),
            {
                "name": "fedproto",
                "lam": 1.0,
                "reg": "sample_mse",
                "proto_timing": "running",
                "proto_agg": "uniform",
                "inference": "prototype",
            },
            "PFLlib's code forms: per-sample MSE to the global prototypes, prototypes collected "
            "while training, their plain mean on the server, nearest-prototype inference "
            "(clientproto.py lines 46-67, 101-131; serverproto.py lines 107-122).",
        ),
        Case(
            "fedamp",
            "pfllib",
            "FedAMP",
            ("-lam", "1", "-alk", "1"),
            {"name": "fedamp", "lam": 0.0},
            "PFLlib's penalty is built from p.data (clientamp.py lines 40-42) and has no "
            "gradient, so its clients train on cross-entropy alone: pflkit's lam 0 is that run.",
        ),
        Case(
            "fedphp",
            "pfllib",
            "FedPHP",
            ("-mu", "0.9", "-lam", "0.01"),
            {
                "name": "fedphp",
                "lam": 0.01,
                "mu": 0.9,
                "kt": "mmd",
                "mmd_form": "pfllib",
                "hpm_init": "start",
                "mu_schedule": "code",
                "personal": "trained",
            },
            "mu 0.9 and lambda 0.01: PFLlib's author's values for FedPHP (PFLlib issue #102) "
            "and pflkit's defaults (main.py's -lam 1 / -mu 0 would train on the MMD alone). "
            "PFLlib's code forms: its fixed-bandwidth MMD (clientphp.py lines 93-130), the "
            "private model a copy of the initial model (line 15), momentum (mu / T) R (lines 12, "
            "48), each client's just-trained model scored (serverphp.py lines 28-34). Known "
            "difference: PFLlib evaluates after local training, so its 'Round number: r' is "
            "pflkit's round r + 1 (it runs rounds 0-50): round_shift 1 aligns the curves.",
            round_shift=1,
        ),
        # FL-bench (pFedSim's Table 3 ran its baselines there): config fmnist_dir01_xc.yaml
        Case("fedavg-flbench", "flbench", "fedavg", (), {"name": "fedavg"}, f"{_FLB} defaults."),
        Case("fedper-flbench", "flbench", "fedper", (), {"name": "fedper"}, f"{_FLB} defaults."),
        Case(
            "fedrep-flbench",
            "flbench",
            "fedrep",
            (),
            {"name": "fedrep", "head_epochs": 4, "body_epochs": 1},
            "FL-bench's FedRep trains the head for local_epoch - train_body_epoch = 4 epochs, then "
            "the body for 1 (src/client/fedrep.py; train_body_epoch default 1).",
        ),
        Case("fedbn", "flbench", "fedbn", (), {"name": "fedbn"}, f"{_FLB} defaults."),
        Case(
            "pfedsim",
            "flbench",
            "pfedsim",
            ("pfedsim.warmup_round=0.5",),
            {
                "name": "pfedsim",
                "warmup_ratio": 0.5,
                "sim_reduce": "mean_then_log",
                "self_weight": "code",
                "bn_stats": "aggregate",
            },
            "pFedSim's code options: self-similarity 0.9999 before -log(1 - w) "
            "(src/server/pfedsim.py), the similarity averaged over the classes before the "
            "transform; BN statistics aggregated as FL-bench HEAD does; warm-up half the rounds.",
        ),
        Case(
            "fedfomo",
            "flbench",
            "fedfomo",
            (),
            {"name": "fedfomo", "m": 5, "val_fraction": 0.2, "epsilon": 0.0},
            "M 5, validation 20% (src/server/fedfomo.py get_hyperparams); FL-bench has no "
            "epsilon-greedy exploration, hence epsilon 0. Known differences: FL-bench may pick "
            "the client itself among its M, floors the validation size, adds 1e-5 to the "
            "distance and accumulates the raw Eq. 5 weights.",
        ),
        Case(
            "fedap",
            "flbench",
            "fedap",
            ("+fedap.version=f",),
            {"name": "fedap", "warmup_ratio": 0.5, "momentum": 0.5, "warmup_epochs": 1},
            "f-FedAP (--version f), warm-up 0.5, model momentum 0.5; its warm-up rounds train 1 "
            "local epoch (src/server/fedap.py, package): warmup_epochs 1. Known difference: "
            "FL-bench takes BN statistics per batch from every client after the warm-up.",
        ),
        Case(
            "fedgen",
            "flbench",
            "fedgen",
            (),
            {
                "name": "fedgen",
                "eta": 0.0,
                "teacher_labels": "client",
                "teacher": "server",
                "gen_labels": "round",
                "gen_lr_decay": 0.98,
                "client_gen_mode": "train",
            },
            "FL-bench's ensemble_eta 0 (src/server/fedgen.py line 32); its clients draw the "
            "teacher labels from their own labels (src/client/fedgen.py lines 66-72): "
            "teacher_labels client; it trains the generator against the server model's own "
            "classifier, not the clients' heads (lines 98-111): teacher server; on labels whose "
            "mean count over the round's clients exceeds 1 (lines 139-143): gen_labels round; "
            "its Adam lr decays by 0.98 a round (lines 51-53, 128): gen_lr_decay 0.98; its "
            "clients run the generator in train mode and skip one-sample batches "
            "(src/client/fedgen.py lines 45, 49): client_gen_mode train. The other FedGen "
            "defaults agree (lines 26-39).",
        ),
        Case(
            "feddyn",
            "flbench",
            "feddyn",
            (),
            {
                "name": "feddyn",
                "alpha": 0.1,
                "weighting": "samples",
                "prox_term": "linear",
                "clip_on": "total",
            },
            "alpha 0.1 and gradient clipping at 10 (src/server/feddyn.py lines 23-24), of the "
            "whole gradient, FedDyn's terms included (src/client/feddyn.py lines 33-37): "
            "clip_on total; FL-bench's client loss CE + alpha <theta, nabla_k - theta^{t-1}> "
            "(client lines 30-32, server lines 34-36; SGD without weight decay) has no "
            "alpha/2 ||theta||^2 part: prox_term linear; uploads weighted by training samples. "
            "Known difference: FL-bench skips batches of one sample (client lines 24-25). "
            "Without the alpha theta pull the weights grow and the training cross-entropy "
            "passes pflkit's default train.max_loss (1e4) near round 67 while accuracy stays "
            "near 75%: FL-bench goes on, so train.max_loss is lifted here.",
            {"train": {"grad_clip": 10.0, "max_loss": None}},
        ),
    ]
}
