"""What a pre-training run does: its settings, saved with its training state (a resume must match) and digested into the
run's identity (:func:`~bertology.studies.pretrain.training.run_identity`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PretrainSettings:
    """What a pre-training run does (saved with its training state: a resume must match)."""

    corpus: list[str]
    vocab_size: int = 8000
    layers: int = 4
    heads: int = 8
    hidden: int = 256
    intermediate: int = 1024
    max_length: int = 128
    batch_size: int = 32
    steps: int = 1500
    learning_rate: float = 1e-3
    warmup: float = 0.06
    weight_decay: float = 0.01
    mask_probability: float = 0.15
    checkpoints: int = 12
    validation_share: float = 0.02
    seed: int = 0
    corpus_sha256: list[str] | None = None  # each corpus file's content: a resume never trains on an edited corpus
    objective: str = "masked-lm"  # a key of objectives.OBJECTIVES
    linear_checkpoints: bool = False  # checkpoints evenly spaced (checkpoint_steps), for a change in mid-run such as induction heads'
    synthetic: str | None = None  # a synthetic task made in memory instead of a corpus (symbols.SYNTHETIC_TASKS); vocab_size its symbols
    repeat_share: float | None = None  # --synthetic repeats: the share of each sequence's symbols that repeat its segment
    min_period: int | None = None  # --synthetic repeats: the segment's shortest period
    max_period: int | None = None  # and its longest
    attention_only: bool = False  # no MLP blocks (Olsson et al. 2022): objectives.attention_only_decoder
