"""``bertology label``: a local page to label attention maps with Kovaleva et al.'s five pattern classes.

The page is served on 127.0.0.1 only (:mod:`~bertology.studies.label.labelling`); the labels train the patterns family's
classifier.
"""

from __future__ import annotations

from pathlib import Path

from bertology.core.errors import BertologyError
from bertology.core.options import CORPUS, MODEL, RUN, Option, pick
from bertology.studies import Study, register_study


class Label(Study):
    name = "label"
    libraries = ("bertology.core.model.models", "transformers.modeling_utils")
    title = "A local page (127.0.0.1 only) to label attention maps with Kovaleva et al.'s five classes; keys 1-5, saved as you go."
    options = (
        Option("labels", None, "The JSON-lines file the labels are appended to (reopened, it continues where it stopped).", type=Path,
               flag="--labels -l", required=True),
        CORPUS[0].but(help="Inputs to draw maps from [default: the bundled sample corpus]."),
        *pick(CORPUS, "format"), *pick(MODEL, "model"),
        Option("maps", 100, "Maps to label, spread evenly over the layers.", minimum=1),
        Option("classifier", None, "A trained pattern classifier: show the maps it is least sure of.", type=Path),
        Option("limit", 500, "Draw from the first N inputs.", minimum=1),
        Option("max_length", 128, "Most pieces per input.", minimum=8),
        *pick(RUN, "seed"), *pick(MODEL, "device", "trust_remote_code", "dtype", "device_map"),
        Option("browser", True, "Open the page in the default browser.", flag="--open/--no-open"),
    )
    writes = "file"
    report = False

    def run(self, settings: dict, command: list[str] | None = None):
        from bertology.core.model.models import load_model
        from bertology.core.storage.runfolder import check_file_out
        from bertology.core.text.corpora import open_corpus
        from bertology.families.patterns.trained import TrainedClassifier
        from bertology.studies.label.labelling import LabelServer, choose_maps, saved_labels

        s = settings
        labels = s["labels"]
        if labels.exists() and not labels.is_file():
            raise BertologyError(f"{labels}: is not a file")
        if not labels.exists():
            check_file_out(labels)
        saved_labels(labels)  # a file that is not ours is refused before the model loads
        trained = TrainedClassifier.load(s["classifier"]) if s["classifier"] is not None else None
        examples, _ = open_corpus(s["corpus"], s["format"], s["limit"])
        loaded = load_model(s["model"], device=s["device"], trust_remote_code=s["trust_remote_code"], dtype=s["dtype"], device_map=s["device_map"])
        queue = choose_maps(loaded, list(examples), s["maps"], seed=s["seed"], classifier=trained, max_length=s["max_length"])
        server = LabelServer(queue, labels, loaded.name).start()
        print(f"labelling page: {server.url} ({server.labelled} of {len(queue)} maps labelled so far); Ctrl-C stops the server", flush=True)
        if s["browser"]:
            import webbrowser

            webbrowser.open(server.url)
        try:
            server.thread.join()
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()
        return server.labelled, len(queue)

    def summary(self, result, settings: dict) -> list[str]:
        labelled, total = result
        return [f"{labelled} of {total} maps labelled in {settings['labels'].resolve()}"]


register_study(Label())
