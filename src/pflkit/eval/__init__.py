"""Evaluation protocols: global accuracy and personalized accuracy (see docs/guide.md)."""

from pflkit.eval.evaluate import (
    global_metrics,
    global_val_metrics,
    personal_metrics,
    summarize_clients,
    val_metrics,
)

__all__ = [
    "global_metrics",
    "global_val_metrics",
    "personal_metrics",
    "summarize_clients",
    "val_metrics",
]
