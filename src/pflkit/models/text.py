"""Models for GPFL's text tasks (Zhang et al., ICCV 2023; specs/gpfl.md §4.3): fastText for AG
News and KD3A's AmazonMLP for Amazon Review.

**fasttext** (GPFL repo ``system/flcore/trainmodel/models.py``, class ``fastText``, built in
``main.py`` with ``hidden_dim = 32`` and ``vocab_size = 98635``)::

    body: Embedding(vocab_size, hidden, padding_idx=0) -> mean over all max_len positions
          (padding included) -> Linear(hidden, hidden)          (no activation)
    head: Linear(hidden, num_classes)

The mean divides by ``max_len`` whatever the text length: padding positions (id 0) add the
padding row, which starts at zero and gets no gradient, so it stays zero. ``feature_dim`` =
``hidden``. Input: the ``ag_news`` source's ``[B, max_len]`` token ids, stored float32 like every
source (exact integers); the model casts them to int64 and raises a :class:`PflkitError` when a
value is not an integer in ``[0, vocab_size)``, which costs one host-device synchronisation per
batch on a GPU. ``vocab_size`` must cover the data's vocabulary: the default 98,635 is GPFL's;
``data.options.max_vocab`` with the same number guarantees the fit. Init: PyTorch's defaults
(Embedding N(0, 1), Linear uniform), as in the GPFL code.

``variant: pfllib`` builds PFLlib's ``fastText`` (``system/flcore/trainmodel/models.py``) as
PFLlib's GPFL splits it (``fc`` replaced by Identity): the body ends with ``log_softmax`` over the
hidden units, so the features are log-probabilities, and PFLlib sets ``hidden`` to ``-fd``
(default 512; set ``hidden: 512``). PFLlib's final ``log_softmax`` on the logits is left out: it
changes neither cross-entropy, softmax nor argmax.

**amazon_mlp** (KD3A ``model/amazon.py`` ``AmazonMLP``, copied into the GPFL and PFLlib repos;
GPFL's "3-layer MLP")::

    body: Linear(5000, 1000), ReLU, Linear(1000, 500), ReLU, Linear(500, 100), ReLU
    head: Linear(100, num_classes)

``feature_dim`` = 100; PyTorch default init. The input width is the flattened input size (5,000
for ``amazon_review``); KD3A hard-codes 5,000 and 2 classes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from pflkit.errors import PflkitError
from pflkit.models.base import (
    PFLModel,
    check_num_classes,
    check_shape,
    option_error,
    positive_int,
)
from pflkit.models.mlp import mlp

GPFL_VOCAB_SIZE = 98_635  # GPFL repo main.py (AG News, PFLlib's 2023 vocabulary)
GPFL_HIDDEN = 32  # GPFL repo main.py hidden_dim
VARIANTS = ("gpfl", "pfllib")


class TokenMean(nn.Module):
    """Embedding of ``[B, L]`` token ids, averaged over all ``L`` positions -> ``[B, dim]``."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim, padding_idx=0)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.embedding(token_ids(x, self.embedding.num_embeddings)).mean(1)
        return out


def token_ids(x: Tensor, vocab_size: int, model: str = "fasttext") -> Tensor:
    """``x`` as int64 ids after checking every value is an integer in ``[0, vocab_size)``
    (``model``: the model the error sentences name)."""
    if x.numel():
        lo, hi = torch.aminmax(x.detach())
        stats = [lo, hi]
        if x.is_floating_point():
            stats.append((x.detach() != torch.floor(x.detach())).any().to(lo.dtype))
        lo_v, hi_v, *frac = torch.stack(stats).tolist()  # one synchronisation
        if lo_v < 0 or (frac and frac[0]):
            raise PflkitError(
                f"model '{model}' takes token ids (integers >= 0) but got values from {lo_v:g} "
                f"to {hi_v:g}: use it with a text dataset such as ag_news"
            )
        if hi_v >= vocab_size:
            raise PflkitError(
                f"model '{model}' got token id {hi_v:.0f} but has vocab_size {vocab_size}: set "
                f"model.options.vocab_size to the dataset's vocabulary size, or cap the "
                f"vocabulary with data.options.max_vocab: {vocab_size}"
            )
    return x.long()


def fasttext(
    input_shape: Sequence[int],
    num_classes: int,
    vocab_size: int = GPFL_VOCAB_SIZE,
    hidden: int = GPFL_HIDDEN,
    variant: str = "gpfl",
) -> PFLModel:
    """GPFL's fastText: token-mean embedding -> Linear(hidden, hidden) -> linear head (module
    doc); ``variant="pfllib"`` adds PFLlib's log_softmax at the end of the body."""
    name = "fasttext"
    shape = check_shape(name, input_shape)
    check_num_classes(name, num_classes)
    if len(shape) != 1:
        raise PflkitError(
            f"model '{name}' needs token-id input [max_len] (e.g. dataset ag_news), got shape "
            f"{shape}: pick a model that fits the dataset"
        )
    vocab_size = positive_int(name, "vocab_size", vocab_size)
    if vocab_size < 2:
        raise option_error(name, "vocab_size", vocab_size, "at least 2 (padding + one token)")
    hidden = positive_int(name, "hidden", hidden)
    if variant not in VARIANTS:
        raise option_error(name, "variant", variant, f"one of {', '.join(VARIANTS)}")
    layers: list[nn.Module] = [TokenMean(vocab_size, hidden), nn.Linear(hidden, hidden)]
    if variant == "pfllib":
        layers.append(nn.LogSoftmax(dim=1))
    return PFLModel(
        nn.Sequential(*layers),
        nn.Linear(hidden, num_classes),
        hidden,
        name=name,
        input_shape=shape,
        num_classes=num_classes,
    )


def amazon_mlp(input_shape: Sequence[int], num_classes: int) -> PFLModel:
    """KD3A's AmazonMLP: flatten -> 1000 -> 500 -> 100 (ReLU each) -> linear head: the generic
    :func:`~pflkit.models.mlp.mlp` with those widths, under its own name."""
    check_num_classes("amazon_mlp", num_classes)  # errors name this model, not 'mlp'
    model = mlp(check_shape("amazon_mlp", input_shape), num_classes, hidden=(1000, 500, 100))
    model.name = "amazon_mlp"
    return model
