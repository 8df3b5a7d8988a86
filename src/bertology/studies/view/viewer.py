"""An interactive attention viewer: one self-contained HTML page, no network needed to open it.

The page has a *head view* (one layer; lines from each token to the tokens it attends, one colour per
head; hover a token to isolate it; a sentence A/B filter for pairs; it opens on one head of the first layer, the
most distinctive one, :func:`distinctive_head`, with the other heads a click away) and a *model view* (a layer x head
grid of thumbnails; click one to open it in the head view; filter by the roles and patterns of a run folder, each
head's labels in a short form that a legend spells out, :data:`LABEL_SHORT`, and in full on hover), each under
three views of attention: the weights, Kobayashi et al.'s (2020) norm shares (where the model's layout is known) and
Abnar & Zuidema's (2020) rollout. Everything is drawn on canvas, so a 512-token input stays fast. Weights are quantised to one
byte (``round(255 a)``); above 128 tokens only each row's ``top_k`` largest weights are kept (pieces are
indexed with two bytes), which keeps a 512-token page at a few MB.

Tokens and text reach the page only as JSON (with ``<``, ``>`` and ``&`` escaped) read by ``JSON.parse``
and drawn with ``fillText`` or set as ``textContent``: markup in a corpus line stays text.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from scipy.special import rel_entr

from bertology.core.corpora import Example
from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError
from bertology.core.models import BLOCK_LAYOUTS, LoadedModel, load_model
from bertology.core.runfolder import atomic_write, check_file_out
from bertology.families.rollout.analyzer import rollout

#: How the page names each view.
VIEW_TITLES = {"attention": "attention weights", "norm": "norm shares ||a f(x)|| (Kobayashi et al. 2020)",
               "rollout": "rollout (Abnar & Zuidema 2020; one map per layer)"}
#: Inputs longer than this keep only each row's top-k weights unless ``top_k=0`` is asked for.
DENSE_UP_TO = 128
DEFAULT_TOP_K = 20
#: The short form of a head's label in the model view (a legend under the grid spells each out); a ``role:relation``
#: label shortens its role (``syntactic:nsubj`` -> ``syn:nsubj``), and a label not named here is shown whole.
LABEL_SHORT = {"local": "loc", "delimiter": "delim", "syntactic": "syn", "block": "block", "vertical": "vert", "diagonal": "diag",
               "vertical+diagonal": "vert+diag", "heterogeneous": "hetero"}


def short_label(label: str) -> str:
    """A head label's short form in the model view (:data:`LABEL_SHORT`)."""
    role, colon, rest = label.partition(":")
    return LABEL_SHORT.get(role, role) + colon + rest


def label_chips(labels: list[str]) -> list[tuple[str, str]]:
    """A head's labels as the model view shows them, in order: ``(short form, full text on hover)``. The ``role:relation``
    labels of one role are one chip when there are several (``syn: 12 relations``, the relations on hover)."""
    groups: dict[str, list[str]] = {}
    for label in labels:
        role, colon, relation = label.partition(":")
        groups.setdefault(role + colon, []).append(relation if colon else label)
    chips = []
    for key, members in groups.items():
        if not key.endswith(":"):  # a plain label (twice if a role and a pattern share its name)
            chips += [(short_label(label), label) for label in members]
        elif len(members) == 1:
            chips.append((short_label(key + members[0]), key + members[0]))
        else:
            role = key[:-1]
            chips.append((f"{LABEL_SHORT.get(role, role)}: {len(members)} relations", f"{role}: {', '.join(members)}"))
    return chips


def distinctive_head(maps: np.ndarray) -> int:
    """The most distinctive head of one layer on one input, ``maps [heads, n, n]``: the head whose rows are furthest from
    the layer's mean map ``M = mean_h maps[h]``, by the mean over query rows ``i`` of the Jensen-Shannon divergence (nats)
    between ``maps[h, i]`` and ``M[i]`` (the first such head on a tie). The viewer opens on this head of layer 0, alone,
    rather than on every head of the layer overlaid."""
    mean = maps.mean(axis=0, keepdims=True)
    middle = (maps + mean) / 2
    divergence = (rel_entr(maps, middle).sum(-1) + rel_entr(mean, middle).sum(-1)) / 2  # [heads, n]
    return int(np.argmax(divergence.mean(-1)))


