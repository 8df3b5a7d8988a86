"""The Python API for notebooks and scripts: each study's function, from its room (:mod:`bertology.studies`).

``analyze`` runs every requested analysis family (:mod:`bertology.families`) over a corpus in one pass of the model;
the others run one study each and write its run folder as its command does.
"""

from __future__ import annotations

from bertology.studies.analyze.analysis import Analysis, analyze
from bertology.studies.compare.comparison import Comparison, compare
from bertology.studies.finetune.finetuning import finetune
from bertology.studies.gradients.gradients import attention_gradients
from bertology.studies.heads.study import study_heads
from bertology.studies.pretrain.pretraining import pretrain
from bertology.studies.restore.restore import restore_layers
from bertology.studies.track.dynamics import track
from bertology.studies.track.result import TrackResult
from bertology.studies.view.viewer import AttentionView, attention_view

__all__ = ["Analysis", "AttentionView", "Comparison", "TrackResult", "analyze", "attention_gradients", "attention_view", "compare", "finetune",
           "pretrain", "restore_layers", "study_heads", "track"]
