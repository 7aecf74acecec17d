"""Evaluation protocols: global accuracy and personalized accuracy (see docs/guide.md)."""

from pflkit.eval.evaluate import (
    global_metrics,
    personal_accuracies,
    personal_metrics,
    personal_model,
    selected_accuracy,
    summarize_clients,
)

__all__ = [
    "global_metrics",
    "personal_accuracies",
    "personal_metrics",
    "personal_model",
    "selected_accuracy",
    "summarize_clients",
]
