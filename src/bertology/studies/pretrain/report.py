"""The report page of a pre-training run: the loss curves and the checkpoints."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.storage.runfolder import RunFolder
from bertology.render.figures import log_step_axis, plt
from bertology.render.html import Figure, Report, Section
from bertology.studies.pretrain.objectives import Objective, objective_named


def pretraining_curve(losses: pd.DataFrame, checkpoints: pd.DataFrame, unigram: float, objective: Objective, window: int = 20):
    """The ``objective``'s LM loss against step (log axis): training (moving mean), validation at each checkpoint, and the unigram
    baseline; where it also predicts the next sentence (the masked LM), beside it the next-sentence loss and accuracy."""
    pairs = objective.predicts_next_sentence
    figure, axes = plt.subplots(1, 2 if pairs else 1, figsize=(11, 3.8) if pairs else (6, 3.8), squeeze=False)
    left = axes[0, 0]
    # the LM loss: loss.csv's first loss, checkpoints.csv's first validation score
    train_column, validation_column, name = objective.step_losses[0], f"val_{objective.scores[0]}", objective.loss_name
    smooth = losses.set_index("step").drop(columns="learning_rate").rolling(window, min_periods=1, center=True).mean()
    left.plot(smooth.index, smooth[train_column], color="tab:blue", label=f"training (centred mean of {window} steps)")
    left.plot(checkpoints.step.clip(lower=1), checkpoints[validation_column], "o-", color="tab:red",
              label="validation, at each checkpoint (step 0 drawn at 1)")
    left.axhline(unigram, color="black", linestyle="--", label=f"unigram cross-entropy {unigram:.2f}")
    left.set_ylabel(f"{name} (nats)")
    left.set_title(name)
    log_step_axis(left)
    if pairs:
        right = axes[0, 1]
        right.plot(smooth.index, smooth.nsp_loss, color="tab:blue", label="training loss")
        right.axhline(np.log(2), color="black", linestyle="--", label="chance (ln 2)")
        right.set_xscale("log")
        right.set_xlabel("training step (log; step 0 drawn at 1)")
        right.set_ylabel("next-sentence loss (nats)")
        accuracy = right.twinx()
        accuracy.plot(checkpoints.step.clip(lower=1), checkpoints.val_nsp_accuracy, "o-", color="tab:red", label="validation accuracy")
        accuracy.set_ylim(0, 1)
        accuracy.set_ylabel("validation accuracy")
        right.set_title("next-sentence prediction")
        right.grid(alpha=0.3)
        lines = right.get_legend_handles_labels()[0] + accuracy.get_legend_handles_labels()[0]
        right.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="lower left")
    figure.set_layout_engine("tight")  # laid out once, when drawn
    return figure


def _corpus_words(corpus: dict) -> str:
    """The report's words on the corpus of ``pretraining.json``: its documents, sentences and pieces, or the synthetic task."""
    if "synthetic" in corpus:
        return (f"synthetic {corpus['synthetic']}: {corpus['symbols']} symbols, periods {corpus['periods'][0]}-{corpus['periods'][1]}, "
                f"{corpus['repeat_share']:.0%} of each sequence repeats; {corpus['sequences_per_epoch']:,} fresh sequences an epoch")
    return f"{corpus['documents']} documents, {corpus['sentences']:,} sentences, {corpus['training_pieces']:,} training pieces"


def pretraining_report(folder: RunFolder, summary: dict, losses: pd.DataFrame, checkpoints: pd.DataFrame) -> str:
    """The loss curve and checkpoint table of a ``bertology pretrain`` run, as a self-contained page."""
    settings, objective = summary["settings"], objective_named(summary["objective"])
    name = objective.loss_name
    intro, final = objective.report_words(summary)
    on_training = summary["corpus"]["validated_on_training_text"]
    text = "training instances (the corpus is too small to hold text out, so it measures fit, not generalisation)" if on_training else "held-out text"
    section = Section(
        title="Pre-training",
        intro=intro + (f"The validation {name} is measured on {text}{' with fixed masks' if objective.masks else ''}; "
                       "the unigram cross-entropy is what guessing by piece frequency alone scores on the same pieces."),
    )
    curve = folder.write_figure("loss_curve", pretraining_curve(losses, checkpoints, summary["unigram_cross_entropy"], objective))
    section.figures.append(Figure(curve, "Loss against step (log axis); the dashed line is the unigram baseline."))
    section.tables.append(("Checkpoints (each a model folder under checkpoints/)", checkpoints))
    section.notes.append(final)
    report = Report(
        title="bertology: pre-training",
        summary={
            "model": f"{summary['model']['architecture']}, {settings['layers']} layers x {settings['heads']} heads, hidden {settings['hidden']}, "
                     f"{summary['model']['parameters']:,} parameters, vocabulary {summary['model']['vocab_size']}",
            "loss": summary["loss"],
            "corpus": _corpus_words(summary["corpus"]),
            "training": f"{summary['steps']} steps of {settings['batch_size']} x {settings['max_length']} pieces ({summary['epochs']} epochs)",
            "device": summary["device"],
            "time": f"{summary['seconds']} s",
        },
        sections=[section],
    )
    return report.render()
