"""Analyses of a config's federated setting that are not training runs (``pflkit analyze``)."""

from pflkit.analysis.similarity import similarity_study

__all__ = ["similarity_study"]
