"""``bertology info``: a model's facts (architecture, layers, heads, special tokens, maximum length) as JSON."""

from __future__ import annotations

import json

from bertology.core.options import MODEL
from bertology.studies import Study, register_study


class Info(Study):
    name = "info"
    libraries = ("bertology.core.model.models", "transformers.modeling_utils")
    title = "Print the model's facts: architecture, layers, heads, special tokens, maximum length."
    options = MODEL
    writes = "nothing"
    report = False

    def run(self, settings: dict, command: list[str] | None = None) -> dict:
        from bertology.core.model.models import load_model

        return load_model(settings["model"], device=settings["device"], trust_remote_code=settings["trust_remote_code"], dtype=settings["dtype"],
                          device_map=settings["device_map"]).info()

    def summary(self, info: dict, settings: dict) -> list[str]:
        return [json.dumps(info, indent=2)]


register_study(Info())
