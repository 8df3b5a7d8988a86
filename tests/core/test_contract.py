"""Every analyzer passes the same contract (bertology.testing.analyzers), each rule its own test id: every registered family's
analyzers automatically, and the studies' own."""

import dataclasses
import inspect
from functools import partial
from importlib import resources
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import TEXTS, gold_example, tiny_examples

from bertology.core.analyzer import Analyzer
from bertology.core.engine import folds_row_blocks
from bertology.core.model.kinds import DECODER, ENCODER
from bertology.core.text.corpora import Corpus
from bertology.core.text.parsing import spacy_trees
from bertology.families import registered
from bertology.families.mixing.analyzer import ContextMixing
from bertology.families.patterns.analyzer import PATTERNS, HeadPatterns
from bertology.families.profile.analyzer import GeneralProfile, HeadDistance
from bertology.studies.track.peaks import LayerPeaks
from bertology.testing import ANALYZER_CHECKS, AnalyzerContract, assert_same_result, check_analyzer, parametrize_with_checks

#: Settings that keep contract runs small and exercise the statistics (an option of any family by these names).
CONTRACT_SETTINGS = {"bootstrap": 200, "head_distance_sample": 0.7, "tau": 1.0, "seed": 3, "correction": "fdr_bh", "punct": "upos", "parser": "gold"}


def family_analyzers():
    """``family:analyzer`` -> a factory of that analyzer for a kind of model, as the family builds it for a run (after its
    ``prepare``)."""
    for family in registered().values():
        settings = {**{option.name: option.default for option in family.options}, **CONTRACT_SETTINGS}
        family.prepare(settings)
        kind = ENCODER if "encoder" in family.kinds else DECODER
        for key in family.analyzers(settings, kind):
            yield f"{family.name}:{key}", lambda kind, family=family, key=key, settings=settings: family.analyzers(settings, kind)[key]


#: The contract's models: two encoders and two decoders (GPT-2: no BOS, Conv1D; Llama: BOS, grouped-query), all in float64.
CONTRACT_MODELS = {"bert": ENCODER, "roberta": ENCODER, "gpt2": DECODER, "llama": DECODER}


def runs_on(name: str, model: str) -> bool:
    """Whether analyzer ``family:key`` has a meaning on the contract model (a family says on which kinds it has one)."""
    family = registered().get(name.split(":")[0])
    return family is None or family.fits(CONTRACT_MODELS[model]) is None


def first_kind(name: str):
    """A kind of model analyzer ``name`` runs on."""
    return next(CONTRACT_MODELS[model] for model in CONTRACT_MODELS if runs_on(name, model))


FRAMES_EXAMPLE = Path(str(resources.files("bertology") / "data" / "frames_example.jsonl"))
ANALYZERS = {**dict(family_analyzers()), "layer_peaks": lambda kind: LayerPeaks(kind, bootstrap=200, seed=4)}
WITHOUT_TREES = {"layer_peaks"}
COVERED_ELSEWHERE = {
    "similarity": "tests/test_comparison.py::test_similarity_contract (needs two models)",
    "side": "an adapter that feeds one side of a model pair to an analyzer tested here",
    "induction_replicates": "tests/studies/track/test_induction.py::test_induction_replicates_pass_the_analyzer_contract (track's, "
                            "with bootstrap replicates)",
    "sequence_maps": "tests/studies/track/test_induction.py::test_sequence_maps_pass_the_analyzer_contract (track's, one probe "
                     "sequence's maps)",
}




def examples_for(name):
    if name.startswith("frames:"):  # frame-annotated sentences, half of them pairs of frames in one text
        examples = list(Corpus(FRAMES_EXAMPLE))[:8]
        return examples[:4] + [dataclasses.replace(a, frames=a.frames + b.frames) for a, b in zip(examples[4:], examples[4:])]
    examples = tiny_examples()
    if name == "patterns:labelled":  # hand labels of one map per input (the labels corpus)
        return [dataclasses.replace(e, pattern_label=(k % 2, k % 4, PATTERNS[k % 5])) for k, e in enumerate(examples)]
    return examples if name in WITHOUT_TREES else list(spacy_trees(examples))


def test_every_analyzer_is_registered_here():
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    import bertology.studies.compare.comparison  # noqa: F401  (registers the comparison analyzers)

    names = {cls.name for cls in subclasses(Analyzer) if cls.__module__.startswith("bertology.") and not inspect.isabstract(cls)}
    built = {factory(first_kind(name)).name for name, factory in ANALYZERS.items()} | set(COVERED_ELSEWHERE)
    assert names <= built, f"analyzers without a contract test: {names - built}"


