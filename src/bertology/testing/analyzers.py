"""The analyzer contract, checked the way scikit-learn's ``check_estimator`` checks estimators.

``check_analyzer(make_analyzer, model, examples)`` runs a fresh analyzer from ``make_analyzer()`` over ``examples``
several ways and asserts that the result does not depend on batch size, on batches packed by tokens, or on order, that
``merge`` of two halves equals one run over the whole, that merging an empty analyzer changes nothing, that the analyzer
survives pickling (for shipping to cluster workers), that the layer-by-layer pass equals the one that stacks every
layer's maps, that maps computed by blocks of query rows give what whole maps give (or that an analyzer that needs whole
maps is refused there in one line naming it), and that the same seed gives the same result.

Each rule is also a check of its own in :data:`ANALYZER_CHECKS` (``check(make_analyzer, model, examples, **options)``);
the checks of one analyzer, model and examples share the one-batch run every rule compares against.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable, Sequence
from functools import wraps

import pandas as pd

from bertology.core.analyzer import Analyzer
from bertology.core.engine import Engine, folds_row_blocks
from bertology.core.errors import BertologyError
from bertology.core.model.models import LoadedModel
from bertology.core.text.corpora import Example
from bertology.testing.recent import Recent

#: The query rows per block of :meth:`AnalyzerContract.check_blocked_equals_whole`: fewer than any contract sequence's pieces,
#: and no divisor of most, so a layer comes as several blocks, the last one shorter, some holding padding rows.
CONTRACT_QUERY_BLOCK = 3


def _runner(model: LoadedModel, compare_with: LoadedModel | None, weighting: str = "attention"):
    def run(make_analyzer: Callable[[], Analyzer], examples: Sequence[Example], batch_size: int, layerwise: bool = True,
            batch_tokens: int | None = None, query_block: int | None = None) -> Analyzer:
        analyzer = make_analyzer()
        engine = Engine(model, batch_size=batch_size, batch_tokens=batch_tokens, progress=False, layerwise=layerwise, query_block=query_block)
        if compare_with is not None:
            from bertology.core.paired import CompareEngine

            engine = CompareEngine(engine, Engine(compare_with, batch_size=batch_size, progress=False))
        engine.run(examples, [analyzer], weightings=[weighting])
        return analyzer

    return run


def _canonical(table: pd.DataFrame) -> pd.DataFrame:
    keys = [c for c in table.columns if not pd.api.types.is_float_dtype(table[c])]
    return table.sort_values(keys).reset_index(drop=True) if keys else table.reset_index(drop=True)


def assert_same_result(expected: pd.DataFrame, actual: pd.DataFrame, what: str, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Tables equal up to row order and float tolerance (padding changes float rounding slightly)."""
    try:
        pd.testing.assert_frame_equal(_canonical(expected), _canonical(actual), check_exact=False, rtol=rtol, atol=atol, check_dtype=False)
    except AssertionError as exc:
        raise AssertionError(f"analyzer contract broken: {what}\n{exc}") from None