@dataclass
class AttentionView:
    """One input's attention, every layer and head, ready to be drawn."""

    tokens: list[str]
    segments: list[int]
    attention: np.ndarray = field(repr=False)  # [layers, heads, n, n]
    model: str
    text: str
    text_pair: str | None = None
    labels: dict[str, list[str]] = field(default_factory=dict)  # "layer-head" -> labels
    top_k: int | None = None
    #: Other views of the same input, by name: ``norm`` (Kobayashi et al.'s norm shares, ``[layers, heads, n, n]``)
    #: and ``rollout`` (Abnar & Zuidema's rolled-out attention, one map per layer: ``[layers, 1, n, n]``).
    views: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def _encoded(self, maps: np.ndarray, top_k: int) -> dict:
        """One view's maps, quantised to a byte (base64); above ``top_k`` keys, each row's ``top_k`` largest only."""
        n = maps.shape[-1]
        quantised = np.clip(np.rint(maps * 255), 0, 255).astype(np.uint8)
        if top_k == 0 or top_k >= n:
            return {"format": "dense", "heads": maps.shape[1], "weights": base64.b64encode(quantised.tobytes()).decode("ascii")}
        order = np.argsort(-maps, axis=-1, kind="stable")[..., :top_k]  # [L, H, n, k]
        return {"format": "topk", "heads": maps.shape[1], "k": top_k,
                "weights": base64.b64encode(np.take_along_axis(quantised, order, -1).tobytes()).decode("ascii"),
                "indices": base64.b64encode(order.astype("<u2").tobytes()).decode("ascii")}

    def payload(self) -> dict:
        """The page's data: tokens, segments, labels and each view's quantised maps (base64), the weights first."""
        layers, heads, n, _ = self.attention.shape
        top_k = self.top_k if self.top_k is not None else (0 if n <= DENSE_UP_TO else DEFAULT_TOP_K)
        data = {"model": self.model, "text": self.text, "text_pair": self.text_pair, "tokens": self.tokens, "segments": self.segments,
                "layers": layers, "heads": heads, "n": n, "labels": self.labels, "start_head": distinctive_head(self.attention[0])}
        used = [label for labels in self.labels.values() for label in labels]
        data["label_chips"] = {head: label_chips(labels) for head, labels in self.labels.items()}
        roles = {label.partition(":")[0] for label in used}
        data["label_legend"] = {short: label for label, short in LABEL_SHORT.items() if label in roles and short != label}
        data["views"] = {name: {"title": VIEW_TITLES[name], **self._encoded(maps, top_k)}
                         for name, maps in {"attention": self.attention, **self.views}.items()}
        return data

    def html(self) -> str:
        """The standalone page."""
        script = json.dumps(self.payload()).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
        environment = Environment(loader=PackageLoader("bertology", "studies/view/templates"), autoescape=select_autoescape(["j2", "html"]))
        assets = resources.files("bertology.studies.view") / "templates"
        return environment.get_template("viewer.html.j2").render(
            view=self, data=Markup(script), script=Markup((assets / "viewer.js").read_text(encoding="utf-8")),
            style=Markup((assets / "viewer.css").read_text(encoding="utf-8")),
        )

    def save(self, path: str | Path) -> Path:
        check_file_out(path)
        page = self.html()
        return atomic_write(Path(path), lambda p: p.write_text(page, encoding="utf-8"))

    def _repr_html_(self) -> str:
        """Inline in a notebook: the same page in an iframe (its scripts and ids stay apart from the notebook's)."""
        return f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" style="width:100%;height:760px;border:0" sandbox="allow-scripts"></iframe>'


def head_labels(run: str | Path) -> dict[str, list[str]]:
    """``"layer-head" -> labels`` from a run folder: the roles a head holds (``roles.csv``) and its majority pattern."""
    run = Path(run)
    if not run.is_dir():
        raise BertologyError(f"{run}: no such run folder")
    labels: dict[str, list[str]] = {}
    roles = run / "roles.csv"
    if roles.is_file():
        table = pd.read_csv(roles)
        if {"layer", "head", "role", "has_role"} <= set(table.columns):
            for row in table[table.has_role.astype(bool)].itertuples():
                labels.setdefault(f"{row.layer}-{row.head}", []).append(str(row.role))
    patterns = run / "patterns.csv"
    if patterns.is_file():
        table = pd.read_csv(patterns)
        if {"layer", "head", "majority"} <= set(table.columns):
            for row in table.drop_duplicates(["layer", "head"]).itertuples():
                labels.setdefault(f"{row.layer}-{row.head}", []).append(str(row.majority))
    return labels


def attention_view(text: str, text_pair: str | None = None, *, model: str | Path | LoadedModel | None = None, run: str | Path | None = None,
                   top_k: int | None = None, max_length: int | None = None, device: str = "auto") -> AttentionView:
    """Run ``model`` (default: all-MiniLM-L6-v2) on one input and return its :class:`AttentionView`."""
    if not text or not text.strip():
        raise BertologyError("the text to view is empty")
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device)
    engine = Engine(loaded, batch_size=1, max_length=min(max_length or loaded.max_length, loaded.max_length), progress=False)
    items = list(engine.encode(enumerate([Example(text, text_pair, source="view")]), RunStats()))
    norms = loaded.model.config.model_type in BLOCK_LAYOUTS
    batch = engine.run_batch(items, norms=norms)
    n = len(items[0])
    views = {"norm": batch.weighted("norm").attentions} if norms else {}
    views["rollout"] = rollout(batch.attentions)[:, :, None]
    as_numpy = lambda maps: maps[:, 0, :, :n, :n].float().cpu().numpy()  # noqa: E731
    tokens = loaded.tokenizer.convert_ids_to_tokens(items[0].input_ids)
    segments = [-1 if s is None else int(s) for s in items[0].sequence_ids]
    return AttentionView(tokens, segments, as_numpy(batch.attentions), loaded.name, text, text_pair, head_labels(run) if run is not None else {},
                         top_k, {name: as_numpy(maps) for name, maps in views.items()})
