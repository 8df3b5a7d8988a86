"""Training: the tasks a model is scored and fine-tuned on (:mod:`.tasks`) and the training loops' shared parts (:mod:`.training`)."""
