"""Report pages of training dynamics: the pre-training run, and head roles tracked over checkpoints."""

from __future__ import annotations

import pandas as pd

from bertology.reports import figures
from bertology.reports.html import Figure, Report, Section
from bertology.core.runfolder import RunFolder


def pretraining_report(folder: RunFolder, summary: dict, losses: pd.DataFrame, checkpoints: pd.DataFrame) -> str:
    """The loss curve and checkpoint table of a ``bertology pretrain`` run, as a self-contained page."""
    settings = summary["settings"]
    section = Section(
        title="Pre-training",
        intro=(
            "Masked-language modelling plus next-sentence prediction from scratch (Devlin et al. 2019). The validation loss is measured "
            "on held-out text with fixed masks; the unigram cross-entropy is what guessing by piece frequency alone scores on the same masked pieces."
        ),
    )
    curve = folder.write_figure("loss_curve", figures.pretraining_curve(losses, checkpoints, summary["unigram_cross_entropy"]))
    section.figures.append(Figure(curve, "Loss against step (log axis); the dashed line is the unigram baseline."))
    section.tables.append(("Checkpoints (each a model folder under checkpoints/)", checkpoints))
    section.notes.append(
        f"Final validation masked-LM loss {summary['val_mlm_loss']:.3f} nats against {summary['unigram_cross_entropy']:.3f} for unigram guessing; "
        f"next-sentence accuracy {summary['val_nsp_accuracy']:.3f} (chance 0.5)."
    )
    report = Report(
        title="bertology: pre-training",
        summary={
            "model": f"BERT, {settings['layers']} layers x {settings['heads']} heads, hidden {settings['hidden']}, "
                     f"{summary['model']['parameters']:,} parameters, vocabulary {summary['model']['vocab_size']}",
            "corpus": f"{summary['corpus']['documents']} documents, {summary['corpus']['sentences']:,} sentences, "
                      f"{summary['corpus']['training_pieces']:,} training pieces",
            "training": f"{summary['steps']} steps of {settings['batch_size']} x {settings['max_length']} pieces ({summary['epochs']} epochs)",
            "device": summary["device"],
            "time": f"{summary['seconds']} s",
        },
        sections=[section],
    )
    return report.render()


def track_report(folder: RunFolder, track) -> str:
    """The verdict on the learning-curve hypothesis and the figures of a ``bertology track`` run."""
    depth, training = track.verdict["depth"], track.verdict["training"]
    section = Section(
        title="The learning-curve hypothesis",
        intro=(
            "Claim: heads pass through phases over depth and over pre-training: [CLS] (and broad) attention early, [SEP] and dependency "
            "relations in the middle, punctuation deep (docs/methods.md#track-and-the-learning-curve-verdict). Attention to a token set follows Clark et al. (2019); "
            "intervals come from a Poisson bootstrap over sequences, paired across checkpoints. A claim is supported when its order "
            "holds in the data and in at least 95% of the replicates, contradicted when it holds in at most 5%."
        ),
    )
    section.notes.append(f"Depth ({depth['checkpoint']}): {depth['statement']}")
    section.notes.append(f"Training: {training['statement']}")
    peaks = folder.write_figure("peak_layers", figures.peak_layers_by_metric(depth["layer_means"], depth["peaks"]))
    section.figures.append(Figure(peaks, "Final checkpoint: the layer mean of each pattern; the star marks its peak, the bar its 95% bootstrap interval."))
    section.tables.append(("Where each pattern peaks, per checkpoint (peak_layers; interval: 2.5th-97.5th percentile of the replicates)",
                           track.peaks[["step", "metric", "peak_layer", "ci_low", "ci_high", "agreement"]]))
    if len(track.results) > 1:
        heatmaps = folder.write_figure("layer_by_step", figures.layer_by_step_heatmaps(track.layers))
        section.figures.append(Figure(heatmaps, "Attention to [CLS], [SEP] and punctuation per layer (rows) at each checkpoint (columns)."))
        curves = folder.write_figure("emergence", figures.emergence_curves(track.strength(), track.emergence))
        section.figures.append(Figure(curves, "Left: each pattern's strength (max over layers of the layer mean). Right: the patterns that rise, as a share of their rise; dotted: where each crosses half."))
        section.tables.append(("When each pattern emerges (emergence.csv)", track.emergence))
        series = track.syntax_series()
        if series is not None:
            best = track.table[track.table.metric.str.startswith("syntax:")]
            largest = [m for m in dict.fromkeys(best.metric) if m != "syntax:all"][:6]  # rows come by number of dependents, most first
            section.figures.append(Figure(folder.write_figure("syntax_by_step", figures.syntax_by_step(series, best, largest)),
                                          "Best syntactic head's accuracy: the mean over relations with at least --min-dependents dependents, and single relations."))
    report = Report(
        title="bertology: head roles over training",
        summary={
            "checkpoints": ", ".join("step unknown" if r.step is None else str(r.step) for r in track.results),
            "final checkpoint": track.results[-1].checkpoint,
            "corpus": f"{track.corpus['name']} ({track.corpus['examples']} examples)",
            "bootstrap replicates": track.settings["bootstrap"],
            "depth claim": depth["verdict"],
            "training claim": training["verdict"],
            "started": track.started,
        },
        sections=[section],
    )
    return report.render()
