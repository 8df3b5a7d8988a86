"""The report page of a pre-training run: the loss curves and the checkpoints."""

from __future__ import annotations

import numpy as np
import pandas as pd

from bertology.core.runfolder import RunFolder
from bertology.render.figures import log_step_axis, plt
from bertology.render.html import Figure, Report, Section


def pretraining_curve(losses: pd.DataFrame, checkpoints: pd.DataFrame, unigram: float, window: int = 20):
    """Masked-LM loss against step (log axis): training (moving mean), validation at each checkpoint, and the unigram baseline."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    smooth = losses.set_index("step")[["mlm_loss", "nsp_loss"]].rolling(window, min_periods=1, center=True).mean()
    left.plot(smooth.index, smooth.mlm_loss, color="tab:blue", label=f"training (centred mean of {window} steps)")
    left.plot(checkpoints.step.clip(lower=1), checkpoints.val_mlm_loss, "o-", color="tab:red", label="validation, at each checkpoint (step 0 drawn at 1)")
    left.axhline(unigram, color="black", linestyle="--", label=f"unigram cross-entropy {unigram:.2f}")
    left.set_ylabel("masked-LM loss (nats)")
    left.set_title("masked-language-model loss")
    log_step_axis(left)
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
    curve = folder.write_figure("loss_curve", pretraining_curve(losses, checkpoints, summary["unigram_cross_entropy"]))
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
