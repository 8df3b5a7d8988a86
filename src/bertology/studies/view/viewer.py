"""An interactive attention viewer: one self-contained HTML page, no network needed to open it.

The page has a *head view* (one layer; lines from each token to the tokens it attends, one colour per
head; hover a token to isolate it; a sentence A/B filter for pairs; it opens on one head of the first layer, the
most distinctive one, :func:`distinctive_head`, with the other heads a click away) and a *model view* (a layer x head
grid of thumbnails; click one to open it in the head view; filter by the roles and patterns of a run folder, each
head's labels in a short form that a legend spells out, :data:`LABEL_SHORT`, and in full on hover), each under
three views of attention: the weights, Kobayashi et al.'s (2020) norm shares (where the model's layout is known) and
Abnar & Zuidema's (2020) rollout. Everything is drawn on canvas, so a 2,048-token input stays fast.

Decoders (causal attention, docs/methods.md#decoders) are drawn as they are: a query's lines go only to itself and the
tokens before it, hovering a token greys the tokens it cannot see (or that cannot see it), and the thumbnails draw
the cells after the diagonal grey, as not visible rather than as zero attention.

What the page stores (:class:`StoredMaps`): weights quantised to one byte (``round(255 a)``); each thumbnail, every
head's full map max-pooled to at most :data:`OVERVIEW_SIZE` cells a side; and, up to :data:`DENSE_UP_TO` tokens,
every weight, above it only each row's ``k`` largest (pieces indexed with two bytes) with the mass of the keys left
out, one byte a row (hovering a query names its three strongest keys and that share). ``k`` is :data:`DEFAULT_TOP_K`,
fewer where the maps would pass :data:`MAP_BYTES` (:func:`kept_keys`): the page holds at most ``4/3 MAP_BYTES`` of maps
(base64; 22.4 MB) besides its tokens, text (the part the tokens cover) and code, for any model up to 1,254 maps at
2,048 tokens (GPT-2 small, 300 maps, keeps 7 keys a row).
The model runs layer by layer (the engine's ``on_layer``): one layer's maps are in memory at a time.

What the page computes (:func:`layers_within`): at most :data:`VIEW_BUDGET` map cells (heads x n x n over the views,
one map a layer for the rollout), whole layers from the first on, the first always; a layer past the budget is left
off the page, where its head view names the ``bertology view --layers`` command that draws it (a 32 x
32-head model at 1,024 tokens would take minutes to compute every layer's views); the forward pass stops after the last layer
kept. ``layers`` asks for given layers instead.

Tokens and text reach the page only as JSON (with ``<``, ``>`` and ``&`` escaped) read by ``JSON.parse``
and drawn with ``fillText`` or set as ``textContent``: markup in a corpus line stays text.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from torch.special import xlogy

from bertology.core.engine import MIN_PIECES, Engine, PassNeeds, RunStats
from bertology.core.errors import BertologyError, CorpusError
from bertology.core.model.kinds import ENCODER, Kind
from bertology.core.model.models import LoadedModel, load_model
from bertology.core.storage.runfolder import atomic_write, check_file_out
from bertology.core.text.corpora import Example
from bertology.families.rollout.analyzer import rollout_step

#: How the page names each view.
VIEW_TITLES = {"attention": "attention weights", "norm": "norm shares ||a f(x)|| (Kobayashi et al. 2020)",
               "alti": "ALTI per head (Ferrando et al. 2022)", "value-zeroing": "value zeroing per head (Mohebbi et al. 2023)",
               "rollout": "rollout (Abnar & Zuidema 2020; one map per layer)"}
#: Inputs longer than this keep only each row's top-k weights unless ``top_k=0`` is asked for.
DENSE_UP_TO = 128
DEFAULT_TOP_K = 20
#: The most bytes the page's maps take before base64: above it, rows keep fewer keys (at least one).
MAP_BYTES = 16 * 2**20
#: A thumbnail's side: each map max-pooled to at most this many cells a side.
OVERVIEW_SIZE = 72
#: Key positions are stored in two bytes: the viewer reads at most this many tokens.
MAX_TOKENS = 2**16 - 1
#: The most map cells the page computes (:func:`layers_within`): every layer of a 12 x 12-head model up to about 1,400
#: tokens, of a 32 x 32-head model up to 256 tokens; at 1,024 tokens the latter keeps its first 3 layers.
VIEW_BUDGET = 2**28
#: Most bytes of one block of a layer's maps (float32) the viewer computes at a time (:func:`attention_view`): a 32-head
#: layer at 1,024 tokens in four blocks
VIEW_BLOCK_BYTES = 2**25
#: The short form of a head's label in the model view (a legend under the grid spells each out); a ``role:relation``
#: label shortens its role (``syntactic:nsubj`` -> ``syn:nsubj``), and a label not named here is shown whole.
LABEL_SHORT = {"local": "loc", "delimiter": "delim", "syntactic": "syn", "block": "block", "vertical": "vert", "diagonal": "diag",
               "vertical+diagonal": "vert+diag", "heterogeneous": "hetero"}

#: The start of every viewer page's title: the mark by which ``view --out`` knows an earlier page it may replace.
PAGE_MARK = "<title>bertology viewer: "


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


def head_divergences(maps: torch.Tensor) -> torch.Tensor:
    """``[heads]`` float64: each head's Jensen-Shannon divergence (nats) from the layer's mean map, summed over the query rows
    of ``maps [heads, r, n]`` (every row of a layer, or a block of them: the sums of blocks add up), ``JS(maps[h, i], M[i])``
    with ``M = mean_h maps[h]``; one head's rows at a time, on the maps' device (a 16-head layer at 8,192 tokens stays within
    memory)."""
    exact = torch.float32 if maps.device.type == "mps" else torch.float64  # MPS has no float64
    mean = maps.mean(0, dtype=exact)
    divergence = []
    for head in maps:
        head = head.to(exact)
        middle = (head + mean) / 2
        # rel_entr(p, m) = p log p - p log m, 0 where p = 0 (xlogy)
        rows = (xlogy(head, head) - xlogy(head, middle)).sum(-1) + (xlogy(mean, mean) - xlogy(mean, middle)).sum(-1)
        divergence.append(rows.sum() / 2)
    return torch.stack(divergence)


def distinctive_head(maps: np.ndarray | torch.Tensor) -> int:
    """The most distinctive head of one layer on one input, ``maps [heads, n, n]``: the one the viewer opens on.

    The head whose rows are furthest from the layer's mean map, by the mean over query rows of the Jensen-Shannon
    divergence (nats) between its row and the mean map's (:func:`head_divergences`; the first such head on a tie). The
    viewer opens on this head of layer 0, alone, rather than on every head of the layer overlaid. (A decoder's row 0 is
    the same in every head, divergence 0: it shifts no head's rank.)
    """
    return int(torch.argmax(head_divergences(torch.as_tensor(maps))))


def layers_within(layers: int, cells_per_layer: int, budget: int = VIEW_BUDGET) -> list[int]:
    """The layers the page computes and stores: from layer 0 on, as many as fit ``budget`` at ``cells_per_layer`` map cells
    each (heads x n x n over the views; :data:`VIEW_BUDGET`), and at least the first."""
    return list(range(min(layers, max(1, budget // max(1, cells_per_layer)))))


def kept_keys(n: int, maps: int, top_k: int | None = None) -> int:
    """How many keys each row of an ``n``-token input keeps on the page (0: every key), for ``maps`` maps in all.

    ``maps``: layers x heads, over the views. As asked by ``top_k``; else every key up to :data:`DENSE_UP_TO` tokens and
    :data:`DEFAULT_TOP_K` above, each as far as the maps fit :data:`MAP_BYTES` (a thumbnail, and a byte a kept weight,
    two for its position and one a row for the mass left out), and never fewer than one. So the maps take at most
    ``MAP_BYTES`` wherever ``maps (S^2 + 4 n) <= MAP_BYTES`` (``S`` a thumbnail's side; at 2,048 tokens up to 1,254
    maps, as 24 layers x 16 heads with the norm shares and the rollout), else ``maps (S^2 + 4 n)`` bytes with one key a
    row.
    """
    if top_k is not None:
        return 0 if top_k >= n else top_k
    thumbnails = maps * min(n, OVERVIEW_SIZE) ** 2
    if n <= DENSE_UP_TO and thumbnails + maps * n * n <= MAP_BYTES:
        return 0
    fitting = ((MAP_BYTES - thumbnails) // (maps * n) - 1) // 3
    return int(min(DEFAULT_TOP_K, n - 1, max(1, fitting)))  # 0 (every key) for a one-token input


def overview_cells(n: int) -> list[tuple[int, int]]:
    """Each thumbnail cell's tokens ``[start, stop)``, rows and columns alike: token ``i`` falls in cell ``floor(i / (n / S))``,
    ``S = min(n, OVERVIEW_SIZE)``; every cell holds at least one token, so on a causal map the cells after the diagonal
    (column > row) hold only keys their queries cannot see."""
    size = min(n, OVERVIEW_SIZE)
    cells = np.floor(np.arange(n) / (n / size)).astype(np.int64)
    bounds = [*np.flatnonzero(np.diff(cells, prepend=-1)).tolist(), n]
    return list(zip(bounds, bounds[1:]))


def pooled_rows(maps: torch.Tensor, rows: slice, pooled: torch.Tensor) -> None:
    """Fold the query rows ``rows`` of maps (``maps [..., r, n]``) into ``pooled [..., n keys, S]``, each thumbnail cell's
    (:func:`overview_cells`) largest weight over its query rows so far, in place: a cell split between two blocks of rows
    takes the larger of its two parts. Maps are never negative, so ``pooled`` starts at zeros."""
    for cell, (start, stop) in enumerate(overview_cells(maps.shape[-1])):
        first, last = max(start, rows.start), min(stop, rows.stop)
        if first < last:  # each reduction runs over a block of whole rows (contiguous)
            torch.maximum(pooled[..., cell], maps[..., first - rows.start : last - rows.start, :].amax(-2), out=pooled[..., cell])


def pooled_keys(pooled: torch.Tensor) -> torch.Tensor:
    """``pooled [..., n keys, S]`` (:func:`pooled_rows` over every row) max-pooled over the keys' cells too: the thumbnail,
    ``[..., S queries, S keys]``."""
    return torch.stack([pooled[..., start:stop, :].amax(-2) for start, stop in overview_cells(pooled.shape[-2])], dim=-1)


def as_base64(arrays: list[np.ndarray]) -> str:
    return base64.b64encode(np.concatenate(arrays).tobytes()).decode("ascii")


@dataclass
class StoredMaps:
    """One view of attention as the page stores it, added layer by layer (:meth:`add`): ``weights[l]`` each map quantised
    to a byte, ``[heads, n, n]`` where ``k == 0``, else each row's ``k`` largest, ``[heads, n, k]``, largest first, at the
    key positions ``indices[l]``, with ``rest[l] [heads, n]`` the row's mass outside them (quantised the same way);
    ``overview[l] [heads, S, S]`` each quantised map max-pooled to the thumbnail's cells (:func:`max_pooled`)."""

    heads: int
    n: int
    k: int
    weights: list[np.ndarray] = field(default_factory=list, repr=False)
    indices: list[np.ndarray] = field(default_factory=list, repr=False)
    rest: list[np.ndarray] = field(default_factory=list, repr=False)
    overview: list[np.ndarray] = field(default_factory=list, repr=False)

    _rows: list[tuple[np.ndarray, ...]] = field(default_factory=list, repr=False)  # the layer being added, block by block
    _pooled: torch.Tensor | None = field(default=None, repr=False)  # its thumbnail's cells over its rows so far

    @staticmethod
    def quantised(maps: torch.Tensor) -> torch.Tensor:
        return torch.round(maps * 255).clamp_(0, 255).to(torch.uint8)

    def add(self, maps: torch.Tensor, rows: slice | None = None) -> None:
        """Store the next layer's maps ``[heads, n, n]`` (any device), or the query rows ``rows`` of it (``[heads, r, n]``,
        blocks in order: the layer is stored with its last row). Every row is stored on its own (its weights, or its k
        largest and the mass left out) and the thumbnail pooled as the rows come, so a layer never needs its whole maps."""
        n = maps.shape[-1]
        rows = slice(0, maps.shape[-2]) if rows is None else rows
        if rows.start == 0:
            self._rows, self._pooled = [], maps.new_zeros(*maps.shape[:-2], n, min(n, OVERVIEW_SIZE))
        pooled_rows(maps, rows, self._pooled)
        if self.k == 0:
            self._rows.append((self.quantised(maps).cpu().numpy(),))
        else:
            kept, order = torch.topk(maps, self.k, dim=-1)
            self._rows.append((self.quantised(kept).cpu().numpy(), order.cpu().numpy().astype("<u2"),
                               self.quantised((maps.sum(-1) - kept.sum(-1)).clamp_(min=0)).cpu().numpy()))
        if rows.stop < n:
            return
        # rounding keeps order: the thumbnail's cells are the largest of the quantised maps
        self.overview.append(self.quantised(pooled_keys(self._pooled)).cpu().numpy())
        parts = [np.concatenate(part, axis=-2 if part[0].ndim == 3 else -1) for part in zip(*self._rows)]
        self.weights.append(parts[0])
        if self.k:
            self.indices.append(parts[1])
            self.rest.append(parts[2])
        self._rows, self._pooled = [], None

    def payload(self) -> dict:
        """The page's form: each array base64-encoded, layers in order."""
        data = {"format": "dense" if self.k == 0 else "topk", "heads": self.heads, "weights": as_base64(self.weights), "overview": as_base64(self.overview)}
        if self.k:
            data.update(k=self.k, indices=as_base64(self.indices), rest=as_base64(self.rest))
        return data


@dataclass
class AttentionView:
    """One input's attention, every layer and head, as the page stores it (:class:`StoredMaps`). Build one with
    :func:`attention_view` (a model on a text) or :meth:`from_maps` (maps in hand)."""

    tokens: list[str]
    segments: list[int]
    #: Each view of attention by name, the weights first: ``attention``, ``norm`` (Kobayashi et al.'s norm shares) where
    #: the model's layout is known, and ``rollout`` (Abnar & Zuidema's rolled-out attention, one map per layer).
    maps: dict[str, StoredMaps] = field(repr=False)
    model: str
    text: str
    text_pair: str | None = None
    labels: dict[str, list[str]] = field(default_factory=dict)  # "layer-head" -> labels
    start_head: int = 0  # the head the page opens on, of layer 0 (:func:`distinctive_head`)
    kind: Kind = ENCODER  # the model's: a decoder's query i sees the keys j <= i only
    truncated: bool = False  # the input was cut to the model's (or the asked) length: ``text`` and ``text_pair`` are the parts kept
    #: The model's layers whose maps the page holds, in order (:func:`layers_within`; empty: every layer), and how many the
    #: model has (0: as many as the page holds).
    stored_layers: list[int] = field(default_factory=list)
    layer_count: int = 0

    def __post_init__(self) -> None:
        self.stored_layers = self.stored_layers or list(range(len(self.maps["attention"].weights)))
        self.layer_count = self.layer_count or len(self.stored_layers)

    @classmethod
    def from_maps(cls, tokens: list[str], segments: list[int], attention: np.ndarray, model: str, text: str, text_pair: str | None = None, *,
                  views: dict[str, np.ndarray] | None = None, top_k: int | None = None, kind: Kind = ENCODER) -> AttentionView:
        """A view of maps in hand: ``attention [layers, heads, n, n]`` and other ``views`` by name (``[layers, heads or 1, n, n]``)."""
        every = {"attention": attention, **(views or {})}
        layers, _, n, _ = attention.shape
        k = kept_keys(n, sum(layers * maps.shape[1] for maps in every.values()), top_k)
        stored = {}
        for name, maps in every.items():
            stored[name] = StoredMaps(maps.shape[1], n, k)
            for layer_maps in torch.as_tensor(maps):
                stored[name].add(layer_maps)
        return cls(tokens, segments, stored, model, text, text_pair, start_head=distinctive_head(np.asarray(attention[0])), kind=kind)

    @property
    def layers(self) -> int:
        """The model's layers (the page may hold fewer: :attr:`stored_layers`)."""
        return self.layer_count

    @property
    def heads(self) -> int:
        return self.maps["attention"].heads

    @property
    def kept(self) -> int:
        """Keys kept per row (0: every key)."""
        return self.maps["attention"].k

    @property
    def has_pair(self) -> bool:
        return 1 in self.segments

    def payload(self) -> dict:
        """The page's data: tokens, segments, labels and each view's stored maps (base64), the weights first."""
        n = len(self.tokens)
        data = {"model": self.model, "text": self.text, "text_pair": self.text_pair, "tokens": self.tokens, "segments": self.segments,
                "layers": self.layers, "heads": self.heads, "n": n, "kind": self.kind.name,
                "sees_later_keys": self.kind.sees_later_keys, "overview_size": min(n, OVERVIEW_SIZE),
                "labels": self.labels, "start_head": self.start_head, "stored_layers": self.stored_layers}
        used = [label for labels in self.labels.values() for label in labels]
        data["label_chips"] = {head: label_chips(labels) for head, labels in self.labels.items()}
        roles = {label.partition(":")[0] for label in used}
        data["label_legend"] = {short: label for label, short in LABEL_SHORT.items() if label in roles and short != label}
        data["views"] = {name: {"title": VIEW_TITLES[name], **stored.payload()} for name, stored in self.maps.items()}
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
        """Write the page to ``path``: a new file, or an earlier viewer page (its title holds :data:`PAGE_MARK`), replaced whole."""
        check_file_out(path, made_by=PAGE_MARK)
        page = self.html()
        return atomic_write(Path(path), lambda p: p.write_text(page, encoding="utf-8"))

    def _repr_html_(self) -> str:
        """Inline in a notebook: the same page in an iframe (its scripts and ids stay apart from the notebook's)."""
        return f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" style="width:100%;height:760px;border:0" sandbox="allow-scripts"></iframe>'


def _labels_table(path: Path, columns: tuple[str, ...], flag: str | None = None) -> pd.DataFrame:
    """A run folder's table as :func:`head_labels` reads it, checked: it parses as CSV, holds ``columns``, its ``layer``
    and ``head`` are whole numbers from 0 and its ``flag`` column (where named) is True or False; else one line naming the
    file and the first bad line (a table edited by hand, or no table of bertology's)."""
    try:
        table = pd.read_csv(path, dtype={"layer": object, "head": object, **({flag: object} if flag else {})})
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError) as exc:  # EmptyDataError is a ValueError
        raise CorpusError(path, None, f"not a table bertology wrote ({(str(exc).splitlines() or [type(exc).__name__])[0]})") from None
    missing = [column for column in columns if column not in table.columns]
    if missing:
        raise CorpusError(path, 1, f"no column {missing[0]!r}; a run folder's {path.name} has {', '.join(columns)}")
    for column in ("layer", "head"):
        numbers = pd.to_numeric(table[column], errors="coerce")
        bad = ~(numbers.notna() & (numbers >= 0) & (numbers == numbers.round()))
        if bad.any():
            row = int(bad.to_numpy().argmax())
            raise CorpusError(path, row + 2, f"{column} {table[column].iloc[row]!r} is not a whole number from 0")
        table[column] = numbers.astype(int)
    if flag is not None:
        known = table[flag].astype(str).str.strip().map({"True": True, "False": False})
        if known.isna().any():
            row = int(known.isna().to_numpy().argmax())
            raise CorpusError(path, row + 2, f"{flag} {table[flag].iloc[row]!r} is neither True nor False")
        table[flag] = known.astype(bool)
    return table


