"""The report page of ``bertology track``: head roles over checkpoints and the verdict on the learning-curve hypothesis."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.families.profile.analyzer import EXCESS_TOLERANCE
from bertology.render.figures import METRIC_TITLES, log_step_axis, plt
from bertology.render.html import Figure, Report, Section
from bertology.studies.track.phase_report import induction_section

#: The claim the report opens on, by the series' kind of model.
CLAIM_INTROS = {
    "encoder": ("Claim: heads pass through phases over depth and over pre-training: [CLS] (and broad) attention early, [SEP] and "
                "dependency relations in the middle, punctuation deep (docs/methods.md#track-and-the-learning-curve-verdict). "),
    "decoder": ("Claim (its decoder form, docs/methods.md#decoders): the first token, the candidate attention sink (Gu et al. 2025), "
                "takes [CLS]'s place and [SEP] has none; first-token attention peaks below punctuation and emerges before it. "),
}

#: How the report's verdicts are reached (docs/methods.md#track-and-the-learning-curve-verdict), after the claim.
VERDICT_RULES = (
    "Attention to a token set follows Clark et al. (2019); intervals come from a Poisson bootstrap over sequences, paired across "
    "checkpoints. Every pattern is measured against the uniform head on the same sequences: a depth order is judged only where each "
    f"pattern's peak layer does more than the uniform head (its excess and the lower end of the excess's 95% interval above "
    f"{EXCESS_TOLERANCE:g}), and a pattern emerges only when the 95% interval of its first-to-last change excludes 0, its excess over the "
    "uniform head rises and ends beyond that tolerance, and its half-rise step is located more narrowly than the run; otherwise there is "
    "no evidence, and no order is judged. Two patterns tie when they peak in the same layer (a layer within that tolerance of a peak's "
    "value counts as a peak) or emerge at the same step, or their intervals overlap. A claim is contradicted when a pair is reversed "
    "with intervals apart in at least 95% of the replicates, a tie when a pair ties, supported when the whole order holds in the data "
    "and in at least 95% of the replicates, and inconclusive otherwise."
)


def track_report(folder: RunFolder, track) -> str:
    """The verdict on the learning-curve hypothesis and the figures of a ``bertology track`` run (a
    :class:`~bertology.studies.track.result.TrackResult`)."""
    depth, training = track.verdict["depth"], track.verdict["training"]
    section = hypothesis_section(folder, track)
    report = Report(
        title="bertology: head roles over training",
        summary={
            "checkpoints": ", ".join("step unknown" if r.step is None else str(r.step) for r in track.results),
            "final checkpoint": track.results[-1].checkpoint,
            "corpus": f"{track.corpus['name']} ({track.corpus['examples']} examples)",
            "bootstrap replicates": track.settings["bootstrap"],
            "depth claim": depth["verdict"],
            "training claim": training["verdict"],
            **({"attention sinks": f"Sink_{track.verdict['sinks']['eps']:g} = {track.verdict['sinks']['overall'][-1]:.0%} of heads at the final checkpoint"}
               if "sinks" in track.verdict else {}),
            "started": track.started,
        },
        sections=[section, *([induction_section(folder, track)] if "induction" in track.verdict else [])],
    )
    return report.render()


def hypothesis_section(folder: RunFolder, track) -> Section:
    """The claim, the verdicts on it (depth, training, a decoder's attention sinks) with each checkpoint's loss, the final
    checkpoint's peaks and, over two or more checkpoints, the series' figures and tables (:func:`series_figures`)."""
    depth, training = track.verdict["depth"], track.verdict["training"]
    section = Section(title="The learning-curve hypothesis", intro=CLAIM_INTROS[track.kind.name] + VERDICT_RULES)
    section.notes.append(f"Depth ({depth['checkpoint']}): {depth['statement']}")
    section.notes.append(f"Training: {training['statement']}")
    if "sinks" in track.verdict:
        section.notes.append(f"Attention sinks: {track.verdict['sinks']['statement']}")
    if "losses" in track.verdict:
        section.notes.append(f"Loss: {track.verdict['losses']['statement']}")
        section.tables.append(("Each checkpoint's loss (losses.csv): recorded_loss, the validation loss recorded when it was saved (on its own "
                               "validation split; empty: none recorded); measured_loss, measured here on the track corpus with the checkpoint's "
                               "language-model head, over the sequences the track pass reads (NaN: the checkpoint has no language-model head)",
                               track.losses.drop(columns="checkpoint")))
    peaks = folder.write_figure("peak_layers", peak_layers_by_metric(depth["layer_means"], depth["peaks"]))
    section.figures.append(Figure(peaks, "Final checkpoint: the layer mean of each pattern; the star marks its peak, the bar its 95% bootstrap interval."))
    section.tables.append(("Where each pattern peaks, per checkpoint (peak_layers; interval: 2.5th-97.5th percentile of the replicates)",
                           track.peaks[["step", "metric", "peak_layer", "ci_low", "ci_high", "agreement"]]))
    if len(track.results) > 1:
        series_figures(folder, section, track)
    return section


def series_figures(folder: RunFolder, section: Section, track) -> None:
    """Add to ``section`` what a series of two or more checkpoints shows: attention per layer at each checkpoint, a decoder's
    Sink_eps, each pattern's strength and emergence, the per-head trajectories and, with trees, the best syntactic heads."""
    *others, last = (METRIC_TITLES[metric].removeprefix("attention to ") for metric in track.metrics)
    named = f"{', '.join(others)} and {last}"
    heatmaps = folder.write_figure("layer_by_step", layer_by_step_heatmaps(track.layers, track.metrics))
    section.figures.append(Figure(heatmaps, f"Attention to {named} per layer (rows) at each checkpoint (columns)."))
    if "sinks" in track.verdict:
        sinks = track.verdict["sinks"]
        section.figures.append(Figure(folder.write_figure("sinks_by_step", sinks_by_step(sinks)),
                                      f"Sink_{sinks['eps']:g}: the share of heads whose mean attention to the first token exceeds "
                                      f"{sinks['eps']:g} and the uniform head's, per layer and over all heads, at each checkpoint."))
    curves = folder.write_figure("emergence", emergence_curves(track.strength(), track.emergence))
    section.figures.append(Figure(curves, "Left: each pattern's strength (max over layers of the layer mean). Right: the patterns that emerge, "
                                          "as a share of their rise; dotted: where each crosses half."))
    section.tables.append(("When each pattern emerges (emergence.csv; change: final - first with its 95% interval; half_step with its "
                           "95% interval; located_low-located_high: the checkpoints that bracket the crossing in 95% of the replicates)",
                           track.emergence))
    section.tables.append(("Per-head trajectories: each head's attention to each token set at each checkpoint (track.csv)",
                           head_trajectories(track.table, track.metrics)))
    series = track.syntax_series()
    if series is not None:
        best = track.table[track.table.metric.str.startswith("syntax:")]
        largest = [m for m in dict.fromkeys(best.metric) if m != "syntax:all"][:6]  # rows come by number of dependents, most first
        section.figures.append(Figure(folder.write_figure("syntax_by_step", syntax_by_step(series, best, largest)),
                                      "Best syntactic head's accuracy: the mean over relations with at least --min-dependents dependents, "
                                      "and single relations."))


def head_trajectories(table: pd.DataFrame, metrics: tuple[str, ...]) -> pd.DataFrame:
    """``metric, layer, head`` (rows) x step (columns): each head's value of each of ``metrics`` at each checkpoint."""
    rows = table[table.metric.isin(metrics)]
    wide = rows.pivot_table(index=["metric", "layer", "head"], columns="step", values="value", aggfunc="first")
    wide.columns = [f"step {step}" for step in wide.columns]
    return wide.round(4).reset_index()


def layer_by_step_heatmaps(layers: pd.DataFrame, metrics: tuple[str, ...]):
    """One heatmap per metric: layer (rows) x checkpoint step (columns, in order), the layer mean."""
    figure, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 3.6), squeeze=False)
    for axis, metric in zip(axes[0], metrics):
        grid = layers[layers.metric == metric].pivot(index="layer", columns="step", values="value")
        image = axis.imshow(grid.values, aspect="auto", cmap="viridis", origin="lower")
        axis.set_xticks(range(grid.shape[1]), [str(s) for s in grid.columns], rotation=60, fontsize=7)
        axis.set_yticks(range(grid.shape[0]), grid.index)
        axis.set_xlabel("checkpoint (training step)")
        axis.set_ylabel("layer (0-based)")
        axis.set_title(METRIC_TITLES[metric])
        plt.colorbar(image, ax=axis, fraction=0.046, pad=0.04)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def sinks_by_step(sinks: dict):
    """A decoder's Sink_eps (``verdict["sinks"]``) over checkpoints: layer (rows) x checkpoint (columns), and over all heads against step."""
    figure, (grid, overall) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = ["?" if step is None else str(step) for step in sinks["steps"]]
    image = grid.imshow(np.array(sinks["by_layer"]).T, aspect="auto", cmap="viridis", origin="lower", vmin=0, vmax=1)
    grid.set_xticks(range(len(labels)), labels, rotation=60, fontsize=7)
    grid.set_yticks(range(len(sinks["by_layer"][0])))
    grid.set_xlabel("checkpoint (training step)")
    grid.set_ylabel("layer (0-based)")
    grid.set_title(f"Sink_{sinks['eps']:g} per layer")
    plt.colorbar(image, ax=grid, fraction=0.046, pad=0.04)
    overall.plot(np.clip(sinks["steps"], 1, None), sinks["overall"], "o-", color="black", label="all heads")
    overall.set_ylim(-0.02, 1.02)
    overall.set_ylabel(f"Sink_{sinks['eps']:g} (share of all heads)")
    overall.set_title("attention-sink heads over training")
    log_step_axis(overall)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def emergence_curves(strength: pd.DataFrame, emergence: pd.DataFrame):
    """Left: each pattern's strength against step. Right: the patterns that emerge, as a share of their rise, with the half-way crossings."""
    figure, (raw, scaled) = plt.subplots(1, 2, figsize=(12, 4.0))
    for k, (metric, rows) in enumerate(strength.groupby("metric", sort=False)):
        color, label = f"C{k}", METRIC_TITLES.get(metric, metric)
        x = rows.step.clip(lower=1)
        raw.plot(x, rows.value, "o-", color=color, label=label)
        first, final = rows.value.iloc[0], rows.value.iloc[-1]
        crossing = emergence[emergence.metric == metric].half_step.iloc[0]
        if final > first and emergence[emergence.metric == metric].emerges.iloc[0] == "yes":
            scaled.plot(x, (rows.value - first) / (final - first), "o-", color=color, label=f"{label} ({first:.3f} -> {final:.3f})")
            scaled.axvline(max(crossing, 1), color=color, linestyle=":", alpha=0.8)
    scaled.axhline(0.5, color="black", linestyle="--", linewidth=0.8, label="half of the rise")
    raw.set_ylabel("strength (max over layers of the layer mean)")
    raw.set_title("each pattern's strength")
    scaled.set_ylabel("share of the rise from the first checkpoint")
    scaled.set_title("patterns that emerge; dotted: where each crosses half")
    log_step_axis(raw)
    log_step_axis(scaled)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def syntax_by_step(series: pd.DataFrame, best: pd.DataFrame, relations: list[str]):
    """Best syntactic-head accuracy against step: the mean over relations with its bootstrap band, and the given relations' best heads."""
    figure, axis = plt.subplots(figsize=(7.5, 4.0))
    x = series.step.clip(lower=1)
    axis.fill_between(x, series.ci_low, series.ci_high, color="black", alpha=0.15)
    axis.plot(x, series.value, "o-", color="black", linewidth=2, label="mean over relations (95% bootstrap band)")
    for metric in relations:
        rows = best[best.metric == metric].sort_values("step")
        axis.plot(rows.step.clip(lower=1), rows.value, ".-", alpha=0.7, label=metric.removeprefix("syntax:"))
    axis.set_ylim(0, 1)
    axis.set_ylabel("accuracy of the best head")
    axis.set_title("best syntactic head per relation over training")
    log_step_axis(axis)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def peak_layers_by_metric(layer_means: dict, peaks: dict):
    """The final model's layer means of attention to [CLS], [SEP] and punctuation, peaks marked with their bootstrap interval."""
    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    for k, (metric, values) in enumerate(layer_means.items()):
        color = f"C{k}"
        axis.plot(range(len(values)), values, "o-", color=color, label=METRIC_TITLES[metric])
        peak = peaks[metric]
        axis.errorbar([peak["layer"]], [peak["value"]], xerr=[[peak["layer"] - peak["ci_low"]], [peak["ci_high"] - peak["layer"]]],
                      fmt="*", markersize=14, color=color, capsize=4)
    axis.set_xlabel("layer (0-based)")
    axis.set_ylabel("mean attention (layer mean over heads)")
    axis.set_title("where each pattern peaks (star: peak, bar: 95% bootstrap interval)")
    axis.set_xticks(range(len(next(iter(layer_means.values())))))
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure
