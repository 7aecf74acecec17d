"""Evaluation protocols: global accuracy and personalized accuracy (see docs/evaluation.md)."""

from pflkit.eval.evaluate import evaluate_round, evaluate_selected, summarize_clients

__all__ = ["evaluate_round", "evaluate_selected", "summarize_clients"]
