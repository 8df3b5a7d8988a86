"""Training: the tasks a model is scored and fine-tuned on, and the training loops' shared parts.

:mod:`.tasks` holds the tasks, :mod:`.training` the resumable training states.
"""
