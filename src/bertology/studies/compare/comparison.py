"""What changes between two models: fine-tuning (Kovaleva et al. 2019, docs/methods.md#comparing-two-models) and more.

:class:`CompareEngine` runs two models with the same tokenizer over the same batches, so every
analyzer sees both models' attention for the same input. :class:`HeadSimilarity` gives, per head,
the cosine similarity of the flattened maps, ``cos(A, B) = sum_ij A_ij B_ij / (||A|| ||B||)`` over
the real tokens, averaged over inputs with a 95% interval. :class:`Side` runs any single-model
analyzer on one of the two (for the change in the general profile and in the roles).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pandas as pd
import torch

from bertology.core.analyzer import Analyzer
from bertology.core.backends import PassPlan, RayBackend, backend_named
from bertology.core.engine import Engine, PassSettings, RunStats
from bertology.core.errors import BertologyError
from bertology.core.model.models import LoadedModel, load_model
from bertology.core.options import check_seed
from bertology.core.paired import BatchPair, CompareEngine
from bertology.core.statistics.stats import RunningMoments, interval_frame
from bertology.core.storage.runfolder import RunFolder, claims_out, complete_run
from bertology.core.text.corpora import Corpus, has_trees, open_corpus
from bertology.families.profile.analyzer import GeneralProfile
from bertology.families.roles.analyzer import HeadRoles
from bertology.render.html import Report
from bertology.studies.compare.report import comparison_section


def map_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of flattened maps ``[..., n, n]`` -> ``[...]`` (padding is zero in both)."""
    dot = (a * b).sum(dim=(-1, -2))
    return dot / (a.norm(dim=(-1, -2)) * b.norm(dim=(-1, -2))).clamp(min=1e-30)


class HeadSimilarity(Analyzer):
    """Per head, the cosine similarity between model A's and model B's map of each input (Kovaleva et al.).

    ``result()``: ``layer, head, cosine, ci_low, ci_high, n``; ``layers()``: the same per layer, a
    sequence's layer value being the mean over its heads.
    """

    name = "similarity"

    def __init__(self) -> None:
        self._heads: RunningMoments | None = None
        self._layers: RunningMoments | None = None

    def update(self, pair: BatchPair) -> None:
        cosine = map_cosine(pair.a.attentions, pair.b.attentions).permute(1, 0, 2).double().cpu().numpy()  # [batch, layer, head]
        if self._heads is None:
            self._heads, self._layers = RunningMoments(cosine.shape[1:]), RunningMoments(cosine.shape[1:2])
        self._heads.push(cosine)
        self._layers.push(cosine.mean(axis=2))

    def merge(self, other: "HeadSimilarity") -> "HeadSimilarity":
        self._check_mergeable(other)
        if other._heads is not None:
            if self._heads is None:
                self._heads, self._layers = other._heads, other._layers
            else:
                self._heads.merge(other._heads)
                self._layers.merge(other._layers)
        return self

    def result(self) -> pd.DataFrame:
        if self._heads is None:
            return pd.DataFrame(columns=["layer", "head", "cosine", "ci_low", "ci_high", "n"])
        num_layers, num_heads = self._heads.count.shape
        index = pd.MultiIndex.from_product([range(num_layers), range(num_heads)], names=["layer", "head"])
        return interval_frame(self._heads, index).rename(columns={"value": "cosine"})

    def layers(self) -> pd.DataFrame:
        index = pd.Index(range(self._layers.count.shape[0]), name="layer")
        return interval_frame(self._layers, index).rename(columns={"value": "cosine"})


class Side(Analyzer):
    """Runs a single-model analyzer on side ``a`` or ``b`` of a :class:`BatchPair`."""

    name = "side"

    def __init__(self, inner: Analyzer, side: str):
        if side not in ("a", "b"):
            raise ValueError("side is 'a' or 'b'")
        self.inner, self.side = inner, side

    def update(self, pair: BatchPair) -> None:
        self.inner.update(getattr(pair, self.side))

    def merge(self, other: "Side") -> "Side":
        self._check_mergeable(other)
        self.inner.merge(other.inner)
        return self

    def result(self) -> pd.DataFrame:
        return self.inner.result()


