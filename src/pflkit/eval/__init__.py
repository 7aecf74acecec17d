"""Evaluation protocols: global accuracy and personalized accuracy (see docs/guide.md)."""

from pflkit.eval.evaluate import global_metrics, personal_metrics, summarize_clients

__all__ = ["global_metrics", "personal_metrics", "summarize_clients"]
