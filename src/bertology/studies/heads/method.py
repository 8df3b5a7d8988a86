"""The base class of the methods that ask which heads matter, each method a class (as in Captum)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from bertology.core.learning.tasks import LanguageModel, TaskModel, collate_rows, length_batches, next_token_losses


class HeadMethod:
    """One method over a task model's heads: the model, its batch size, and a progress bar over the examples.

    The model is a classifier (:class:`~bertology.core.learning.tasks.TaskModel`), read out as its logits, or a decoder on a
    corpus (:class:`~bertology.core.learning.tasks.LanguageModel`), read out as each text's summed next-token cross-entropy."""

    def __init__(self, task_model: TaskModel | LanguageModel, *, batch_size: int, progress: bool = True):
        self.task_model, self.batch_size, self.progress = task_model, batch_size, progress

    @property
    def is_language_model(self) -> bool:
        return isinstance(self.task_model, LanguageModel)

    def batches(self, rows: list[dict], desc: str, batch_size: int | None = None) -> Iterator[list[int]]:
        """The indices of ``rows`` a batch at a time (batched by length), with a bar that counts the examples done."""
        with tqdm(total=len(rows), unit="ex", desc=desc, disable=not self.progress) as bar:
            for chunk in length_batches(rows, batch_size or self.batch_size):
                yield chunk
                bar.update(len(chunk))

    def model_inputs(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """``rows`` padded into the model's keyword inputs, ``attention_mask`` (1 on real pieces) among them; labels left out."""
        tm = self.task_model
        if self.is_language_model:
            input_ids, mask = tm.collate(rows)
            return {"input_ids": input_ids, "attention_mask": mask.long()}
        inputs = collate_rows(tm.tokenizer, rows, tm.device)
        inputs.pop("labels", None)
        return inputs

    def readout(self, inputs: dict[str, torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """What each row of a pass gives, ``[rows, R]`` float64: a classifier's logits, or a text's summed next-token
        cross-entropy (``R = 1``; :func:`~bertology.core.learning.tasks.next_token_losses`)."""
        if self.is_language_model:
            summed, _ = next_token_losses(logits, inputs["input_ids"], inputs["attention_mask"].bool())
            return summed.double()[:, None]
        return logits.double()
