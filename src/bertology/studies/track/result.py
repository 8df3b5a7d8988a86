"""What ``track`` keeps: each checkpoint's measurements (:class:`CheckpointResult`, saved as a part as soon as it exists,
:mod:`~bertology.studies.track.parts`) and the series' tables, verdict and run folder (:class:`TrackResult`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from bertology.core.model.kinds import Kind
from bertology.core.storage.runfolder import RunFolder, claims_out, complete_run
from bertology.studies.track.peaks import peak_layers, peak_metrics
from bertology.studies.track.phase import probe_heads
from bertology.studies.track.probe import ProbeResult
from bertology.studies.track.verdicts import interval, json_value

TRACK_COLUMNS = ["step", "checkpoint", "layer", "head", "metric", "value", "ci_low", "ci_high"]
TRACK_LAYER_COLUMNS = ["step", "checkpoint", "layer", "metric", "value", "ci_low", "ci_high"]


@dataclass
class CheckpointResult:
    """What :func:`~bertology.studies.track.dynamics.track` keeps of one checkpoint (each is saved as soon as it is computed)."""

    step: int | None  # None: a single checkpoint whose step is unknown (an empty cell in the tables)
    checkpoint: str
    rows: pd.DataFrame  # TRACK_COLUMNS
    layers: pd.DataFrame  # step, checkpoint, layer, metric, value, ci_low, ci_high
    means: np.ndarray  # [1 + B, layer, metric] of `metrics`
    excess: np.ndarray  # [1 + B, layer, metric]: the means' excess over the uniform head on the same sequences (LayerPeaks)
    syntax: np.ndarray | None  # [1 + B]: mean over relations of the best head's accuracy
    kind: Kind  # the checkpoint's kind of model
    measured_loss: float = float("nan")  # its loss on the track corpus (measured_loss); NaN: no language-model head
    measured_loss_name: str | None = None  # what that loss is; None where none is measured
    induction: np.ndarray | None = None  # a decoder's [1 + B, layer, head]: each head's induction score (InductionReplicates)
    induction_excess: np.ndarray | None = None  # the same, less the uniform head's on the same sequences
    icl: np.ndarray | None = None  # a decoder's [1 + B]: the in-context learning score (in_context_scores); None: no LM head
    icl_sequences: int = 0  # the sequences long enough for it
    icl_positions: tuple[int, int] | None = None  # (early, late): the 1-based tokens it compares
    loss_replicates: np.ndarray | None = None  # [1 + B]: measured_loss under the paired bootstrap weights; None: no LM head
    probe: ProbeResult | None = None  # a decoder's measurements on the induction probe (probe.probe_checkpoint)

    @property
    def metrics(self) -> tuple[str, ...]:
        """The token sets of ``means`` (:func:`peak_metrics`): an encoder's ([CLS], [SEP], punctuation) or a decoder's (the
        first token, punctuation)."""
        return peak_metrics(self.kind)


@dataclass
class TrackResult:
    """The result of :func:`~bertology.studies.track.dynamics.track`: tidy tables over checkpoints and the verdict on the hypothesis.

    ``table``: ``step, checkpoint, layer, head, metric, value, ci_low, ci_high`` (profile metrics
    per head; ``role:<role>`` mean sieve scores; ``syntax:<relation>`` for the best head of each
    relation). ``layers``: profile metrics per layer, and a decoder's ``sink_eps`` (the layer's Sink_eps, no interval).
    ``peaks``: where [CLS]/[SEP]/punctuation (a decoder's first token and punctuation) peak at each checkpoint.
    ``emergence``: claim 2's table (None for one checkpoint). ``losses``: each checkpoint's recorded and measured loss.
    """

    results: list[CheckpointResult]
    corpus: dict
    settings: dict
    verdict: dict
    emergence: pd.DataFrame | None
    started: str
    warnings: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int | None]:
        return [r.step for r in self.results]

    @property
    def kind(self) -> Kind:
        """The series' kind of model (every checkpoint is of one kind)."""
        return self.results[0].kind

    @property
    def metrics(self) -> tuple[str, ...]:
        """The token sets whose peaks and emergence the claims order (:attr:`CheckpointResult.metrics`)."""
        return self.results[0].metrics

    @property
    def table(self) -> pd.DataFrame:
        return pd.concat([r.rows for r in self.results], ignore_index=True)

    @property
    def layers(self) -> pd.DataFrame:
        return pd.concat([r.layers for r in self.results], ignore_index=True)

    @property
    def peaks(self) -> pd.DataFrame:
        return pd.concat([peak_layers(r.means, r.metrics).assign(step=r.step, checkpoint=r.checkpoint) for r in self.results], ignore_index=True)

    @property
    def losses(self) -> pd.DataFrame:
        """``step, checkpoint, recorded_loss, recorded_loss_name, measured_loss, measured_loss_name``: the validation loss each
        checkpoint recorded when it was saved (:func:`~bertology.studies.track.losses.checkpoint_loss`) and its loss measured on the
        track corpus (:func:`~bertology.studies.track.losses.measured_loss`); NaN (and no name) where none."""
        losses = self.verdict["losses"]
        return pd.DataFrame({"step": self.steps, "checkpoint": [r.checkpoint for r in self.results],
                             "recorded_loss": [np.nan if v is None else v for v in losses["values"]], "recorded_loss_name": losses["names"],
                             "measured_loss": [r.measured_loss for r in self.results], "measured_loss_name": [r.measured_loss_name for r in self.results]})

    @property
    def induction(self) -> pd.DataFrame | None:
        """A decoder's ``step, checkpoint, layer, head, value, ci_low, ci_high``: each head's induction score (the mean over
        sequences, :class:`~bertology.studies.track.induction.InductionReplicates`) and the 2.5th-97.5th percentiles of its
        bootstrap replicates; None for an encoder's series."""
        if any(r.induction is None for r in self.results):
            return None
        frames = []
        for r in self.results:
            with warnings.catch_warnings():  # a head with no score in any replicate (no repeated token) has no interval: NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                low, high = np.nanpercentile(r.induction[1:], [2.5, 97.5], axis=0) if len(r.induction) > 1 else (r.induction[0] * np.nan,) * 2
            layer, head = np.indices(r.induction.shape[1:])
            frames.append(pd.DataFrame({"step": r.step, "checkpoint": r.checkpoint, "layer": layer.ravel(), "head": head.ravel(),
                                        "value": r.induction[0].ravel(), "ci_low": np.ravel(low), "ci_high": np.ravel(high)}))
        return pd.concat(frames, ignore_index=True)

    @property
    def in_context(self) -> pd.DataFrame | None:
        """A decoder's ``step, checkpoint, early, late, value, ci_low, ci_high, n``: the in-context learning score (the loss of the
        ``late``-th token less the ``early``-th's, :func:`~bertology.studies.track.induction.in_context_scores`) over the ``n``
        sequences long enough, with its bootstrap interval; None where a checkpoint has no language-model head or for an encoder."""
        if any(r.icl is None for r in self.results):
            return None
        rows = []
        for r in self.results:
            low, high = interval(r.icl[1:])
            rows.append((r.step, r.checkpoint, *r.icl_positions, json_value(r.icl[0]), low, high, r.icl_sequences))
        return pd.DataFrame(rows, columns=["step", "checkpoint", "early", "late", "value", "ci_low", "ci_high", "n"]).astype({"value": float})

    @property
    def induction_probe(self) -> pd.DataFrame | None:
        """A decoder's heads on the induction probe at each checkpoint, named by the phase-change rules
        (:func:`~bertology.studies.track.phase.probe_heads` at the settings' ``head_type_mass``); None for an encoder's series."""
        if any(r.probe is None for r in self.results):
            return None
        return pd.concat([probe_heads(r.step, r.probe, self.settings["head_type_mass"]) for r in self.results], ignore_index=True)

    def syntax_series(self) -> pd.DataFrame | None:
        """``step, value, ci_low, ci_high``: mean over relations of the best head's accuracy, with its bootstrap interval."""
        if any(r.syntax is None for r in self.results):
            return None
        rows = [(r.step, r.syntax[0], *np.nanpercentile(r.syntax[1:], [2.5, 97.5])) for r in self.results]
        return pd.DataFrame(rows, columns=["step", "value", "ci_low", "ci_high"])

    def strength(self) -> pd.DataFrame:
        """``step, metric, value``: each pattern's strength (max over layers of the layer mean; syntax: the mean best-head accuracy)."""
        rows = [(r.step, metric, float(r.means[0, :, k].max())) for r in self.results for k, metric in enumerate(r.metrics)]
        rows += [(r.step, "syntax", float(r.syntax[0])) for r in self.results if r.syntax is not None]
        return pd.DataFrame(rows, columns=["step", "metric", "value"])

    @claims_out(work="parts")
    def save(self, out: str | Path, command: list[str] | None = None) -> Path:
        """Write ``track.csv``/``.parquet``, ``track_layers``, ``peaks``, ``emergence``, ``losses``, ``verdict.json``, figures,
        ``report.html`` (replacing ``out`` whole, its saved ``parts/`` kept)."""
        from bertology.studies.track.report import track_report  # matplotlib: imported when a run is saved, not with the API

        folder = RunFolder(out)
        folder.write_table("track", self.table)
        folder.write_table("track_layers", self.layers)
        folder.write_table("peaks", self.peaks)
        if self.emergence is not None:
            folder.write_table("emergence", self.emergence)
        folder.write_table("losses", self.losses)
        for name, table in (("induction", self.induction), ("in_context", self.in_context), ("induction_probe", self.induction_probe)):
            if table is not None:
                folder.write_table(name, table)
        folder.write_json("verdict.json", self.verdict)
        manifest = {"kind": self.kind.name, "corpus": self.corpus, "settings": self.settings,
                    "checkpoints": [{"step": r.step, "checkpoint": r.checkpoint} for r in self.results], "started": self.started,
                    "warnings": self.warnings}
        return complete_run(folder, manifest, report=track_report(folder, self), command=command, keep=("parts",)) / "report.html"
