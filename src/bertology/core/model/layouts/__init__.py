"""Where each architecture keeps its attention parts: one layout per family of architectures, found by model type.

A :class:`~bertology.core.model.layouts.base.Layout` is found by ``config.model_type`` (:func:`layout_of`). Every
module of this package is imported here, and a :class:`Layout` subclass that names its model types registers
itself, so adding an architecture is one file (and its tiny model in tests/core/model/test_layouts.py, the contract every
layout passes). A model whose type no layout serves still loads: only what needs its blocks (norms, mixing, ALTI, value
zeroing, ablation's layer replay) is refused in one line.
"""

from __future__ import annotations

import importlib
import pkgutil

from bertology.core.model.layouts.base import LAYOUTS, AttentionBlock, HeadParts, Layout

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["LAYOUTS", "AttentionBlock", "HeadParts", "Layout", "layout_of"]


def layout_of(config) -> Layout | None:
    """The layout that serves ``config.model_type`` (a model's config), or None where none does."""
    return LAYOUTS.get(config.model_type)
