"""``bertology finetune``: fine-tune an encoder on a GLUE-style task into a model folder every command accepts.

:func:`~bertology.studies.finetune.finetuning.finetune` does the work; its result is given to ``--model``.
"""

from __future__ import annotations

from pathlib import Path

from bertology.core.options import MODEL, RUN, TASK, Option, pick
from bertology.studies import Study, model_label, read_task, register_study


class Finetune(Study):
    name = "finetune"
    libraries = ("bertology.studies.finetune.finetuning", "transformers.modeling_utils")
    title = "Fine-tune an encoder on a GLUE-style task; the result is a model folder every command accepts as --model."
    options = (
        *TASK,
        *pick(MODEL, "model"),
        RUN[0].but(help="Model folder to write [default: runs/finetune-MODEL-TASK]."),
        Option("max_length", 128, "Most pieces per example.", minimum=8),
        Option("batch_size", 32, "Examples per batch.", minimum=1),
        Option("epochs", 1.0, "Passes over the training set.", minimum=0.01),
        Option("learning_rate", 5e-5, "Peak learning rate of AdamW."),
        Option("warmup", 0.1, "Share of steps for linear warm-up.", minimum=0.0, maximum=1.0),
        Option("max_train_examples", None, "Train on a seeded random subset of this size.", type=int, minimum=1),
        Option("checkpoint_every", 200, "Steps between checkpoints (rerun the same command to resume).", minimum=1),
        *pick(RUN, "seed", "quiet"),
        *pick(MODEL, "device", "trust_remote_code"),
    )
    report = False
    work = "checkpoint"

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.studies.finetune.finetuning import finetune

        s = settings
        data = read_task(s, work="checkpoint")  # its own checkpoint in out resumes
        s["out"] = s["out"] or Path("runs") / f"finetune-{model_label(s['model'])}-{data.name}"
        metrics = finetune(data, s["out"], model=s["model"], max_length=s["max_length"], batch_size=s["batch_size"], epochs=s["epochs"],
                           learning_rate=s["learning_rate"], warmup=s["warmup"], max_train_examples=s["max_train_examples"], seed=s["seed"],
                           device=s["device"], checkpoint_every=s["checkpoint_every"], trust_remote_code=s["trust_remote_code"],
                           progress=not s["quiet"], command=command)
        return data.name, metrics

    def summary(self, result, settings: dict) -> list[str]:
        task, metrics = result
        scores = ", ".join(f"{k} {v:.4f}" for k, v in metrics["metric"].items())
        baseline = ", ".join(f"{k} {v:.4f}" for k, v in metrics["majority_baseline"].items())
        return [f"{task} dev: {scores} (majority baseline: {baseline}); {metrics['train_examples']} training examples in {metrics['seconds']:.0f} s",
                f"model: {Path(settings['out']).resolve()}"]


register_study(Finetune())
