"""A small language model for next-token prediction (task ``next_token``,
:mod:`pflkit.eval.tasks`): ``gru_lm``.

::

    body: Embedding(vocab, embed) -> GRU(embed, hidden, 1 layer, batch_first)   [B, L, hidden]
    head: Linear(hidden, vocab) at every position, class dimension moved to 1   [B, vocab, L]

Input: ``[B, L]`` token ids (float32 exact integers, as the text sources store them; checked and
cast to int64 as ``fasttext`` does). The GRU reads left to right, so the output at position t
depends on tokens 0..t only: a causal model, whose logits at t predict token t + 1. The
logits put the vocabulary at dimension 1, so ``F.cross_entropy(logits, y)`` with ``y`` ``[B, L]``
is the mean token cross-entropy, the loss of local training. ``num_classes`` is the vocabulary
size (the source's). ``feature_dim`` = ``hidden``, but the features are one vector per position
(``[B, L, hidden]``), so algorithms that read per-sample features (prototypes, feature
alignment) do not apply; FedAvg, Local, FedPer (the head is private) and their kin do.
PyTorch's default initialisation.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from pflkit.errors import PflkitError
from pflkit.models.base import PFLModel, check_num_classes, check_shape, positive_int
from pflkit.models.text import token_ids


class TokenGRU(nn.Module):
    """Embedding then a one-layer GRU: ``[B, L]`` ids -> ``[B, L, hidden]``."""

    def __init__(self, vocab_size: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.gru(self.embedding(token_ids(x, self.embedding.num_embeddings, "gru_lm")))
        return out


class TokenHead(nn.Module):
    """A linear layer at every position, the vocabulary moved to dimension 1."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, vocab_size)

    def forward(self, h: Tensor) -> Tensor:
        return self.linear(h).movedim(-1, 1)


def gru_lm(
    input_shape: Sequence[int], num_classes: int, embed: int = 64, hidden: int = 128
) -> PFLModel:
    """The GRU language model (module docstring); ``num_classes``: the vocabulary size."""
    name = "gru_lm"
    shape = check_shape(name, input_shape)
    check_num_classes(name, num_classes)
    if len(shape) != 1:
        raise PflkitError(
            f"model '{name}' needs token sequences [L] (e.g. dataset python_docs), got shape "
            f"{shape}: pick a model that fits the dataset"
        )
    embed = positive_int(name, "embed", embed)
    hidden = positive_int(name, "hidden", hidden)
    return PFLModel(
        TokenGRU(num_classes, embed, hidden),
        TokenHead(hidden, num_classes),
        hidden,
        name=name,
        input_shape=shape,
        num_classes=num_classes,
    )
