"""Every analyzer passes the same contract (bertology.testing.check_analyzer)."""

import pandas as pd
import pytest

from bertology.analyzers import Analyzer, GeneralProfile, HeadDistance
from bertology.analyzers.syntax import RelationHeads
from bertology.parsing import spacy_trees
from bertology.probes import ProbeData
from bertology.testing import check_analyzer
from conftest import tiny_examples

ANALYZERS = {
    "general_profile": lambda: GeneralProfile(),
    "head_distance": lambda: HeadDistance(sample=0.7, seed=3),
    "relation_heads": lambda: RelationHeads(bootstrap=200, seed=5),
    "probe_data": lambda: ProbeData(),
}
NEEDS_TREES = {"relation_heads", "probe_data"}


def examples_for(name):
    examples = tiny_examples()
    return list(spacy_trees(examples)) if name in NEEDS_TREES else examples


def test_every_analyzer_is_registered_here():
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    names = {cls.name for cls in subclasses(Analyzer) if cls.__module__.startswith("bertology.")}
    built = {factory().name for factory in ANALYZERS.values()}
    assert names <= built, f"analyzers without a contract test: {names - built}"


@pytest.mark.parametrize("name", ANALYZERS)
def test_contract(name, tiny_bert):
    check_analyzer(ANALYZERS[name], tiny_bert, examples_for(name))


@pytest.mark.parametrize("name", ANALYZERS)
def test_contract_roberta(name, tiny_roberta):
    check_analyzer(ANALYZERS[name], tiny_roberta, examples_for(name))


class OrderDependent(GeneralProfile):
    """A deliberately broken analyzer: it keeps only the last batch."""

    name = "broken_for_test"

    def update(self, batch):
        self._heads = None
        super().update(batch)


def test_the_contract_catches_a_broken_analyzer(tiny_bert):
    with pytest.raises(AssertionError, match="analyzer contract broken: batch size 1"):
        check_analyzer(OrderDependent, tiny_bert, tiny_examples())


def test_head_distance_sample_is_fixed_by_text_and_seed(tiny_bert):
    from bertology.engine import Engine

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
