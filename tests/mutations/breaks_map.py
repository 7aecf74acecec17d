"""Breaks of MAP and its family (issue 10): the restricted softmax, the HPM stage, MAP's
partition and evaluation protocol, FedPHP's upload."""

from mutate import Break

T = ("tests/test_map.py",)
BREAKS = [
    Break(
        "fedrs",
        "RS logits scaled by alpha^2",
        "algorithms/blocks/rs.py",
        "F.cross_entropy(model(x) * scale, y)",
        "F.cross_entropy(model(x) * scale * scale, y)",
        T,
    ),
    Break(
        "map",
        "Eq.13 lambda swapped",
        "algorithms/blocks/hpm.py",
        "(1 - p.lam) * F.cross_entropy(logits, y) + p.lam * kt",
        "p.lam * F.cross_entropy(logits, y) + (1 - p.lam) * kt",
        T,
    ),
    Break(
        "map",
        "KT teacher is the student",
        "algorithms/blocks/hpm.py",
        "            hp = teacher.features(x)\n            gp = teacher.head(hp)",
        "            hp = model.features(x)\n            gp = model.head(hp)",
        T,
    ),
    Break(
        "map",
        "KD sums over the batch",
        "algorithms/blocks/hpm.py",
        'reduction="batchmean"',
        'reduction="sum"',
        T,
    ),
    Break(
        "map",
        "partition drops 1/n_k",
        "data/partition.py",
        "d[client, chosen] = 1.0 / n_k[client]",
        "d[client, chosen] = 1.0",
        T,
    ),
    Break(
        "map",
        "protocol scores the upload",
        "algorithms/base.py",
        '        return personal if personal is not None else upload["weights"]',
        '        return upload["weights"]',
        T,
    ),
    Break(
        "map",
        "protocol scores every client",
        "engine/simulation.py",
        "self.runner.evaluate(rnd, {cid: views[cid] for cid in uploads}, uploads)",
        "self.runner.evaluate(rnd, views, uploads)",
        T,
    ),
    Break(
        "map",
        "stage B ignores stage_b_lr_scale",
        "algorithms/map.py",
        "lr_b = env.run.train.lr * self.params.stage_b_lr_scale",
        "lr_b = env.run.train.lr",
        T,
    ),
    Break(
        "fedphp",
        "FedPHP uploads its HPM",
        "algorithms/fedphp.py",
        'upload = {"weights": get_weights(model), "num_samples": env.num_train}',
        'upload = {"weights": state["hpm"], "num_samples": env.num_train}',
        T,
    ),
]
