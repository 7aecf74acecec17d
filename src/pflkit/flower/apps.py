"""The Flower app components, as a Flower app's pyproject names them::

    [tool.flwr.app.components]
    serverapp = "pflkit.flower.apps:serverapp"
    clientapp = "pflkit.flower.apps:clientapp"

Run config keys (``[tool.flwr.app.config]``, or ``flwr run --run-config``):

- ``config``: the pflkit experiment config, as YAML text (``pflkit flower`` fills it in);
- ``out``: the run folder to write, on the SuperLink's machine;
- ``node-wait``: seconds to wait for SuperNodes covering every client (default 60);
- ``round-timeout``: seconds to wait for a round's replies before counting a client as
  failed (0: no limit);
- ``secagg``: 1 sums the uploads with Flower's SecAgg+ (:mod:`pflkit.flower.secagg`), with
  ``secagg-clip`` (every summed entry in [-clip, clip]) and ``secagg-quantization`` (the
  integer range it is mapped onto).
"""

from __future__ import annotations

import json
import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from pflkit.errors import PflkitError
from pflkit.flower.client import app as clientapp

# the ServerApp's imports (torch, the engine) wait for main(): a ClientApp process, which
# starts for every message, loads this module too

log = logging.getLogger("pflkit.flower")
serverapp = ServerApp()


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    from pflkit.config_io import config_text
    from pflkit.engine.runner import run_experiment
    from pflkit.engine.runners import RUNNERS
    from pflkit.experiment import validate
    from pflkit.flower import server  # noqa: F401 (registers engine.runner: flower)
    from pflkit.flower.secagg import SecAggOptions

    rc = context.run_config
    try:
        cfg = validate(config_text(str(rc["config"]), "the run config's 'config'"))
        runner = RUNNERS["flower"].factory(
            cfg,
            grid,
            node_wait=float(rc.get("node-wait", 60)),
            round_timeout=float(rc.get("round-timeout", 0)) or None,
            log=log.warning,
            secagg=SecAggOptions.from_run_config(rc),
        )
        result = run_experiment(cfg, out=str(rc["out"]), progress=False, runner=runner)
    except PflkitError as e:
        log.error("error: %s", e)
        raise SystemExit(2) from None
    log.warning("pflkit: run folder %s: %s", result.run_dir, json.dumps(result.summary))


__all__ = ["clientapp", "serverapp"]
