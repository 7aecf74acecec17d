"""Analyses of a config's federated setting that are not training runs (``pflkit analyze``)."""

from pflkit.analysis.privacy import privacy_study
from pflkit.analysis.similarity import similarity_study

__all__ = ["privacy_study", "similarity_study"]