def profile_delta(heads_a: pd.DataFrame, heads_b: pd.DataFrame) -> pd.DataFrame:
    """``layer, head, metric, value_a, value_b, delta`` (delta = b - a) from two general profiles."""
    merged = heads_a[["layer", "head", "metric", "value"]].merge(heads_b[["layer", "head", "metric", "value"]], on=["layer", "head", "metric"],
                                                                    suffixes=("_a", "_b"))
    merged["delta"] = merged.value_b - merged.value_a
    return merged


def roles_delta(roles_a: pd.DataFrame, roles_b: pd.DataFrame) -> pd.DataFrame:
    """Roles gained or lost per head: ``layer, head, role, mean_a, mean_b, has_role_a, has_role_b, change``."""
    keys = ["layer", "head", "role"]
    merged = roles_a[keys + ["mean", "has_role"]].merge(roles_b[keys + ["mean", "has_role"]], on=keys, suffixes=("_a", "_b"))
    merged["change"] = np.select([merged.has_role_b & ~merged.has_role_a, merged.has_role_a & ~merged.has_role_b], ["gained", "lost"], "same")
    return merged[merged.change != "same"].reset_index(drop=True)


@dataclass
class Comparison:
    """The result of :func:`compare`: per-head similarity, per-layer similarity, profile and role changes."""

    similarity: pd.DataFrame
    similarity_layers: pd.DataFrame
    profile_delta: pd.DataFrame
    roles_delta: pd.DataFrame
    model_a: dict
    model_b: dict
    corpus: dict
    stats: RunStats
    settings: dict
    #: Where trees are given: both models' layer probes (``model`` column: ``A``, ``B``) and, per layer and task, the
    #: probe accuracy of A and B beside the layer's mean attention similarity.
    layer_probes: pd.DataFrame | None = None
    layer_comparison: pd.DataFrame | None = None
    warnings: list[str] = field(default_factory=list)

    @claims_out
    def save(self, out, command: list[str] | None = None):
        """Write tables, figures, ``report.html`` and ``manifest.json``, replacing ``out`` whole; returns the report path."""
        folder = RunFolder(out)
        folder.write_table("similarity", self.similarity)
        folder.write_table("similarity_by_layer", self.similarity_layers)
        folder.write_table("profile_delta", self.profile_delta)
        folder.write_table("roles_delta", self.roles_delta)
        name_a, name_b = self.model_a["name"], self.model_b["name"]
        section = comparison_section(folder, self.similarity, self.similarity_layers, self.profile_delta, self.roles_delta, name_a, name_b)
        sections = [section]
        if self.layer_probes is not None:
            from bertology.studies.compare.report import layer_view_section

            folder.write_table("layer_probes", self.layer_probes)
            folder.write_table("layer_comparison", self.layer_comparison)
            sections.append(layer_view_section(folder, self.layer_probes, self.layer_comparison, name_a, name_b))
        stats = self.stats.as_dict()
        summary = {"model A": name_a, "model B": name_b, "corpus": f"{self.corpus['name']} ({self.corpus['format']})",
                   "sequences": stats["sequences"], "truncated": stats["truncated"], "time": f"{stats['seconds']} s"}
        report = Report(f"bertology: {name_a} vs {name_b}", summary, sections).render()
        return complete_run(folder, {"model_a": self.model_a, "model_b": self.model_b, "corpus": self.corpus, "settings": self.settings, "stats": stats,
                           "warnings": self.warnings}, report=report, command=command) / "report.html"


