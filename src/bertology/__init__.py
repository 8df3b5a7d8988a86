"""bertology: what every attention head of a BERT-like encoder does, and how sure we can be of it.

>>> import bertology
>>> result = bertology.analyze(corpus=["The cat sat on the mat."])  # doctest: +SKIP
>>> result.heads.head()  # doctest: +SKIP
"""

from bertology.api import Analysis, analyze
from bertology.core.corpora import Corpus, Example
from bertology.workflows.dynamics import Track, track
from bertology.core.engine import Batch, Engine
from bertology.core.errors import BertologyError, CorpusError, ModelError
from bertology.core.hooks import Hooks
from bertology.core.models import LoadedModel, load_model
from bertology.workflows.pretraining import pretrain
from bertology.viewer import AttentionView, attention_view

__version__ = "0.1.0"

__all__ = [
    "Analysis",
    "AttentionView",
    "Batch",
    "BertologyError",
    "Corpus",
    "CorpusError",
    "Engine",
    "Example",
    "Hooks",
    "LoadedModel",
    "ModelError",
    "Track",
    "analyze",
    "attention_view",
    "load_model",
    "pretrain",
    "track",
]