class AnalyzerContract:
    """The analyzer contract as named checks, in the idiom of scikit-learn's ``parametrize_with_checks``: each rule of
    the module docstring is one method ``check_NAME`` (listed in :data:`ANALYZER_CHECKS`), so that a test suite can give each
    rule its own test id. The run over all examples in one batch, which every rule compares against, is made once.

    The tolerances absorb the float rounding that padding causes in a float32 model; with a float64 model much tighter
    ones hold. With ``compare_with``, the analyzer is a comparison analyzer fed by a
    :class:`~bertology.core.paired.CompareEngine` of the two models. ``weighting``: the view of attention the analyzer reads
    (:data:`~bertology.core.measures.norms.WEIGHTINGS`).
    """

    def __init__(self, make_analyzer: Callable[[], Analyzer], model: LoadedModel, examples: Sequence[Example], seed: int = 0,
                 rtol: float = 1e-4, atol: float = 1e-6, compare_with: LoadedModel | None = None, weighting: str = "attention"):
        self.make_analyzer, self.seed, self.rtol, self.atol = make_analyzer, seed, rtol, atol
        self.weighting, self.compared = weighting, compare_with is not None
        self.examples = list(examples)
        if len(self.examples) < 4:
            raise ValueError("the analyzer contract needs at least 4 examples")
        self._run = _runner(model, compare_with, weighting)
        self._whole: Analyzer | None = None

    def run(self, examples: Sequence[Example], batch_size: int, layerwise: bool = True, batch_tokens: int | None = None,
            query_block: int | None = None) -> Analyzer:
        return self._run(self.make_analyzer, examples, batch_size, layerwise, batch_tokens, query_block)

    @property
    def whole(self) -> Analyzer:
        """The analyzer after one run over every example in one batch."""
        if self._whole is None:
            self._whole = self.run(self.examples, len(self.examples))
        return self._whole

    def same(self, actual: pd.DataFrame, what: str) -> None:
        assert_same_result(self.whole.result(), actual, what, self.rtol, self.atol)

    def check_result_is_not_empty(self) -> None:
        if self.whole.result().empty:
            raise AssertionError("analyzer contract broken: the result of a run over data is empty")

    def check_batch_size_1(self) -> None:
        self.same(self.run(self.examples, 1).result(), "batch size 1 differs from one batch")

    def check_batch_size_3(self) -> None:
        self.same(self.run(self.examples, 3).result(), "batch size 3 differs from one batch")

    def check_packed_by_tokens(self) -> None:
        self.same(self.run(self.examples, len(self.examples), batch_tokens=48).result(), "batches packed by 48 tokens differ from one batch")

    def check_order(self) -> None:
        shuffled = self.examples[:]
        random.Random(self.seed).shuffle(shuffled)
        self.same(self.run(shuffled, 2).result(), "shuffled order differs")

    def check_merge_of_halves(self) -> None:
        half = len(self.examples) // 2
        first, second = self.run(self.examples[:half], 2), self.run(self.examples[half:], 3)
        self.same(first.merge(second).result(), "merge of two halves differs from the whole")

    def check_merge_with_empty(self) -> None:
        self.same(self.run(self.examples, 2).merge(self.make_analyzer()).result(), "merging an empty analyzer changed the result")

    def check_merge_into_empty(self) -> None:
        self.same(self.make_analyzer().merge(self.run(self.examples, 2)).result(), "merging into an empty analyzer differs")

    def check_pickling(self) -> None:
        self.same(pickle.loads(pickle.dumps(self.whole)).result(), "pickling changed the result")

    def check_layer_by_layer(self) -> None:
        """The layer-by-layer pass (each layer's maps handed over inside the forward pass) gives the table of the pass that
        stacks every layer's maps, to float32 rounding; an analyzer that is not layerwise runs the stacked pass either way."""
        stacked = self.run(self.examples, len(self.examples), layerwise=False).result()
        assert_same_result(stacked, self.whole.result(), "the layer-by-layer pass differs from the stacked one", rtol=1e-6, atol=1e-9)

    def check_blocked_equals_whole(self) -> None:
        """Maps computed by blocks of :data:`CONTRACT_QUERY_BLOCK` query rows (:attr:`~bertology.core.engine.LayerMaps.rows`)
        give the table of whole maps to rtol 1e-6, for an analyzer that folds blocks
        (:func:`~bertology.core.engine.folds_row_blocks`); any other is refused by such a pass, in one line that names it."""
        if folds_row_blocks(self.make_analyzer(), self.weighting) and not self.compared:
            blocked = self.run(self.examples, len(self.examples), query_block=CONTRACT_QUERY_BLOCK).result()
            assert_same_result(self.whole.result(), blocked, "maps by blocks of query rows differ from whole maps", rtol=1e-6, atol=1e-9)
            return
        name = getattr(self.make_analyzer(), "name", "")
        try:
            self.run(self.examples, len(self.examples), query_block=CONTRACT_QUERY_BLOCK)
        except BertologyError as exc:
            if name not in str(exc) or "\n" in str(exc):
                raise AssertionError(f"analyzer contract broken: the refusal of maps by blocks names not {name!r} in one line: {exc}") from None
            return
        raise AssertionError("analyzer contract broken: an analyzer that reads whole maps ran on maps by blocks of query rows")

    def check_same_seed_same_result(self) -> None:
        again = self.run(self.examples, len(self.examples)).result()
        try:
            pd.testing.assert_frame_equal(_canonical(self.whole.result()), _canonical(again), check_exact=True)
        except AssertionError as exc:
            raise AssertionError(f"analyzer contract broken: the same seed gave another result\n{exc}") from None


#: The rules of the analyzer contract, by name, in the order :func:`check_analyzer` runs them.
RULES = tuple(name.removeprefix("check_") for name in vars(AnalyzerContract) if name.startswith("check_"))

#: The contracts of the analyzers checked last, so that their checks share the run over every example in one batch.
_contracts = Recent()


def contract_for(make_analyzer: Callable[[], Analyzer], model: LoadedModel, examples: Sequence[Example], seed: int = 0, rtol: float = 1e-4,
                 atol: float = 1e-6, compare_with: LoadedModel | None = None, weighting: str = "attention") -> AnalyzerContract:
    """The contract of ``make_analyzer`` on ``model`` and ``examples``: the one made last for the same arguments, else a new one."""
    examples = tuple(examples)
    key = (make_analyzer, id(model), id(compare_with), examples, seed, rtol, atol, weighting)  # the contract holds both models: their ids stay theirs
    return _contracts.get(key, lambda: AnalyzerContract(make_analyzer, model, examples, seed, rtol, atol, compare_with, weighting))


def _check(rule: str) -> Callable:
    method = getattr(AnalyzerContract, f"check_{rule}")

    @wraps(method)
    def check(make_analyzer: Callable[[], Analyzer], model: LoadedModel, examples: Sequence[Example], **options) -> None:
        method(contract_for(make_analyzer, model, examples, **options))

    return check


#: The analyzer checks by rule: ``check(make_analyzer, model, examples, **options)``, the options those of :class:`AnalyzerContract`.
ANALYZER_CHECKS: dict[str, Callable] = {rule: _check(rule) for rule in RULES}


def check_analyzer(make_analyzer: Callable[[], Analyzer], model: LoadedModel, examples: Sequence[Example], seed: int = 0,
                   rtol: float = 1e-4, atol: float = 1e-6, compare_with: LoadedModel | None = None, weighting: str = "attention") -> None:
    """Assert every rule of the analyzer contract (see the module docstring and :class:`AnalyzerContract`); raises
    AssertionError naming the first broken rule."""
    contract = AnalyzerContract(make_analyzer, model, examples, seed, rtol, atol, compare_with, weighting)
    for rule in RULES:
        getattr(contract, f"check_{rule}")()
