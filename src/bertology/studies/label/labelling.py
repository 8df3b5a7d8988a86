"""``bertology label``: a local page that shows attention maps one at a time and records a pattern class for each.

The queue is chosen once, seeded: maps spread evenly over the layers (stratified; random heads and inputs within each
layer) or, given a trained classifier, the maps it is least sure of (the highest entropy of its class probabilities,
among ``pool`` times as many random candidates). Every label is appended to ``LABELS.jsonl`` at once and fsynced, in
the ``labels`` corpus format that ``bertology patterns --train`` reads, so a closed tab or a killed server loses
nothing; started again with the same file, the page continues at the first map without a label (the last line for a
map wins, so going back and labelling again corrects it). Before the first label the whole file is read: a line that
is not a label (the last one too) is refused, and a last line without its line end gets one, so no label is glued to it.

The server listens on 127.0.0.1 only, on a port the system picks, answers only requests addressed to that host and
port, takes labels only as JSON (another site's page cannot send them without a preflight it never gets) of at most
``MAX_LABEL_BYTES`` (a whole-number position and a class name; anything else is answered 400 or 413), and fetches nothing:
the page is self-contained.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path

import numpy as np

from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError, StateError
from bertology.core.model.models import LoadedModel
from bertology.core.storage.safeload import parse_json
from bertology.core.text.corpora import PATTERN_LABELS, Example, prepare_jsonl_append, read_labels

#: The largest label request the page's server reads (a label is a few dozen bytes).
MAX_LABEL_BYTES = 64 * 1024


@dataclass
class MapToLabel:
    """One map of the queue: the input, the head, its tokens and its weights quantised to a byte (``round(255 a)``)."""

    text: str
    text_pair: str | None
    layer: int
    head: int
    tokens: list[str]
    weights: np.ndarray  # uint8 [n, n]

    @property
    def key(self) -> tuple:
        return self.text, self.text_pair, self.layer, self.head

    def record(self, label: str) -> dict:
        """The line this map's label is written as (the ``labels`` corpus format)."""
        return {"text": self.text, **({"text_pair": self.text_pair} if self.text_pair is not None else {}), "layer": self.layer,
                "head": self.head, "label": label}


def saved_labels(path: Path) -> dict[tuple, str]:
    """The labels already in ``path`` by (text, text_pair, layer, head), the last line for a map winning. Every line, the
    last one too, is checked as ``bertology patterns --train`` reads it (:func:`~bertology.core.text.corpora.read_labels`): a
    line that is not a label is an error naming it."""
    labels: dict[tuple, str] = {}
    if not path.exists():
        return labels
    for example in read_labels(path):
        layer, head, label = example.pattern_label
        labels[example.text, example.text_pair, layer, head] = label
    return labels


def choose_maps(model: LoadedModel, examples: list[Example], count: int, *, seed: int = 0, classifier=None, pool: int = 5,
                max_length: int = 128) -> list[MapToLabel]:
    """The queue (see the module docstring): ``count`` maps of ``examples`` under ``model``."""
    if not examples:
        raise BertologyError("no inputs to draw maps from")
    rng = np.random.default_rng(seed)
    wanted = count * pool if classifier is not None else count
    layers, heads = model.num_layers, model.num_heads
    draws = [(int(rng.integers(len(examples))), k % layers, int(rng.integers(heads))) for k in range(wanted)]  # every layer in turn
    draws = list(dict.fromkeys(draws))
    engine = Engine(model, batch_size=8, max_length=max_length, progress=False)
    maps, uncertainty, stats = [], [], RunStats()
    for index in sorted({i for i, _, _ in draws}):
        items = list(engine.encode([(index, examples[index])], stats))
        if not items:  # fewer than two pieces: no map to label
            continue
        stats.sequences += 1
        batch = engine.run_batch(items)
        n = len(items[0])
        tokens = model.tokenizer.convert_ids_to_tokens(items[0].input_ids)
        chosen = [(layer, head) for i, layer, head in draws if i == index]
        if classifier is not None:
            special = batch.anchor_mask  # the kind's anchors: [CLS] and [SEP], a decoder's first token
            for layer, head in chosen:
                p = classifier.probabilities(batch.attentions[layer, :, head : head + 1], batch.mask, special, batch.segment_ids)[0, 0]
                uncertainty.append(float(-(p * np.log(np.clip(p, 1e-12, 1))).sum()))
        for layer, head in chosen:
            weights = np.clip(np.rint(batch.attentions[layer, 0, head, :n, :n].float().cpu().numpy() * 255), 0, 255).astype(np.uint8)
            example = examples[index]
            maps.append(MapToLabel(example.text, example.text_pair, layer, head, tokens, weights))
    stats.check_counted(engine.settings.max_length)
    order = {key: position for position, key in enumerate((examples[i].text, examples[i].text_pair, layer, head) for i, layer, head in draws)}
    if classifier is not None:
        ranked = sorted(range(len(maps)), key=lambda k: (-uncertainty[k], order[maps[k].key]))[:count]
        return [maps[k] for k in ranked]
    return sorted(maps, key=lambda item: order[item.key])


