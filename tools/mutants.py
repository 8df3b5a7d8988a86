"""Mutation check of bertology's numeric core: do the tests catch realistic one-line bugs?

Each mutation in :data:`MUTATIONS` is a one-line bug of the kind a tired author writes (an off-by-one
window, a dropped weight, a wrong percentile, a mean instead of a sum). They are applied one at a
time to a temporary copy of ``src/`` and ``tests/`` (a sibling of the checkout, so ``../shared``
resolves as in CI), and the test files that should catch each are run against the copy. A mutation
is *killed* when those tests fail. Prints one line per mutation and the kill rate; exits non-zero
below ``--target``. Not part of CI: a full run takes about 15-25 minutes on two cores.

    .venv/bin/python tools/mutants.py [--only SUBSTRING ...] [--target 0.9] [--timeout 600]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "src/bertology"


@dataclass(frozen=True)
class Mutation:
    """Replace ``old`` (which must occur exactly once in ``path``) by ``new``; ``tests`` should then fail."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


PROFILE_TESTS = ("tests/families/profile/test_profile.py",)
ROLE_TESTS = ("tests/families/roles/test_roles.py",)
SYNTAX_TESTS = ("tests/families/syntax/test_syntax.py",)
PATTERN_TESTS = ("tests/families/patterns/test_patterns.py",)
STATS_TESTS = ("tests/core/statistics/test_stats.py",)
ALIGNMENT_TESTS = ("tests/core/text/test_alignment.py",)
IMPORTANCE_TESTS = ("tests/studies/heads/test_importance.py",)
DYNAMICS_TESTS = ("tests/studies/track/test_dynamics.py",)
PEAK_TESTS = ("tests/studies/track/test_peaks.py",)
MIXING_TESTS = ("tests/families/mixing/test_mixing_contributions.py",)

PROFILE = f"{PACKAGE}/families/profile/analyzer.py"
ROLES = f"{PACKAGE}/families/roles/analyzer.py"
SYNTAX = f"{PACKAGE}/families/syntax/analyzer.py"
PATTERNS = f"{PACKAGE}/families/patterns/analyzer.py"
STATS = f"{PACKAGE}/core/statistics/stats.py"
ALIGNMENT = f"{PACKAGE}/core/text/alignment.py"
MODELS = f"{PACKAGE}/core/model/models.py"
IMPORTANCE = f"{PACKAGE}/studies/heads/importance.py"
PRUNING = f"{PACKAGE}/studies/heads/pruning.py"
VERDICTS = f"{PACKAGE}/studies/track/verdicts.py"
HYPOTHESIS = f"{PACKAGE}/studies/track/hypothesis.py"
PEAKS = f"{PACKAGE}/studies/track/peaks.py"
CONTRIBUTIONS = f"{PACKAGE}/core/measures/contributions.py"