def comparison_of_layers(engines: Sequence[Engine], examples, similarity_layers: pd.DataFrame, probe_sentences: int,
                         seed: int, warnings: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both models' layer probes (``model`` = A, B) and, per layer and task, ``accuracy_a``, ``accuracy_b``, their
    ``change``, both selectivities and the layer's mean attention ``cosine`` (layer l's attention feeds output l + 1)."""
    from bertology.families.layers import kept_sentences
    from bertology.families.layers.analyzer import WordVectors
    from bertology.families.layers.probes import probe_layers

    tables = []
    for side, engine in zip("AB", engines):
        vectors = WordVectors(max_sentences=probe_sentences)
        engine.run(examples, [vectors], desc=f"layer vectors of {side}")
        tables.append(probe_layers(kept_sentences(vectors, warnings, "--probe-sentences"), seed=seed, progress=engine.progress).assign(model=side))
    probes = pd.concat(tables, ignore_index=True)
    wide = probes.pivot(index=["layer", "task"], columns="model", values=["accuracy", "selectivity"])
    wide.columns = [f"{quantity}_{side.lower()}" for quantity, side in wide.columns]
    wide = wide.reset_index()
    wide["change"] = wide.accuracy_b - wide.accuracy_a
    cosine = similarity_layers.set_index("layer").cosine.rename(lambda layer: layer + 1)  # attention of block l makes output l + 1
    wide["cosine"] = wide.layer.map(cosine)
    return probes, wide[["layer", "task", "accuracy_a", "accuracy_b", "change", "selectivity_a", "selectivity_b", "cosine"]]


def piece_difference(engines: Sequence[Engine], examples) -> str | None:
    """The first example that the two engines' tokenizers cut into different pieces (the ids each engine would give the
    pass, special tokens included, or one skipping it: too long, or of fewer than two pieces), in words; None where they agree on every example.
    :class:`~bertology.core.paired.CompareEngine` feeds both models model A's pieces."""
    names = [engine.model.name for engine in engines]
    for number, example in enumerate(examples, start=1):
        encoded = [next(engine.encode([(number, example)], RunStats()), None) for engine in engines]
        ids = [None if item is None else item.input_ids for item in encoded]
        if ids[0] == ids[1]:
            continue
        where = example.source or f"example {number}"
        if None in ids:  # one engine skips it: too long, or fewer than MIN_PIECES pieces
            kept = ids.index(None) ^ 1
            return f"{where}: {names[kept]} cuts it into {len(ids[kept])} pieces, which {names[kept ^ 1]} does not (it skips the example)"
        k = next((k for k, (a, b) in enumerate(zip(*ids)) if a != b), min(map(len, ids)))
        pieces = [repr(engine.model.tokenizer.convert_ids_to_tokens(row[k])) if k < len(row) else "the end"
                  for engine, row in zip(engines, ids)]
        return f"{where}: piece {k} is {pieces[0]} for {names[0]} and {pieces[1]} for {names[1]}"
    return None


def _paired_engines(models: tuple, passing: PassSettings, examples, progress: bool) -> CompareEngine:
    """Both models, loaded as ``passing`` says (where not loaded already), each with an engine on the length both take:
    refused in one line where they are not of one vocabulary, shape and kind (:class:`~bertology.core.paired.CompareEngine`),
    or cut the corpus into other pieces (:func:`piece_difference`)."""
    loaded = [m if isinstance(m, LoadedModel) else load_model(m, device=passing.device, trust_remote_code=passing.trust_remote_code,
                                                             dtype=passing.dtype) for m in models]
    torch.manual_seed(passing.seed)
    length = min(passing.max_length or 10**9, loaded[0].max_length, loaded[1].max_length)
    engines = [Engine(model, replace(passing, max_length=length), progress=progress) for model in loaded]
    paired = CompareEngine(*engines)
    difference = piece_difference(engines, examples)
    if difference is not None:
        raise BertologyError(f"{loaded[0].name} and {loaded[1].name} cut the corpus into different pieces ({difference}): the comparison runs "
                             "both on model A's pieces, so compare models whose tokenizers agree")
    return paired