class LabelServer:
    """Serves the labelling page for ``maps`` on 127.0.0.1 (a free port) and appends labels to ``path``."""

    def __init__(self, maps: list[MapToLabel], path: str | Path, model_name: str = ""):
        self.maps, self.path, self.model_name = maps, Path(path), model_name
        self.labels = saved_labels(self.path)
        prepare_jsonl_append(self.path)
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    @property
    def labelled(self) -> int:
        return sum(item.key in self.labels for item in self.maps)

    def start(self) -> "LabelServer":
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, position: int, label: str) -> int:
        """Append the label of map ``position`` to the file (fsynced); returns how many maps have a label."""
        if label not in PATTERN_LABELS or not 0 <= position < len(self.maps):
            raise ValueError("no such map or class")
        item = self.maps[position]
        with self._lock:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(item.record(label)) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            self.labels[item.key] = label
            return self.labelled

    def queue(self) -> dict:
        return {"model": self.model_name, "classes": list(PATTERN_LABELS), "file": str(self.path),
                "maps": [{"text": item.text, "text_pair": item.text_pair, "layer": item.layer, "head": item.head, "tokens": item.tokens,
                          "n": len(item.tokens), "weights": base64.b64encode(item.weights.tobytes()).decode("ascii"),
                          "label": self.labels.get(item.key)} for item in self.maps]}

    def page(self) -> str:
        assets = resources.files("bertology.studies.label") / "templates"
        return (assets / "label.html").read_text(encoding="utf-8").replace("/*SCRIPT*/", (assets / "label.js").read_text(encoding="utf-8"))

    def _handler(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 30  # seconds a request may take to arrive

            def log_message(self, *args):  # quiet: the terminal shows the URL and the count
                pass

            def _allowed(self) -> bool:  # only requests for this host and port (no DNS rebinding)
                return self.headers.get("Host") == f"127.0.0.1:{owner.server.server_address[1]}"

            def _send(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if not self._allowed():
                    return self._send(403, b"forbidden", "text/plain")
                if self.path == "/":
                    return self._send(200, owner.page().encode("utf-8"), "text/html; charset=utf-8")
                if self.path == "/queue":
                    return self._send(200, json.dumps(owner.queue()).encode("utf-8"), "application/json")
                return self._send(404, b"not found", "text/plain")

            def do_POST(self):
                # JSON only: a browser sends a JSON body from another site only after a preflight, which is never answered
                if not self._allowed() or self.path != "/label" or self.headers.get("Content-Type") != "application/json":
                    return self._send(403, b"forbidden", "text/plain")
                length = self.headers.get("Content-Length", "")
                if not (length.isascii() and length.isdigit()):
                    return self._send(400, b"a label needs its Content-Length", "text/plain")
                if len(length) > len(str(MAX_LABEL_BYTES)) or int(length) > MAX_LABEL_BYTES:
                    return self._send(413, b"a label is a short JSON object", "text/plain")
                try:
                    body = parse_json(self.rfile.read(int(length)).decode("utf-8"), "the label")
                except (UnicodeDecodeError, StateError):
                    return self._send(400, b"a label is a JSON object", "text/plain")
                except TimeoutError:  # a body shorter than its Content-Length
                    return self._send(408, b"the label did not arrive", "text/plain")
                position, label = (body.get("position"), body.get("label")) if isinstance(body, dict) else (None, None)
                if not isinstance(position, int) or isinstance(position, bool) or not isinstance(label, str):
                    return self._send(400, b"a label needs a whole-number position and a class name", "text/plain")
                try:
                    done = owner.add(position, label)
                except ValueError:
                    return self._send(400, b"no such map or class", "text/plain")
                except OSError:
                    return self._send(500, b"the labels file cannot be written", "text/plain")
                return self._send(200, json.dumps({"labelled": done}).encode("utf-8"), "application/json")

        return Handler