@pytest.fixture(scope="module")
def contracts(bert64, roberta64, gpt2_64, llama64):
    """``(model, analyzer)`` -> its contract, made once per module: the one-batch run every rule compares against is shared."""
    made = {}

    def contract(model: str, name: str) -> AnalyzerContract:
        if (model, name) not in made:
            loaded = {"bert": bert64, "roberta": roberta64, "gpt2": gpt2_64, "llama": llama64}[model]
            made[model, name] = AnalyzerContract(partial(ANALYZERS[name], loaded.kind), loaded, examples_for(name), rtol=1e-9, atol=1e-12)
        return made[model, name]

    return contract


@pytest.mark.parametrize("check", ANALYZER_CHECKS)
@pytest.mark.parametrize(("model", "name"), [(model, name) for model in CONTRACT_MODELS for name in ANALYZERS if runs_on(name, model)])
def test_contract(model, name, check, contracts):
    getattr(contracts(model, name), f"check_{check}")()


def reads_maps(name: str) -> bool:
    """Whether analyzer ``family:key`` reads the maps, so that it runs under every view (the studies' own analyzers do too)."""
    family = registered().get(name.split(":")[0])
    return family is None or family.weighted


@pytest.fixture(scope="module")
def view_contracts(bert64, gpt2_64):
    made = {}

    def contract(view: str, model: str, name: str) -> AnalyzerContract:
        if (view, model, name) not in made:
            # value zeroing's 1 - cos of two nearly equal outputs magnifies float64 rounding (which padding moves) to about 1e-9,
            # which a head's excess over its uniform head (a difference of two such values) keeps as an absolute error
            rtol, atol = (1e-9, 1e-12) if view == "alti" else (1e-6, 1e-9)
            loaded = {"bert": bert64, "gpt2": gpt2_64}[model]
            made[view, model, name] = AnalyzerContract(partial(ANALYZERS[name], loaded.kind), loaded, examples_for(name), rtol=rtol, atol=atol,
                                                       weighting=view)
        return made[view, model, name]

    return contract


@pytest.mark.parametrize("check", ANALYZER_CHECKS)
@pytest.mark.parametrize(("view", "model", "name"), [(view, model, name) for view in ("alti", "value-zeroing") for model in ("bert", "gpt2")
                                                     for name in ANALYZERS if reads_maps(name) and runs_on(name, model)])
def test_contract_under_the_contribution_views(view, model, name, check, view_contracts):
    # every analyzer that reads the maps passes the contract on ALTI's and value zeroing's per-head maps too (BERT and GPT-2, float64)
    getattr(view_contracts(view, model, name), f"check_{check}")()


@parametrize_with_checks(analyzers=[lambda: ContextMixing(DECODER, ("alti", "value_zeroing"))])
def test_contract_of_the_mixing_shares_on_a_decoder(analyzer, check, gpt2_64):
    # on a decoder the mixing family runs with the contribution measures alone (Kobayashi's ratios take a post-norm block);
    # the public way a user checks an analyzer of their own: its checks share one run over the examples in one batch
    check(analyzer, gpt2_64, tiny_examples(), rtol=1e-6, atol=1e-12)


class OrderDependent(GeneralProfile):
    """A deliberately broken analyzer: it keeps only the last batch."""

    name = "broken_for_test"

    def finish_batch(self, batch):
        self._heads = None
        super().finish_batch(batch)


def test_the_contract_catches_a_broken_analyzer(tiny_bert):
    with pytest.raises(AssertionError, match="analyzer contract broken: batch size 1"):
        check_analyzer(partial(OrderDependent, ENCODER), tiny_bert, tiny_examples())


def test_head_distance_sample_is_fixed_by_text_and_seed(tiny_bert):
    from bertology.core.engine import Engine

    def rows(seed):
        analyzer = HeadDistance(sample=0.5, seed=seed)
        Engine(tiny_bert, progress=False).run(tiny_examples(), [analyzer])
        return analyzer._rows

    assert rows(1) == rows(1)
    assert len({rows(seed) for seed in range(6)}) > 1
    result = HeadDistance(sample=1.0)
    Engine(tiny_bert, progress=False).run(tiny_examples(), [result])
    table = result.result()
    assert isinstance(table, pd.DataFrame) and len(table) == 8 * 8
    assert (table.query("layer_a == layer_b and head_a == head_b").distance.abs() < 1e-12).all()
    assert set(result.embedding().columns) == {"layer", "head", "x", "y"}