@claims_out(words=("format", "overflow", "punct", "device", "backend", "address"))
def compare(model_a, model_b, corpus=None, *, format: str = "auto", out=None, batch_size: int = 32, max_length: int | None = None,
            limit: int | None = None, overflow: str = "truncate", tau: float = 3.0, punct: str = "upos", device: str = "auto", seed: int = 0,
            trust_remote_code: bool = False, progress: bool = True, command: list[str] | None = None, backend: str = "local",
            workers: int | None = None, address: str | None = None, layer_probes: bool | None = None, probe_sentences: int = 1000,
            dtype: str = "auto", attention_budget: int | str | None = "auto") -> Comparison:
    """Run two models over the same inputs and report per-head similarity and the change in profile and roles.

    ``punct``: the profile's punctuation set, as in :func:`bertology.analyze`; ``backend``, ``workers``, ``address``: as there
    (on Ray, each actor loads both models). ``layer_probes`` (default: where the corpus has trees): probe every layer of
    both models for UPOS and dependency labels (:mod:`bertology.families.layers`, on the first ``probe_sentences``
    sentences, one more pass per model) and set the accuracies side by side per layer. The pass feeds both models model A's
    pieces: two models whose tokenizers cut an example otherwise (:func:`piece_difference`) are refused before it runs.
    ``dtype``: both models' weights' precision, as :func:`~bertology.core.model.models.load_model`'s. ``attention_budget``: as
    :func:`bertology.analyze`'s (past it the pass is refused: it reads whole maps). The manifest records the pass's settings."""
    check_seed(seed)
    passing = PassSettings(batch_size=batch_size, max_length=max_length, overflow=overflow, seed=seed, device=device, punct=punct,
                           attention_budget=attention_budget, dtype=dtype, trust_remote_code=trust_remote_code)
    runner = backend_named(backend, workers, address)
    examples, corpus_info = open_corpus(corpus, format, limit)
    with_trees = has_trees(examples)
    if layer_probes and not with_trees:  # before any model runs
        raise BertologyError("layer probes need dependency trees: give a CoNLL-U corpus")
    total = examples.validate() if isinstance(examples, Corpus) else len(examples)
    corpus_info["examples"] = total
    paired = _paired_engines((model_a, model_b), passing, examples, progress)
    engines, loaded = [paired.engine_a, paired.engine_b], [paired.engine_a.model, paired.engine_b.model]
    kind = loaded[0].kind

    def build() -> list:
        return [HeadSimilarity(), *(Side(make(), side) for make in (lambda: GeneralProfile(kind), lambda: HeadRoles(kind, tau=tau)) for side in "ab")]

    analyzers = build()
    similarity, sides = analyzers[0], dict(zip([(kind, side) for kind in ("profile", "roles") for side in "ab"], analyzers[1:]))
    if isinstance(runner, RayBackend):  # each actor runs both models; here, one engine pair over model A's batches
        plan = PassPlan(build, ["attention"] * len(analyzers))
        sources = [each if isinstance(m, LoadedModel) or dtype != "auto" else (str(m) if m is not None else None)  # shipped in its dtype
                   for m, each in zip((model_a, model_b), loaded)]
        stats = runner.run_pass(engines[0], examples, plan, analyzers, model=sources[0], compare_with=sources[1], total=total)
    else:
        stats = paired.run(examples, analyzers, total=total)
    stats.check_counted(engines[0].settings.max_length)
    warnings: list[str] = []
    probes = (comparison_of_layers(engines, examples, similarity.layers(), probe_sentences, seed, warnings)
              if with_trees and layer_probes is not False else None)
    comparison = Comparison(
        similarity=similarity.result(),
        similarity_layers=similarity.layers(),
        profile_delta=profile_delta(sides["profile", "a"].result(), sides["profile", "b"].result()),
        roles_delta=roles_delta(sides["roles", "a"].result(), sides["roles", "b"].result()),
        model_a=loaded[0].info(), model_b=loaded[1].info(), corpus=corpus_info, stats=stats,
        settings={**asdict(engines[0].settings), "tau": tau, "limit": limit, "layer_probes": probes is not None, "probe_sentences": probe_sentences},
        layer_probes=probes[0] if probes is not None else None,
        layer_comparison=probes[1] if probes is not None else None,
        warnings=warnings,
    )
    if out is not None:
        comparison.save(out, command=command)
    return comparison