def head_labels(run: str | Path) -> dict[str, list[str]]:
    """``"layer-head" -> labels`` from a run folder: the roles a head holds (``roles.csv``) and its majority pattern
    (``patterns.csv``), each table checked (:func:`_labels_table`)."""
    run = Path(run)
    if not run.is_dir():
        raise BertologyError(f"{run}: no such run folder")
    labels: dict[str, list[str]] = {}
    roles = run / "roles.csv"
    if roles.is_file():
        table = _labels_table(roles, ("layer", "head", "role", "has_role"), flag="has_role")
        for row in table[table.has_role].itertuples():
            labels.setdefault(f"{row.layer}-{row.head}", []).append(str(row.role))
    patterns = run / "patterns.csv"
    if patterns.is_file():
        table = _labels_table(patterns, ("layer", "head", "majority"))
        for row in table.drop_duplicates(["layer", "head"]).itertuples():
            labels.setdefault(f"{row.layer}-{row.head}", []).append(str(row.majority))
    return labels


def attention_view(text: str, text_pair: str | None = None, *, model: str | Path | LoadedModel | None = None, run: str | Path | None = None,
                   top_k: int | None = None, max_length: int | None = None, device: str = "auto",
                   contributions: tuple[str, ...] = (), layers: Iterable[int] | None = None, budget: int = VIEW_BUDGET,
                   block_bytes: int = VIEW_BLOCK_BYTES) -> AttentionView:
    """Run ``model`` (default: all-MiniLM-L6-v2) on one input, layer by layer, and return its :class:`AttentionView`.

    ``contributions``: per-head contribution views to add to the menu (``alti``, ``value-zeroing``:
    :mod:`bertology.core.measures.contributions`). ``layers``: the layers (0-based) whose maps the page holds; by
    default those within ``budget`` map cells (:func:`layers_within`). Nothing past the last of them is computed: the
    forward pass stops there. Each layer's maps are computed ``block_bytes`` (float32) of query rows at a time, and the
    page's part of each row kept (:meth:`StoredMaps.add`): a layer's whole maps are never held (but with
    ``contributions``, which need them).
    """
    if not text or not text.strip():
        raise BertologyError("the text to view is empty")
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device=device)
    engine = Engine(loaded, batch_size=1, max_length=min(max_length or loaded.max_length, loaded.max_length, MAX_TOKENS), progress=False)
    stats = RunStats()
    items = list(engine.encode(enumerate([Example(text, text_pair, source="the text to view")]), stats))
    if not items:  # skipped as degenerate: one piece (a decoder's one-word text) attends to nothing else
        raise BertologyError(f"the text to view gives fewer than {MIN_PIECES} pieces: there is no map to draw; give a longer text")
    n, num_layers, heads = len(items[0]), loaded.num_layers, loaded.num_heads
    views = ["attention", "norm", *contributions, "rollout"] if engine.knows_blocks else ["attention", "rollout"]
    maps_per_layer = heads * (len(views) - 1) + 1  # the rollout: one map a layer
    if layers is None:
        kept_layers = layers_within(num_layers, n * n * maps_per_layer, budget)
    else:
        kept_layers = sorted(set(layers))
        if not kept_layers or not all(0 <= layer < num_layers for layer in kept_layers):
            raise BertologyError(f"--layers {','.join(map(str, layers))}: {loaded.name} has layers 0 to {num_layers - 1}")
    k = kept_keys(n, len(kept_layers) * maps_per_layer, top_k)
    stored = {name: StoredMaps(1 if name == "rollout" else heads, n, k) for name in views}
    # by blocks of query rows (contribution maps need whole layers): neither the model's scores nor a view of a whole layer
    # are ever held, only what the page keeps of each row
    rows_at_once = max(1, block_bytes // (heads * n * 4)) if not contributions else n
    start_head, rolled, rolling, divergences = 0, None, None, None

    def keep_layer(batch, layer: int, maps) -> None:
        nonlocal start_head, rolled, rolling, divergences
        block = maps("attention")
        rows = block.rows if block.rows is not None else slice(0, n)
        attention = block.attention[0].float()  # [heads, r, n]
        if block.starts_layer:
            rolling, divergences = attention.new_empty(1, n, n), None
        rolling[:, rows] = rollout_step(attention[None], rolled, first=rows.start)  # every layer's, up to the last kept
        if layer == kept_layers[0]:  # the head the page opens on: its divergences add up over the blocks
            part = head_divergences(attention)
            divergences = part if divergences is None else divergences + part
        if layer in kept_layers:
            stored["attention"].add(attention, rows)
            for view in ("norm", *contributions):
                if view in stored:
                    stored[view].add(maps(view).attention[0].float(), rows)
        if not block.ends_layer:
            return
        rolled = rolling
        if layer in kept_layers:
            stored["rollout"].add(rolled)
        if layer == kept_layers[0]:
            start_head = int(torch.argmax(divergences))

    needs = PassNeeds(norms="norm" in stored, views=tuple(view for view in contributions if view in stored))
    engine.run_batch(items, needs, on_layer=keep_layer, query_rows=rows_at_once if rows_at_once < n else None, last_layer=kept_layers[-1])
    item = items[0]
    tokens = loaded.tokenizer.convert_ids_to_tokens(item.input_ids)
    segments = [-1 if s is None else int(s) for s in item.sequence_ids]
    if item.truncated:  # the page holds only the text its tokens cover (a long passage cut to 2,048 tokens stays small)
        covered = [max((end for (_, end), s in zip(item.offsets, segments) if s == segment), default=0) for segment in (0, 1)]
        text, text_pair = text[:covered[0]], None if text_pair is None else text_pair[:covered[1]]
    return AttentionView(tokens, segments, stored, loaded.name, text, text_pair, head_labels(run) if run is not None else {},
                         start_head, loaded.kind, item.truncated, kept_layers, num_layers)
