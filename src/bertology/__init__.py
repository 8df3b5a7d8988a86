"""bertology: what every attention head of a transformer does, and how sure we can be of it.

Any Hugging Face encoder (BERT and its kin) or decoder (GPT-2, GPT-NeoX, Llama and its kin), streamed over any corpus:
what each head attends to, against a uniform head on the same sequences; which heads matter, by ablation, patching and
gradient importance, each with an interval and a correction; and how that changes with fine-tuning and pre-training.

>>> import bertology
>>> result = bertology.analyze(corpus=["The cat sat on the mat."])  # doctest: +SKIP
>>> result.table("heads").head()  # doctest: +SKIP

The names below are imported when first used (PEP 562), so that ``import bertology`` and
``bertology --help`` do not pay for torch and transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "Analysis": "bertology.api",
    "analyze": "bertology.api",
    "AttentionView": "bertology.studies.view.viewer",
    "attention_view": "bertology.studies.view.viewer",
    "Batch": "bertology.core.engine",
    "Engine": "bertology.core.engine",
    "BertologyError": "bertology.core.errors",
    "CorpusError": "bertology.core.errors",
    "ModelError": "bertology.core.errors",
    "Corpus": "bertology.core.text.corpora",
    "Example": "bertology.core.text.corpora",
    "Hooks": "bertology.core.model.hooks",
    "LoadedModel": "bertology.core.model.models",
    "load_model": "bertology.core.model.models",
    "Family": "bertology.families",
    "FamilyResult": "bertology.families",
    "Option": "bertology.families",
    "register_family": "bertology.families",
    "Study": "bertology.studies",
    "register_study": "bertology.studies",
    "TrackResult": "bertology.studies.track.result",
    "track": "bertology.studies.track.dynamics",
    "pretrain": "bertology.studies.pretrain.pretraining",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'bertology' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
