"""The analyzer contract, checked the way scikit-learn's ``check_estimator`` checks estimators.

``check_analyzer(make_analyzer, model, examples)`` runs a fresh analyzer from ``make_analyzer()``
over ``examples`` several ways and asserts that the result does not depend on batch size or
order, that ``merge`` of two halves equals one run over the whole, that merging an empty
analyzer changes nothing, that the analyzer survives pickling (for shipping to cluster workers),
and that the same seed gives the same result. Every analyzer in bertology must pass it.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable, Sequence

import pandas as pd

from bertology.core.analyzer import Analyzer
from bertology.core.corpora import Example
from bertology.core.engine import Engine
from bertology.core.models import LoadedModel


def _runner(model: LoadedModel, compare_with: LoadedModel | None):
    def run(make_analyzer: Callable[[], Analyzer], examples: Sequence[Example], batch_size: int) -> Analyzer:
        analyzer = make_analyzer()
        engine = Engine(model, batch_size=batch_size, progress=False)
        if compare_with is not None:
            from bertology.core.paired import CompareEngine

            engine = CompareEngine(engine, Engine(compare_with, batch_size=batch_size, progress=False))
        engine.run(examples, [analyzer])
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


def check_analyzer(make_analyzer: Callable[[], Analyzer], model: LoadedModel, examples: Sequence[Example], seed: int = 0,
                   rtol: float = 1e-4, atol: float = 1e-6, compare_with: LoadedModel | None = None) -> None:
    """Assert the analyzer contract (see the module docstring); raises AssertionError naming the broken rule.

    The tolerances absorb the float rounding that padding causes in a float32 model; with a
    float64 model much tighter ones hold. With ``compare_with``, the analyzer is a comparison
    analyzer fed by a :class:`~bertology.studies.compare.comparison.CompareEngine` of the two models.
    """
    _run = _runner(model, compare_with)
    examples = list(examples)
    if len(examples) < 4:
        raise ValueError("check_analyzer needs at least 4 examples")
    whole = _run(make_analyzer, examples, batch_size=len(examples))
    expected = whole.result()
    if expected.empty:
        raise AssertionError("analyzer contract broken: the result of a run over data is empty")
    for batch_size in (1, 3):
        actual = _run(make_analyzer, examples, batch_size).result()
        assert_same_result(expected, actual, f"batch size {batch_size} differs from one batch", rtol, atol)
    shuffled = examples[:]
    random.Random(seed).shuffle(shuffled)
    assert_same_result(expected, _run(make_analyzer, shuffled, 2).result(), "shuffled order differs", rtol, atol)
    half = len(examples) // 2
    first, second = _run(make_analyzer, examples[:half], 2), _run(make_analyzer, examples[half:], 3)
    assert_same_result(expected, first.merge(second).result(), "merge of two halves differs from the whole", rtol, atol)
    assert_same_result(expected, _run(make_analyzer, examples, 2).merge(make_analyzer()).result(), "merging an empty analyzer changed the result", rtol, atol)
    assert_same_result(expected, make_analyzer().merge(_run(make_analyzer, examples, 2)).result(), "merging into an empty analyzer differs", rtol, atol)
    assert_same_result(expected, pickle.loads(pickle.dumps(whole)).result(), "pickling changed the result", rtol, atol)
    again = _run(make_analyzer, examples, batch_size=len(examples)).result()
    pd.testing.assert_frame_equal(_canonical(expected), _canonical(again), check_exact=True)
