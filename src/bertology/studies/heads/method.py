"""The shared part of the methods that ask which heads matter (Captum's one method a class, shared parts in a base)."""

from __future__ import annotations

from collections.abc import Iterator

from tqdm.auto import tqdm

from bertology.core.learning.tasks import LanguageModel, TaskModel, length_batches


class HeadMethod:
    """One method over a task model's heads: the model, its batch size, and a progress bar over the examples."""

    def __init__(self, task_model: TaskModel | LanguageModel, *, batch_size: int, progress: bool = True):
        self.task_model, self.batch_size, self.progress = task_model, batch_size, progress

    def batches(self, rows: list[dict], desc: str) -> Iterator[list[int]]:
        """The indices of ``rows`` a batch at a time (batched by length), with a bar that counts the examples done."""
        with tqdm(total=len(rows), unit="ex", desc=desc, disable=not self.progress) as bar:
            for chunk in length_batches(rows, self.batch_size):
                yield chunk
                bar.update(len(chunk))
