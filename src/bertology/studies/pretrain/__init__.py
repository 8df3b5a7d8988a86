"""``bertology pretrain``: pre-train a small BERT, or with ``--causal`` a small GPT-2-style decoder, from scratch with
log-spaced checkpoints (:func:`~bertology.studies.pretrain.pretraining.pretrain`), the series ``bertology track`` follows."""

from __future__ import annotations

from pathlib import Path

from bertology.core.options import MODEL, RUN, Option, pick
from bertology.studies import Study, register_study


class Pretrain(Study):
    name = "pretrain"
    libraries = ("bertology.studies.pretrain.pretraining", "transformers.modeling_utils")
    title = ("Pre-train a small BERT (masked LM + next sentence), or with --causal a GPT-2-style decoder (causal LM), from scratch "
             "with log-spaced checkpoints; rerun to resume.")
    options = (
        Option("corpus", None, "Text files, or folders of .txt files (one document per file; blank lines end paragraphs); none with --synthetic.",
               type=Path, argument=True, multiple=True),
        RUN[0].but(default=Path("runs/pretrain"), help="Run folder: checkpoints/step-NNNNNN model folders, loss curve, report."),
        Option("causal", False, "A GPT-2-style decoder trained with the causal LM loss (next-token cross-entropy) on a byte-level BPE "
                                "vocabulary, instead of a BERT (the first token is the candidate attention sink that `track` follows)."),
        Option("vocab_size", None, "Vocabulary size (WordPiece; byte-level BPE with --causal; the symbols of --synthetic) [default: 8000; 64 "
                                   "symbols with --synthetic].", type=int, minimum=2),
        Option("synthetic", None, "Instead of a corpus, a synthetic task made in memory (with --causal): 'repeats', sequences of random symbols in "
                                  "which a random segment repeats at a random period and offset, so that only content predicts a repeat "
                                  "(induction heads form on it, Olsson et al. 2022).", type=str),
        Option("repeat_share", None, "With --synthetic repeats: the share of each sequence's symbols that repeat its segment [default: 0.5].",
               type=float),
        Option("min_period", None, "With --synthetic repeats: the segment's shortest length (its period) [default: 6].", type=int, minimum=1),
        Option("max_period", None, "With --synthetic repeats: its longest [default: 24].", type=int, minimum=1),
        Option("attention_only", False, "With --causal: no MLP blocks, as Olsson et al.'s small models (a Llama whose MLPs are of size 0, "
                                        "adding exactly 0)."),
        Option("layers", 4, "Transformer layers.", minimum=1),
        Option("heads", 8, "Attention heads per layer.", minimum=1),
        Option("hidden", 256, "Hidden size.", minimum=8),
        Option("max_length", 128, "Pieces per instance (and the model's position limit).", minimum=16),
        Option("batch_size", 32, "Instances per batch.", minimum=1),
        Option("steps", 1500, "Training steps.", minimum=1),
        Option("learning_rate", 1e-3, "Peak learning rate of AdamW."),
        Option("checkpoints", 12, "Checkpoints saved, log-spaced, step 0 included.", minimum=2),
        Option("linear_checkpoints", False, "Space the checkpoints evenly from step 0 to the last, not log-spaced: dense through the "
                                            "middle of the run, where a phase change such as the induction heads' falls."),
        *pick(RUN, "seed", "quiet"),
        *pick(MODEL, "device"),
    )
    outputs = ("loss", "checkpoints")
    work = "training"

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.studies.pretrain.objectives import CAUSAL_LM, MASKED_LM
        from bertology.studies.pretrain.pretraining import pretrain

        s = settings
        return pretrain(s["corpus"] or None, s["out"], objective=(CAUSAL_LM if s["causal"] else MASKED_LM).name, vocab_size=s["vocab_size"],
                        layers=s["layers"], heads=s["heads"], hidden=s["hidden"], max_length=s["max_length"], batch_size=s["batch_size"],
                        steps=s["steps"], learning_rate=s["learning_rate"], checkpoints=s["checkpoints"],
                        linear_checkpoints=s["linear_checkpoints"], synthetic=s["synthetic"], attention_only=s["attention_only"],
                        **{key: s[key] for key in ("repeat_share", "min_period", "max_period") if s[key] is not None},
                        seed=s["seed"], device=s["device"], progress=not s["quiet"], command=command)

    def summary(self, summary: dict, settings: dict) -> list[str]:
        from bertology.studies.pretrain.objectives import objective_named

        out = Path(settings["out"])
        scores = objective_named(summary["objective"]).score_words(summary)
        warnings = (["warning: the corpus is too small to hold text out, so the validation scores are measured on training text and say nothing "
                     "of generalisation"] if summary["corpus"]["validated_on_training_text"] else [])
        return [f"{summary['steps']} steps in {summary['seconds']:.0f} s: {scores}", *warnings,
                f"checkpoints: {(out / 'checkpoints').resolve()}", f"report: {(out / 'report.html').resolve()}"]


register_study(Pretrain())
