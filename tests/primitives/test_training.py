"""pflkit.primitives.training: gradient hooks and parameter groups."""

from __future__ import annotations

import pytest
import torch

from pflkit.engine import Simulation
from pflkit.primitives.training import get_weights, predict


def test_gradient_hooks_compose_in_order_by_value():
    """One SGD step on loss = 0.5 * w^2 from w = 3 (gradient 3), lr 0.1, by hand: clipping to
    norm 1 gives 1; shifting by 0.5 after it gives 1.5; a proximal pull to 2 with mu 0.4 adds
    0.4 * (3 - 2) = 0.4. Hooks run in the order given."""
    from pflkit.primitives.training import clip_grad, local_sgd, proximal_pull, shift_grad

    def run(hooks):
        w = torch.nn.Parameter(torch.tensor([3.0]))
        model = torch.nn.Module()
        model.w = w
        loss = lambda m, x, y: 0.5 * (m.w**2).sum()  # noqa: E731
        local_sgd(model, torch.zeros(1, 1), torch.zeros(1), epochs=1, batch_size=1, lr=0.1,
                  loss_fn=loss, grad_hooks=hooks(w))  # fmt: skip
        return w.item()

    assert run(lambda w: []) == pytest.approx(3 - 0.1 * 3)
    assert run(lambda w: [clip_grad(1.0)]) == pytest.approx(3 - 0.1 * 1)
    shift = torch.tensor([0.5])
    assert run(lambda w: [clip_grad(1.0), shift_grad([(w, shift)])]) == pytest.approx(3 - 0.15)
    assert run(lambda w: [shift_grad([(w, shift)]), clip_grad(1.0)]) == pytest.approx(3 - 0.1)
    anchor = torch.tensor([2.0])
    assert run(lambda w: [proximal_pull([(w, anchor)], 0.4)]) == pytest.approx(3 - 0.1 * 3.4)


def test_parameter_groups_are_named_by_the_model(tiny):
    from pflkit.primitives.training import group

    model = Simulation(tiny()).senv.model()
    weights = get_weights(model)
    body, head = group(model, weights, "body"), group(model, weights, "head")
    assert body.keys() | head.keys() == weights.keys() and not body.keys() & head.keys()
    assert head.keys() == {"head.weight", "head.bias"}
    assert [p.shape for p in model.group_params("head")] == [weights["head.weight"].shape,
                                                            weights["head.bias"].shape]  # fmt: skip
    with pytest.raises(ValueError, match="unknown parameter group 'neck'"):
        model.group_keys("neck")


def test_predict_runs_full_batches_and_keeps_each_row_once():
    """10 samples in batches of 4: windows [0, 4), [4, 8) and the last 4 samples [6, 10), of
    which rows 8 and 9 are kept; a split no larger than a batch is one call."""
    seen = []

    class Record(torch.nn.Module):
        def forward(self, x):
            seen.append(x[:, 0].tolist())
            return x * 2

    x = torch.arange(10.0).unsqueeze(1)
    assert torch.equal(predict(Record(), x, 4), x * 2)
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [6, 7, 8, 9]]
    seen.clear()
    assert torch.equal(predict(Record(), x, 12), x * 2) and seen == [list(range(10))]
    seen.clear()
    assert torch.equal(predict(Record(), x[:8], 4), x[:8] * 2)  # no remainder: no overlap
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7]]
