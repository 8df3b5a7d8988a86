"""The induction probe of ``track`` (METHODS.md section 15): on a decoder's checkpoints, beside the corpus, sequences of random
whole-word pieces in which a segment repeats to the end at a random period and offset
(:func:`~bertology.core.text.synthetic.induction_probe`), so that only content, not position, tells where a repeat's next
piece is. The phase-change verdict (:mod:`~bertology.studies.track.phase`) reads its scores, never the corpus's.

At each checkpoint (:func:`probe_checkpoint`, kept as :class:`ProbeResult`):

- every head's induction (prefix-matching) score and previous-token score with their excess over the uniform head, in
  paired Poisson bootstrap replicates (:class:`~bertology.studies.track.induction.InductionReplicates`), and each period's
  mean induction score and excess (a head that copies by position scores at one period alone);
- the in-context learning score on the probe (:func:`~bertology.studies.track.induction.in_context_scores`, its late token
  the probe's last, inside the repeat);
- the attention maps of every head on the probe's first sequence, which the report draws before and after the window
  (:class:`SequenceMaps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from transformers import AutoConfig

from bertology.core.analyzer import LayerwiseAnalyzer
from bertology.core.engine import Batch, Engine, LayerMaps
from bertology.core.errors import BertologyError
from bertology.core.model.kinds import kind_of
from bertology.core.model.models import LoadedModel, load_tokenizer, loading_errors, model_source
from bertology.core.text.synthetic import PROBE_LENGTH, induction_probe
from bertology.families.headtypes.analyzer import INDUCTION, PREVIOUS
from bertology.families.kinds import check_kind, check_same_kind
from bertology.studies.track.induction import InductionReplicates, in_context_scores

#: The induction probe's sequences by default (``--induction-probe``).
PROBE_SEQUENCES = 100
#: The shortest probe sequence: room for periods of 2 to 7 (:func:`~bertology.core.text.synthetic.probe_periods`).
MIN_PROBE_LENGTH = 20


def probe_length(max_length: int | None, positions: int, special: int) -> int:
    """The probe's length: :data:`~bertology.core.text.synthetic.PROBE_LENGTH` pieces, or fewer where the run reads fewer
    (``max_length``) or the model has fewer ``positions``, with the ``special`` tokens its tokenizer adds (Llama's BOS)."""
    return min(PROBE_LENGTH, positions - special, (max_length or positions) - special)


def series_probe(checkpoint: str, count: int, max_length: int | None, seed: int, trust_remote_code: bool = False) -> tuple[list, int] | None:
    """The induction probe of a series whose first checkpoint is ``checkpoint``: ``count`` sequences drawn with ``seed`` from
    its vocabulary (:func:`~bertology.core.text.synthetic.induction_probe`), of :func:`probe_length` pieces, and that length;
    None for an encoder's series (no induction heads). Read from its config and tokenizer (no weights), once for the series."""
    source = model_source(checkpoint)
    with loading_errors(source):
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    if kind_of(config).sees_later_keys:
        return None
    tokenizer = load_tokenizer(source, trust_remote_code=trust_remote_code)
    limits = [x for x in (getattr(config, "max_position_embeddings", None), tokenizer.model_max_length) if x is not None and x < 100_000]
    length = probe_length(max_length, min(limits, default=PROBE_LENGTH), tokenizer.num_special_tokens_to_add(pair=False))
    if length < MIN_PROBE_LENGTH:
        raise BertologyError(f"the induction probe needs sequences of at least {MIN_PROBE_LENGTH} pieces and {checkpoint} reads {length} with "
                             "those its tokenizer adds: give a larger --max-length")
    return induction_probe(tokenizer, count, length, seed), length


class SequenceMaps(LayerwiseAnalyzer):
    """Every head's attention map ``[layer, head, n, n]`` (float32, on the host) of the one sequence whose ``source`` is
    ``source``; the maps of no other sequence are kept."""

    name = "sequence_maps"

    def __init__(self, kind, source: str):
        self.kind, self.source = kind, source
        self.maps: np.ndarray | None = None
        self._layers: list[np.ndarray] = []

    def update_layer(self, batch: Batch, maps: LayerMaps) -> None:
        if maps.layer == 0:
            check_kind(self, batch)
            self._layers = []
        found = [b for b, example in enumerate(batch.examples) if example.source == self.source]
        if found:
            n = int(batch.host_lengths[found[0]])
            self._layers.append(maps.attention[found[0], :, :n, :n].float().cpu().numpy())

    def finish_batch(self, batch: Batch) -> None:
        if self._layers:
            self.maps, self._layers = np.stack(self._layers), []

    def merge(self, other: "SequenceMaps") -> "SequenceMaps":
        check_same_kind(self, other)
        self.maps = self.maps if self.maps is not None else other.maps
        return self

    def result(self) -> pd.DataFrame:
        return pd.DataFrame({"source": [self.source], "kept": [self.maps is not None]})


@dataclass
class ProbeResult:
    """One checkpoint's measurements on the induction probe (see the module docstring)."""

    induction: np.ndarray  # [1 + B, layer, head]: induction (prefix-matching) score
    induction_excess: np.ndarray  # the same, less the uniform head's on the same sequences
    previous: np.ndarray  # [1 + B, layer, head]: previous-token score
    previous_excess: np.ndarray
    periods: np.ndarray  # [P] int: the periods the probe drew, in order
    period_scores: np.ndarray  # [P, layer, head]: the mean induction score over the sequences of each period (the data)
    period_excess: np.ndarray  # [P, layer, head]: their excess over the uniform head
    icl: np.ndarray | None  # [1 + B]: the in-context learning score on the probe; None: no language-model head
    icl_positions: tuple[int, int] | None  # (early, late): its 1-based tokens
    sequences: int  # the probe's sequences
    maps: np.ndarray  # [layer, head, n, n]: every head's attention map on the probe's first sequence
    second_copy: int  # where that sequence's second copy begins among the pieces the model reads


def probe_checkpoint(engine: Engine, loaded: LoadedModel, examples: list, settings: dict, with_lm_head: bool, progress: bool,
                     desc: str) -> ProbeResult:
    """One checkpoint's :class:`ProbeResult` on the probe ``examples`` (its sequences all of one length), in one pass of
    ``engine`` and, with a language-model head, one more for the in-context learning score."""
    bootstrap, seed = settings["bootstrap"], settings["seed"]
    scores = InductionReplicates(loaded.kind, bootstrap=bootstrap, seed=seed, roles=(INDUCTION, PREVIOUS))
    first = SequenceMaps(loaded.kind, examples[0].source)
    engine.run(examples, [scores, first], total=len(examples), desc=f"{desc} probe")
    layers, heads = loaded.num_layers, loaded.num_heads
    periods, period_scores, period_excess, _ = scores.period_means()
    icl, positions = None, None
    if with_lm_head:
        length = settings["probe_length"] + loaded.tokenizer.num_special_tokens_to_add(pair=False)  # the pieces each probe sequence is read as
        icl, _, early, late = in_context_scores(engine, examples, seed, bootstrap, progress, f"{desc} probe in-context", length=length)
        positions = (early, late)
    return ProbeResult(scores.replicate_means(layers, heads, INDUCTION), scores.replicate_excess(layers, heads, INDUCTION),
                       scores.replicate_means(layers, heads, PREVIOUS), scores.replicate_excess(layers, heads, PREVIOUS),
                       periods, period_scores, period_excess, icl, positions, scores.sequences, first.maps,
                       examples[0].second_copy + int(loaded.adds_bos))
