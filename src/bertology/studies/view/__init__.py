"""``bertology view``: an interactive attention viewer (head view and model view) as one self-contained HTML page.

The page is :mod:`~bertology.studies.view.viewer`'s; ``bertology analyze`` links one from its report.
"""

from __future__ import annotations

from pathlib import Path

from bertology.core.options import CORPUS, MODEL, Option, pick
from bertology.studies import Study, register_study


class View(Study):
    name = "view"
    libraries = ("bertology.studies.view.viewer", "transformers.modeling_utils")
    title = "Write an interactive attention viewer (head view and model view) as one self-contained HTML page."
    options = (
        Option("text", None, "The text to look at.", type=str, argument=True, required=True),
        Option("pair", None, "A second text (sentence B; an encoder's sentence pair, refused on a decoder).", type=str),
        *pick(MODEL, "model"),
        Option("out", Path("view.html"), "The page to write.", flag="--out -o"),
        Option("run", None, "A run folder whose roles and patterns label the heads.", type=Path),
        Option("contributions", None, "Also ALTI's and value zeroing's per-head maps in the view menu: alti, value-zeroing or both, "
               "comma-separated (value zeroing reruns each layer once per token and head).", type=str),
        Option("top_k", None, "Keep each row's K largest weights (0: all); by default all up to 128 tokens, else 20, fewer where the maps "
               "would pass the page's 16 MiB.", type=int, minimum=0),
        Option("layers", None, "The layers (0-based, comma-separated) whose maps the page holds; by default as many from layer 0 as "
               "the page's budget of map cells allows (a layer past it names this option).", type=str),
        *pick(CORPUS, "max_length"), *pick(MODEL, "device", "trust_remote_code", "dtype", "device_map"),
    )
    writes = "file"
    report = False

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.core.errors import BertologyError
        from bertology.core.measures.contributions import parse_measures
        from bertology.core.model.kinds import DECODER
        from bertology.core.model.models import load_model
        from bertology.core.storage.runfolder import check_file_out
        from bertology.studies.view.viewer import PAGE_MARK, attention_view

        s = settings
        check_file_out(s["out"], made_by=PAGE_MARK)
        contributions = tuple(measure.replace("_", "-") for measure in parse_measures(s["contributions"]))  # the views' names
        loaded = load_model(s["model"], device=s["device"], trust_remote_code=s["trust_remote_code"], dtype=s["dtype"], device_map=s["device_map"])
        if s["pair"] is not None and loaded.kind is DECODER:
            raise BertologyError(f"--pair does not apply to {loaded.name}, a decoder: it has no sentence-pair structure (no segment ids, no "
                                 "separator between sentence A and B); give both sentences in the one text")
        layers = None
        if s["layers"] is not None:
            try:
                layers = [int(part) for part in s["layers"].split(",")]
            except ValueError:
                raise BertologyError(f"--layers {s['layers']}: give layer numbers from 0, comma-separated (3,5)") from None
        return attention_view(s["text"], s["pair"], model=loaded, run=s["run"], top_k=s["top_k"], max_length=s["max_length"],
                              contributions=contributions, layers=layers).save(s["out"])

    def summary(self, page: Path, settings: dict) -> list[str]:
        return [f"viewer: {page.resolve()} ({page.stat().st_size / 1024:.0f} KiB)"]


register_study(View())