MUTATIONS = [
    # the mixing family's rollout of contributions (METHODS.md, norms and mixing)
    Mutation("mixing: rollout multiplied in the wrong order", CONTRIBUTIONS, "torch.matmul(contributions, previous)",
             "torch.matmul(previous, contributions)", MIXING_TESTS),
    # Clark et al.'s profile (METHODS.md section 1)
    Mutation("profile: entropy smoothing 1e-3 instead of 1e-4", PROFILE, "ENTROPY_SMOOTHING = 1e-4", "ENTROPY_SMOOTHING = 1e-3", PROFILE_TESTS),
    Mutation("profile: entropy of the unsmoothed map", PROFILE, "-torch.xlogy(smoothed, smoothed, out=smoothed)", "-torch.xlogy(attention, attention)",
             PROFILE_TESTS),
    Mutation("profile: previous token on the wrong diagonal", PROFILE, '"prev": attention.diagonal(offset=-1', '"prev": attention.diagonal(offset=1',
             PROFILE_TESTS),
    Mutation("profile: signed distance", PROFILE, "gap = (positions[:, None] - positions[None, :]).abs().to(dtype)",
             "gap = (positions[:, None] - positions[None, :]).to(dtype)", PROFILE_TESTS),
    Mutation("profile: attention FROM the token set instead of TO it", PROFILE, "attention[..., start:, :].sum(dim=-2), members",
             "attention[..., start:, :].sum(dim=-1), members", PROFILE_TESTS),
    Mutation("track: layer peaks interval 90% instead of 95%", PEAKS, "np.nanpercentile(means[1:], [2.5, 97.5], axis=0)",
             "np.nanpercentile(means[1:], [5, 95], axis=0)", PEAK_TESTS),
    Mutation("track: peak-layer interval 90% instead of 95%", PEAKS, "np.percentile(peaks[1:], [2.5, 97.5], axis=0)",
             "np.percentile(peaks[1:], [5, 95], axis=0)", PEAK_TESTS + DYNAMICS_TESTS),
    Mutation("punctuation: Clark's set misses the comma", MODELS, '_CLARK_PUNCT = (".", ",")', '_CLARK_PUNCT = (".",)', PROFILE_TESTS),
    Mutation("punctuation: upos set is ASCII punctuation only (string.punctuation)", MODELS,
             'return bool(piece) and all(unicodedata.category(ch).startswith("P") for ch in piece)',
             'return bool(piece) and all(ch in __import__("string").punctuation for ch in piece)', PROFILE_TESTS),
    # word-level attention (METHODS.md section 2)
    Mutation("alignment: rows of a split word summed instead of averaged (torch)", ALIGNMENT, "return means @ attention @ sums.T",
             "return sums @ attention @ sums.T", ALIGNMENT_TESTS + SYNTAX_TESTS),
    Mutation("alignment: columns of a split word averaged instead of summed (numpy)", ALIGNMENT, "return row_mean @ attention @ assignment.T",
             "return row_mean @ attention @ row_mean.T", ALIGNMENT_TESTS),
    Mutation("alignment: a straddling piece counts whole for every word", ALIGNMENT, "(first_word[segment] + k, common / total)",
             "(first_word[segment] + k, 1.0)", ALIGNMENT_TESTS),
    # Pande et al.'s roles (METHODS.md section 5)
    Mutation("roles: local window |i-j| < 2 instead of <= 2", ROLES, "near = (positions[:, None] - positions[None, :]).abs() <= window",
             "near = (positions[:, None] - positions[None, :]).abs() < window", ROLE_TESTS),
    Mutation("roles: block without its entropy weight", ROLES,
             "block[pairs] = sieve_mean(own, sizes.gather(2, segment[..., None])[..., 0], queries[pairs], reference[pairs], weight=entropy)",
             "block[pairs] = sieve_mean(own, sizes.gather(2, segment[..., None])[..., 0], queries[pairs], reference[pairs])", ROLE_TESTS),
    Mutation("roles: block queries leave out the special tokens", ROLES,
             "block[pairs] = sieve_mean(own, sizes.gather(2, segment[..., None])[..., 0], queries[pairs], reference[pairs], weight=entropy)",
             "block[pairs] = sieve_mean(own, sizes.gather(2, segment[..., None])[..., 0], (queries & ~every)[pairs], reference[pairs], weight=entropy)",
             ROLE_TESTS),
    Mutation("roles: delimiter sieve without [CLS]", ROLES, "key_sets = torch.stack([every, *alone,",
             "key_sets = torch.stack([anchors.get(\"sep\", every), *alone,", ROLE_TESTS),
    Mutation("roles: syntactic attention from the head to the dependent", ROLES, "pair_attention[:, :, word_unit[word], word_unit[head - 1]]",
             "pair_attention[:, :, word_unit[head - 1], word_unit[word]]", ROLE_TESTS),
    Mutation("roles: labels from the raw p, not the corrected one", ROLES,
             'frame["p_adj"], frame["has_role"] = corrected(frame.p, correction or self.correction, self.alpha if alpha is None else alpha)',
             'frame["p_adj"], frame["has_role"] = frame.p, frame.p < 0.05', ROLE_TESTS),
    # statistics
    Mutation("stats: Chan's merge without the squared mean difference", STATS, "self.m2 + m2 + delta**2 * self.count * count / total",
             "self.m2 + m2 + delta * self.count * count / total", STATS_TESTS),
    Mutation("stats: one-sided t quantile for a two-sided interval", STATS, "stats.t.ppf((1 + level) / 2, self.count - 1)",
             "stats.t.ppf(level, self.count - 1)", STATS_TESTS),
    Mutation("stats: t-test with n degrees of freedom", STATS, "stats.t.sf(t, moments.count - 1)", "stats.t.sf(t, moments.count)", STATS_TESTS + ROLE_TESTS),
    Mutation("stats: no guard for a mean at tau", STATS, "np.where(at_tau, 0.0, t)", "t", STATS_TESTS + ROLE_TESTS),
    Mutation("stats: paired bootstrap interval 90% instead of 95%", STATS, "np.percentile(deltas, [2.5, 97.5], axis=1)",
             "np.percentile(deltas, [5, 95], axis=1)", STATS_TESTS + IMPORTANCE_TESTS),
    Mutation("stats: paired bootstrap p one-sided", STATS, "np.minimum(1.0, 2 * tail / (1 + replicates))", "np.minimum(1.0, tail / (1 + replicates))",
             STATS_TESTS + IMPORTANCE_TESTS),
    Mutation("stats: F1 without the factor 2", STATS, "2 * diagonal / (true + predicted)", "diagonal / (true + predicted)", STATS_TESTS),
    Mutation("stats: bootstrap keyed by the file name", STATS, "return example.line, example.text, example.text_pair",
             "return example.source, example.text, example.text_pair", STATS_TESTS + SYNTAX_TESTS),
    # Clark et al.'s syntactic heads (METHODS.md section 3)
    Mutation("syntax: argmax may pick the dependent itself", SYNTAX, "allowed[torch.arange(len(dependent_units)), dependent_units] = False",
             "allowed[torch.arange(len(dependent_units)), dependent_units] = True", SYNTAX_TESTS),
    Mutation("syntax: argmax may pick [CLS]/[SEP]", SYNTAX, "allowed = is_word[None, :].expand(len(dependent_units), units).clone()",
             "allowed = torch.ones_like(is_word)[None, :].expand(len(dependent_units), units).clone()", SYNTAX_TESTS),
    Mutation("syntax: head->dep reads the dependent's row", SYNTAX, "head_to_dep = word_maps[:, :, :, dependent_units].transpose(-1, -2)",
             "head_to_dep = word_maps[:, :, dependent_units, :]", SYNTAX_TESTS),
    Mutation("syntax: offset baseline in the wrong direction", SYNTAX, "(torch.as_tensor(dependents)[:, None] + offsets[None, :])",
             "(torch.as_tensor(dependents)[:, None] - offsets[None, :])", SYNTAX_TESTS),
    Mutation("syntax: bootstrap interval 90% instead of 95%", SYNTAX, "np.percentile(replicates[0][valid], 2.5)",
             "np.percentile(replicates[0][valid], 5)", SYNTAX_TESTS),
    Mutation("syntax: ties report only the first best head", SYNTAX, "tied = np.flatnonzero(accuracy[0, :width] == np.fmax.reduce(accuracy[0, :width]))",
             "tied = np.atleast_1d(np.argmax(accuracy[0, :width]))", SYNTAX_TESTS),
    Mutation("syntax: p-value ignores ties", SYNTAX, "np.sum(difference <= 0)", "np.sum(difference < 0)", SYNTAX_TESTS),
    # Kovaleva et al.'s patterns (METHODS.md section 4)
    Mutation("patterns: block feature averaged over special queries too", PATTERNS, "queries = (segment_ids >= 0).to(attention.dtype)[:, None]",
             "queries = mask.to(attention.dtype)[:, None]", PATTERN_TESTS),
    Mutation("patterns: vertical adds every other column", PATTERNS, "masked_fill(special[:, None] | ~mask[:, None], 0.0).amax(-1)",
             "masked_fill(special[:, None] | ~mask[:, None], 0.0).sum(-1)", PATTERN_TESTS),
    Mutation("patterns: mixed rule against the wrong threshold", PATTERNS, "(vertical + diagonal >= t.mixed_total)", "(vertical + diagonal >= t.mixed_min)",
             PATTERN_TESTS),
    # Michel et al.'s importance (METHODS.md section 6)
    Mutation("importance: signed instead of absolute gradient", IMPORTANCE, "total += gradient.abs().sum(1)", "total += gradient.sum(1).abs()",
             IMPORTANCE_TESTS),
    Mutation("importance: l2 norm over the wrong axis", IMPORTANCE, "norms = np.linalg.norm(importance, axis=1, keepdims=True)",
             "norms = np.linalg.norm(importance, axis=0, keepdims=True)", IMPORTANCE_TESTS),
    Mutation("importance: pruning ranks raw importance", PRUNING, "importance = normalise_importance(scorer.attribute(importance_rows, mask), normalise)",
             "importance = scorer.attribute(importance_rows, mask)", IMPORTANCE_TESTS),
    # training dynamics (METHODS.md section 8)
    Mutation("dynamics: half of the final value instead of half of the rise", VERDICTS, "target = first + 0.5 * (final - first)", "target = 0.5 * final",
             DYNAMICS_TESTS),
    Mutation("dynamics: crossing mapped back with exp, not expm1", VERDICTS, "crossed = np.expm1(", "crossed = np.exp(", DYNAMICS_TESTS),
    Mutation("dynamics: ties count as in order", HYPOTHESIS, "np.all(np.diff(values, axis=-1) > 0, axis=-1)", "np.all(np.diff(values, axis=-1) >= 0, axis=-1)",
             DYNAMICS_TESTS),
]


