"""Breaks of the vectorised engine (engine.vectorize, engine/vectorized.py), filed under the
algorithms whose tests catch them: a client's update landing on another client's stacked
parameters, the step mask, the replayed RNG stream, the per-client BatchNorm statistics, the
functional optimisers and the padded evaluation."""

from mutate import Break

V = "tests/test_vectorized.py"
FEDAVG = (
    f"{V}::test_one_step_equals_the_per_client_path[fedavg]",
    f"{V}::test_two_rounds_equal_the_per_client_path[fedavg]",
)
DITTO = (f"{V}::test_two_rounds_equal_the_per_client_path[ditto]",)
BN = (f"{V}::test_adam_batchnorm_augmentation_and_stragglers",)
OPT = (f"{V}::test_functional_optimiser_equals_torchs_with_a_step_mask",)
F = "engine/vectorized.py"

BREAKS = [
    Break(
        "fedavg",
        "vectorised: a client's update applied to another client's stacked parameters",
        F,
        "            tree[k] = v\n",
        "            tree[k] = v.roll(1, 0)\n",
        FEDAVG,
    ),
    Break(
        "fedavg",
        "vectorised: a run of rows written back reversed (a short last batch's run: clients swap)",
        F,
        "            tree[k][rows] = v\n",
        "            tree[k][rows] = v.flip(0)\n",
        FEDAVG,
    ),
    Break(
        "fedavg",
        "vectorised: the step mask drops a client one step early (its last batch untrained)",
        F,
        "        now = sum(c > s for c in counts)",
        "        now = sum(c > s + 1 for c in counts)",
        (*FEDAVG, *BN),
    ),
    Break(
        "fedavg",
        "vectorised: a client's trained rows not kept when the stack shrinks (its start returned)",
        F,
        "            finish(now, active)\n",
        "",
        (*FEDAVG, *BN),
    ),
    Break(
        "fedavg",
        "vectorised: the padding of a short client's evaluation chunk is counted",
        F,
        "((logits.argmax(-1) == y) & valid)",
        "(logits.argmax(-1) == y)",
        FEDAVG,
    ),
    Break(
        "fedavg",
        "vectorised: BatchNorm statistics not kept per client (the step's update dropped)",
        F,
        "            _put(buffers, rows, new_buffers)\n",
        "",
        BN,
    ),
    Break(
        "fedavg",
        "vectorised: Adam without the second moment's bias correction",
        F,
        "        bc2_sqrt = (1 - b2**t) ** 0.5\n",
        "        bc2_sqrt = 1.0\n",
        (*OPT, *BN),
    ),
    Break(
        "ditto",
        "vectorised: a replayed training call leaves torch's RNG where the update started",
        F,
        "            torch.set_rng_state(d.rng)\n",
        "",
        DITTO,
    ),
]
