"""Workflows that train or intervene: fine-tuning, pre-training, tracking checkpoints, comparing models, head importance and interventions."""
