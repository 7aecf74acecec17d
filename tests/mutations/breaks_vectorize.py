"""Breaks of the vectorised engine (engine.vectorize, engine/vectorized.py), filed under the
algorithms whose tests catch them: a client's update landing on another client's stacked
parameters, the step mask, the replayed RNG stream, the per-client BatchNorm statistics, the
functional optimisers and the padded evaluation."""

from mutate import Break

V = "tests/test_vectorized.py"
FEDAVG = (
    f"{V}::test_one_step_equals_the_per_client_path[fedavg]",
    f"{V}::test_two_rounds_equal_the_per_client_path[fedavg-stacked]",
)
DITTO = (f"{V}::test_two_rounds_equal_the_per_client_path[ditto-stacked]",)
BN = (f"{V}::test_adam_batchnorm_augmentation_and_stragglers[stacked]",)
OPT = (f"{V}::test_functional_optimiser_equals_torchs_with_a_step_mask",)
# engine.cuda_graphs' masked steps (train_graphed), run uncaptured on CPU
GRAPHED = (
    f"{V}::test_two_rounds_equal_the_per_client_path[fedavg-graphed]",
    f"{V}::test_adam_batchnorm_augmentation_and_stragglers[graphed]",
    f"{V}::test_graphed_batchnorm_rows_of_done_clients_keep_their_statistics",
    f"{V}::test_graphed_steps_take_the_fewest_rows_a_power_of_two_allows",
)
# what a CUDA capture would refuse or replay wrongly, checked on CPU
REPLAY = (
    f"{V}::test_graphed_steps_could_be_captured_and_replayed[sgd]",
    f"{V}::test_graphed_steps_could_be_captured_and_replayed[adam_bn]",
)
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
        "        return sum(n > s for n in self.counts)",
        "        return sum(n > s + 1 for n in self.counts)",
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
        "        _put(self.buffers, rows, buffers, self.static, mask)\n",
        "",
        (*BN, *GRAPHED),
    ),
    Break(
        "fedavg",
        "vectorised: Adam without the second moment's bias correction",
        F,
        "        return self.lr / (1 - b1**t), (1 - b2**t) ** 0.5\n",
        "        return self.lr / (1 - b1**t), 1.0\n",
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
    Break(
        "fedavg",
        "graphed: the step mask dropped from the parameters' write (done clients train on)",
        F,
        "_put(self.train, rows, self.opt.step(train, grads, rows, bias, mask), self.static, mask)",
        "_put(self.train, rows, self.opt.step(train, grads, rows, bias, mask), self.static, None)",
        GRAPHED,
    ),
    Break(
        "fedavg",
        "graphed: the step mask dropped from the BatchNorm statistics' write",
        F,
        "        _put(self.buffers, rows, buffers, self.static, mask)\n",
        "        _put(self.buffers, rows, buffers, self.static, None)\n",
        GRAPHED,
    ),
    Break(
        "fedavg",
        "graphed: a done client's stand-in loss summed into its training loss",
        F,
        "        self.total[rows] += loss if mask is None else loss * mask\n",
        "        self.total[rows] += loss\n",
        GRAPHED,
    ),
    Break(
        "fedavg",
        "graphed: client i's batches fed to client i + 1 (the index table's rows shifted)",
        F,
        "        index[:k, i] = first[:, None] + offs\n",
        "        index[:k, (i + 1) % n] = first[:, None] + offs\n",
        GRAPHED,
    ),
    Break(
        "fedavg",
        "graphed: a step with a short batch run as a masked full-batch step (padding trained)",
        F,
        "        if all(c.sizes[i][s] == full for i in range(active)):\n",
        "        if True:\n",
        GRAPHED,
    ),
    Break(
        "fedavg",
        "graphed: the step number the graph reads not advanced (step 0's batch every time)",
        F,
        "            now.fill_(s)\n",
        "            now.fill_(0)\n",
        GRAPHED,
    ),
    Break(
        "fedavg",
        "graphed: fewer rows stepped than clients still training (the power of two too small)",
        F,
        "            m = min(n, 1 << (active - 1).bit_length())\n",
        "            m = min(n, 1 << (active - 1).bit_length()) - (active > 2)\n",
        GRAPHED,
    ),
    Break(
        "fedavg",
        "graphed: Adam's bias corrections of step 1 at every masked step",
        F,
        "            b = biases.index_select(0, now)[0]\n",
        "            b = biases[0]\n",
        GRAPHED,
    ),
    Break(
        "fedavg",
        "graphed: the step's Adam biases picked on the host (int(now): a sync no capture allows)",
        F,
        "            b = biases.index_select(0, now)[0]\n",
        "            b = biases[int(now)]\n",
        REPLAY,
    ),
    Break(
        "fedavg",
        "graphed: the step number a new tensor each step (a replay reads the first step's)",
        F,
        "            now.fill_(s)\n",
        "            now = torch.full((1,), s, device=c.device)\n",
        REPLAY,
    ),
    Break(
        "fedavg",
        "graphed: the stack's tensors rebound, not written in place (a replay reads the old ones)",
        F,
        "        if not static and rows.start == 0 and rows.stop == len(tree[k]):\n",
        "        if rows.start == 0 and rows.stop == len(tree[k]):\n",
        REPLAY,
    ),
    Break(
        "fedavg",
        "graphed: the loss sums not put back after the capture's warm-up (the warm-up steps' losses counted)",
        F,
        "        return [*self.train.values(), *self.buffers.values(), *self.opt.tensors(), self.total]\n",
        "        return [*self.train.values(), *self.buffers.values(), *self.opt.tensors()]\n",
        REPLAY,
    ),
    Break(
        "fedavg",
        "graphed: the optimiser's moments not put back after the capture's warm-up",
        F,
        "        return [*self.train.values(), *self.buffers.values(), *self.opt.tensors(), self.total]\n",
        "        return [*self.train.values(), *self.buffers.values(), self.total]\n",
        REPLAY,
    ),
]