def run_tests(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float]:
    """Run ``tests`` in ``copy`` with its own ``src`` first on the path: ``passed``, ``failed``, ``error`` or ``timeout``."""
    env = dict(os.environ, PYTHONPATH=str(copy / "src"), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    started = time.perf_counter()
    try:
        finished = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - started
    outcome = {0: "passed", 1: "failed"}.get(finished.returncode, "error")
    return outcome, time.perf_counter() - started


def apply(copy: Path, mutation: Mutation) -> str:
    """Write the mutated file into ``copy``; returns the original text."""
    path = copy / mutation.path
    original = path.read_text()
    found = original.count(mutation.old)
    if found != 1:
        raise SystemExit(f"{mutation.path}: mutation {mutation.name!r} matches {found} times (needs exactly 1): update tools/mutants.py")
    path.write_text(original.replace(mutation.old, mutation.new))
    return original


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="run only mutations whose name contains this (repeat it for several)")
    parser.add_argument("--target", type=float, default=0.9, help="minimum kill rate (default 0.9)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per test run")
    parser.add_argument("--list", action="store_true", help="check that every mutation applies, list them and stop")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or any(part in m.name for part in args.only)]
    copy = Path(tempfile.mkdtemp(prefix=".bertology-mutants-", dir=REPO.parent))
    try:
        for part in ("src", "tests", "pyproject.toml"):
            source = REPO / part
            (shutil.copytree if source.is_dir() else shutil.copy2)(source, copy / part)
        for mutation in chosen:  # every mutation's target must be there before anything runs
            apply(copy, mutation)
            shutil.copy2(REPO / mutation.path, copy / mutation.path)
        if args.list:
            print("\n".join(f"{m.name}  ({m.path}; {' '.join(m.tests)})" for m in chosen))
            print(f"{len(chosen)} mutations apply")
            return 0
        all_tests = tuple(sorted({test for m in chosen for test in m.tests}))
        outcome, seconds = run_tests(copy, all_tests, args.timeout * 3)
        print(f"baseline (no mutation): {outcome} in {seconds:.0f} s", flush=True)
        if outcome != "passed":
            print("the unmutated tests must pass first", file=sys.stderr)
            return 2
        killed = 0
        for k, mutation in enumerate(chosen, 1):
            original = apply(copy, mutation)
            try:
                outcome, seconds = run_tests(copy, mutation.tests, args.timeout)
            finally:
                (copy / mutation.path).write_text(original)
            caught = outcome != "passed"
            killed += caught
            print(f"{k:3d}/{len(chosen)} {'killed ' if caught else 'SURVIVED'} ({outcome}, {seconds:4.0f} s) {mutation.name}", flush=True)
        rate = killed / len(chosen) if chosen else 0.0
        print(f"kill rate: {killed}/{len(chosen)} = {rate:.1%} (target {args.target:.0%})")
        return 0 if rate >= args.target else 1
    finally:
        shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
