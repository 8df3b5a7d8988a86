"""Named checks of the contracts every family, study and analyzer passes, a user's own too.

In the idiom of scikit-learn's ``sklearn.utils.estimator_checks`` (``parametrize_with_checks``, ``check_estimator``).

- :mod:`bertology.testing.families`: :data:`FAMILY_CHECKS`, ``check(family, model=None, corpus=None, **settings)``;
- :mod:`bertology.testing.studies`: :data:`STUDY_CHECKS`, ``check(study, **given)``;
- :mod:`bertology.testing.analyzers`: :data:`ANALYZER_CHECKS`, ``check(make_analyzer, model, examples, **options)``.

In a test file, :func:`parametrize_with_checks` gives each check of each object its own test id (``first_piece-tables_declared``)::

    from bertology.testing import parametrize_with_checks

    @parametrize_with_checks(families=[FirstPiece()])
    def test_first_piece(family, check):
        check(family, model="tests/tiny-bert", corpus="tests/sentences.txt")

In a notebook, :func:`check_family`, :func:`check_study` and :func:`check_analyzer` run them all at once. A check that does
not apply (a family without a command, a study that writes no run folder) raises :class:`unittest.SkipTest`, which pytest
reports as a skip. Nothing else in bertology imports this package: it sits on top of every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from unittest import SkipTest

from bertology.core.errors import BertologyError
from bertology.families import Family
from bertology.studies import Study
from bertology.testing.analyzers import ANALYZER_CHECKS, AnalyzerContract, assert_same_result, check_analyzer
from bertology.testing.families import FAMILY_CHECKS
from bertology.testing.studies import STUDY_CHECKS

__all__ = ["ANALYZER_CHECKS", "FAMILY_CHECKS", "STUDY_CHECKS", "AnalyzerContract", "assert_same_result", "check_analyzer", "check_family",
           "check_study", "parametrize_with_checks"]


def _analyzer_name(make_analyzer: Callable) -> str:
    """The ``name`` of the analyzers ``make_analyzer`` makes: the class's own, else that of one made."""
    name = getattr(make_analyzer, "name", None)
    return name if isinstance(name, str) else make_analyzer().name


def parametrize_with_checks(families: Iterable[Family] = (), studies: Iterable[Study] = (), analyzers: Iterable[Callable] = ()):
    """A ``pytest.mark.parametrize`` over every (object, check) pair of one kind, with ids ``NAME-CHECK``: the test function
    takes ``family``, ``study`` or ``analyzer`` (a factory of the analyzer: its class, or a function) and ``check``, and calls
    ``check`` with the object and its inputs (see the module docstring)."""
    import pytest  # a test extra: only a test suite calls this

    kinds = {"family": (list(families), FAMILY_CHECKS, lambda family: family.name),
             "study": (list(studies), STUDY_CHECKS, lambda study: study.name),
             "analyzer": (list(analyzers), ANALYZER_CHECKS, _analyzer_name)}
    given = [kind for kind, (subjects, _, _) in kinds.items() if subjects]
    if len(given) != 1:
        raise BertologyError("parametrize_with_checks: give one of families, studies or analyzers (their checks take different inputs), "
                             f"not {' and '.join(given) or 'none'}")
    subjects, checks, name_of = kinds[given[0]]
    pairs = [(subject, check) for subject in subjects for check in checks.values()]
    ids = [f"{name_of(subject)}-{name}" for subject in subjects for name in checks]
    return pytest.mark.parametrize((given[0], "check"), pairs, ids=ids)


def _outcomes(checks: dict[str, Callable], subject, *inputs, **given) -> dict[str, str]:
    outcomes = {}
    for name, check in checks.items():
        try:
            check(subject, *inputs, **given)
        except SkipTest as skip:
            outcomes[name] = f"skipped: {skip}"
        else:
            outcomes[name] = "passed"
    return outcomes


def check_family(family: Family, model=None, corpus=None, **settings) -> dict[str, str]:
    """Run every check of :data:`FAMILY_CHECKS` on ``family`` run on ``model`` over ``corpus`` with ``settings`` (as
    ``analyze()`` takes them; None: the bundled model and sample); raises AssertionError at the first broken rule, else returns
    each check's outcome by name: ``passed``, or ``skipped: why``."""
    return _outcomes(FAMILY_CHECKS, family, model, corpus, **settings)


def check_study(study: Study, **given) -> dict[str, str]:
    """Run every check of :data:`STUDY_CHECKS` on ``study`` with its small inputs ``given`` (its options by name), each into a
    fresh temporary folder (``out`` is left out); raises AssertionError at the first broken rule, else returns each check's
    outcome by name: ``passed``, or ``skipped: why``."""
    return _outcomes(STUDY_CHECKS, study, **{name: value for name, value in given.items() if name != "out"})