def test_pattern_examples_do_not_depend_on_batching(tiny_bert):
    from bertology.core.engine import Engine

    def kept(batch_size, examples):
        analyzer = HeadPatterns(examples_per_class=3, seed=2)
        Engine(tiny_bert, batch_size=batch_size, progress=False).run(examples, [analyzer])
        return {p: [(e.layer, e.head, e.text) for e in items] for p, items in analyzer.examples().items()}

    examples = tiny_examples()
    whole = kept(len(examples), examples)
    assert kept(1, examples[::-1]) == whole
    first, second = HeadPatterns(examples_per_class=3, seed=2), HeadPatterns(examples_per_class=3, seed=2)
    Engine(tiny_bert, batch_size=2, progress=False).run(examples[:5], [first])
    Engine(tiny_bert, batch_size=2, progress=False).run(examples[5:], [second])
    assert {p: [(e.layer, e.head, e.text) for e in items] for p, items in first.merge(second).examples().items()} == whole
    assert sum(len(items) for items in whole.values()) > 0


def test_pattern_examples_merge_when_both_shards_hold_the_same_sequence(tiny_bert):
    from bertology.core.engine import Engine

    shards = []
    for _ in range(2):
        analyzer = HeadPatterns(examples_per_class=2, seed=1)
        Engine(tiny_bert, progress=False).run(tiny_examples()[:3], [analyzer])
        shards.append(analyzer)
    merged = shards[0].merge(shards[1]).examples()
    assert all(len(items) <= 2 for items in merged.values())


def split_over(loaded, first: str, second: str):
    """A copy of ``loaded`` whose first half of layers (and every module before them: the embeddings) runs on ``first`` and
    the rest on ``second``, through accelerate's hooks, as ``--device-map`` over two GPUs places a model: each layer's maps
    are computed and reduced on its own device (issue 40). ``main_device="cpu"`` keeps a layer mapped to the CPU running
    there rather than offloaded to the GPU, so one GPU and the CPU make two devices."""
    import copy

    from accelerate import dispatch_model

    model = copy.deepcopy(loaded.model)
    layers_name = next(name for name, module in model.named_modules()
                       if isinstance(module, torch.nn.ModuleList) and len(module) == loaded.num_layers)
    device_map, seen_layers = {}, False

    def cover(prefix: str, module) -> None:
        nonlocal seen_layers
        for name, child in module.named_children():
            full = prefix + name
            if full == layers_name:
                seen_layers = True
                device_map.update({f"{full}.{i}": first if i < len(child) // 2 else second for i in range(len(child))})
            elif layers_name.startswith(full + "."):
                cover(full + ".", child)
            else:
                device_map[full] = second if seen_layers else first

    cover("", model)
    placed = dataclasses.replace(loaded, model=dispatch_model(model, device_map, main_device="cpu", force_hooks=True))
    placed.device = model.get_input_embeddings().weight.device
    return placed


def examples_without_spacy(name):
    """:func:`examples_for`'s, with gold flat trees (conftest's ``gold_example``) where it would parse with spaCy, which a GPU
    machine may lack."""
    if name in WITHOUT_TREES or name.startswith("frames:") or name == "patterns:labelled":
        return examples_for(name)
    tags = ("DET", "NOUN", "VERB", "ADP", "PUNCT")
    return [gold_example(line, text, " ".join(tags[k % len(tags)] for k in range(len(text.split())))) for line, text in enumerate(TEXTS)]


SPLITS = {"cuda-then-cpu": ("cuda:0", "cpu"), "cpu-then-cuda": ("cpu", "cuda:0")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="two devices: a CUDA device beside the CPU")
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize(("model", "name"), [(model, name) for model in ("bert", "llama") for name in ANALYZERS if runs_on(name, model)])
def test_a_model_spread_over_two_devices_gives_the_same_table(model, name, split, bert64, llama64):
    """Every analyzer on a model whose layers run on two devices (each layer's maps reduced on its own device, the batch's
    masks moved there once) gives the table of the model on one device, in the layer-by-layer pass, the stacked pass and,
    where it folds them, by blocks of query rows. The models are float64, but Llama computes its rotary cos and sin in float32
    whatever the weights' dtype (transformers' ``LlamaRotaryEmbedding``), on whichever device runs it: a GPU's float32 cosine
    differs from the CPU's by about an ulp (6e-8), which moved Llama's tables by up to 1.6e-7 relative on an H200 (BERT's
    agreed to 1e-7); hence rtol 1e-5."""
    loaded = {"bert": bert64, "llama": llama64}[model]
    make, examples = partial(ANALYZERS[name], loaded.kind), examples_without_spacy(name)
    placed = split_over(loaded, *SPLITS[split])
    whole = AnalyzerContract(make, loaded, examples).whole.result()
    spread = AnalyzerContract(make, placed, examples)
    assert_same_result(whole, spread.whole.result(), "spread over two devices", rtol=1e-5, atol=1e-9)
    assert_same_result(whole, spread.run(examples, 3, layerwise=False).result(), "spread over two devices, stacked", rtol=1e-5, atol=1e-9)
    if folds_row_blocks(make()):
        assert_same_result(whole, spread.run(examples, len(examples), query_block=3).result(), "spread over two devices, by blocks",
                           rtol=1e-5, atol=1e-9)
