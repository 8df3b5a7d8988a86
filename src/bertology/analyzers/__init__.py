"""Analyzers: one class per analysis, all with the same ``update`` / ``merge`` / ``result`` verbs."""

from bertology.analyzers.base import Analyzer
from bertology.analyzers.profile import (
    CLARK_THRESHOLDS,
    PROFILE_METRICS,
    GeneralProfile,
    HeadDistance,
    LayerPeaks,
    PEAK_METRICS,
    clark_labels,
    profile_metrics,
)

__all__ = ["Analyzer", "CLARK_THRESHOLDS", "clark_labels", "GeneralProfile", "HeadDistance", "LayerPeaks", "PEAK_METRICS", "PROFILE_METRICS", "profile_metrics"]
