"""Analyses behind ``pflkit analyze``: of a config's federated setting (similarity, privacy:
they train what they need) and of a finished run (features)."""

from pflkit.analysis.features import feature_map
from pflkit.analysis.privacy import privacy_study
from pflkit.analysis.similarity import similarity_study

__all__ = ["feature_map", "privacy_study", "similarity_study"]
