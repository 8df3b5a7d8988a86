"""Analyzers: one class per analysis, all with the same ``update`` / ``merge`` / ``result`` verbs."""

from bertology.analyzers.base import Analyzer
from bertology.analyzers.profile import PROFILE_METRICS, GeneralProfile, HeadDistance, profile_metrics

__all__ = ["Analyzer", "GeneralProfile", "HeadDistance", "PROFILE_METRICS", "profile_metrics"]
