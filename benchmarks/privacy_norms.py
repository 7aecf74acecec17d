"""The L2 norms of the 20 clients' round-1 FedAvg updates on configs/privacy/fmnist_dp.yaml
(without DP): the clipping norm C of the privacy-utility table is their median, fixed before
any DP run (Andrew et al.'s median rule, applied once).

    python benchmarks/privacy_norms.py [CONFIG]
"""

from __future__ import annotations

import math
import sys

import numpy as np

from pflkit.algorithms.context import ServerContext
from pflkit.engine.clients import InProcess, TrainJob, round_context
from pflkit.engine.simulation import Simulation
from pflkit.experiment import load_config
from pflkit.privacy.client_dp import ClientDP


def main(path: str = "configs/privacy/fmnist_dp.yaml") -> None:
    cfg = load_config(path)
    cfg = cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"client_dp": None})})
    with Simulation(cfg, runner=InProcess()) as sim:
        norms = []
        for cid in range(sim.data.num_clients):
            pay = sim.algo.configure(sim.senv, sim.server, cid, ServerContext(1, "train"))
            ctx = round_context(sim.senv.run, 1, "train")
            job = TrainJob(cid, pay, sim.client_state(cid), ctx, phase_index=0)
            up = sim.runner.run(sim.algo, sim.envs, [job])[cid].upload
            d, _ = ClientDP.update(sim.algo, up, pay)
            norms.append(math.sqrt(sum(float(t.double().pow(2).sum()) for t in d.values())))
    print("round-1 update norms:", " ".join(f"{n:.3f}" for n in sorted(norms)))
    print(f"median {np.median(norms):.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
