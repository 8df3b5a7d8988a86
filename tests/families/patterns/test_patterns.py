import numpy as np
import pytest
import torch

from bertology.families.patterns.analyzer import PATTERNS, PatternThresholds, RuleClassifier, pattern_features


def masks(n, pair_at=None):
    mask = torch.ones(1, n, dtype=torch.bool)
    special = torch.zeros(1, n, dtype=torch.bool)
    special[0, [0, n - 1]] = True
    segments = torch.zeros(1, n, dtype=torch.long)
    segments[0, [0, n - 1]] = -1
    if pair_at is not None:
        special[0, pair_at] = True
        segments[0, pair_at] = -1
        segments[0, pair_at + 1 : n - 1] = 1
    return mask, special, segments


def classify(matrix, pair_at=None, thresholds=PatternThresholds()):
    n = matrix.shape[0]
    return PATTERNS[int(RuleClassifier(thresholds).classify(torch.tensor(matrix)[None, None], *masks(n, pair_at))[0, 0])]


N = 20


def vertical():
    a = np.zeros((N, N))
    a[:, 0] = 0.9
    a[:, 5] = 0.1
    return a


def diagonal():
    a = np.zeros((N, N))
    a[0, 0] = 1
    for i in range(1, N):
        a[i, i - 1] = 1
    return a


def vertical_and_diagonal():
    return 0.5 * vertical() + 0.5 * diagonal()


def block(pair_at=9):
    a = np.zeros((N, N))
    for i in range(N):
        if 0 < i < pair_at:
            a[i, 1:pair_at] = 1 / (pair_at - 1)
        elif pair_at < i < N - 1:
            a[i, pair_at + 1 : N - 1] = 1 / (N - 2 - pair_at)
        else:
            a[i] = 1 / N
    return a


@pytest.mark.parametrize("make, expected, pair_at", [
    (vertical, "vertical", None), (diagonal, "diagonal", None), (vertical_and_diagonal, "vertical+diagonal", None), (block, "block", 9),
])
def test_each_rule_recognises_its_class(make, expected, pair_at):
    assert classify(make(), pair_at) == expected


def test_random_dirichlet_maps_are_heterogeneous():
    rng = np.random.default_rng(0)
    for seed in range(20):
        assert classify(rng.dirichlet(np.ones(30), size=30)) == "heterogeneous"
        assert classify(rng.dirichlet(np.ones(30), size=30), pair_at=14) == "heterogeneous"


def test_block_needs_a_pair_and_thresholds_are_configurable():
    assert classify(block(), pair_at=None) == "heterogeneous"  # one sentence: no block
    weak = np.zeros((N, N))
    weak[:, 0] = 0.7
    weak[:, 1 : N - 1] = 0.3 / (N - 2)  # vertical mass 0.7 + 0.3 / 18
    assert classify(weak) == "vertical"
    assert classify(weak, thresholds=PatternThresholds(vertical=0.8)) == "heterogeneous"
    features = pattern_features(torch.tensor(vertical())[None, None], *masks(N))
    assert features["vertical"].item() == pytest.approx(1.0)  # [CLS] column 0.9 + heaviest other column 0.1
    assert features["diagonal"].item() == pytest.approx((0.9 + 0.1 + 0.1) / N)  # a[1,0], a[4,5], a[6,5]
    assert torch.isnan(features["block"]).all()


def features_by_hand(a: np.ndarray, pair_at: int) -> dict:
    """The rule features of one pair's map, written as plain loops: [CLS] = 0, sentence A 1..pair_at-1,
    [SEP] = pair_at, sentence B pair_at+1..n-2, [SEP] = n-1."""
    n = a.shape[0]
    specials = {0, pair_at, n - 1}
    sentence = {i: 0 if i < pair_at else 1 for i in range(n) if i not in specials}
    column = [sum(a[i, j] for i in range(n)) / n for j in range(n)]
    block = [sum(a[i, j] for j in sentence if sentence[j] == sentence[i]) for i in sentence]  # non-special queries only
    return {
        "vertical": sum(column[j] for j in specials) + max(column[j] for j in sentence),
        "diagonal": sum(a[i, i - 1] for i in range(1, n)) / n + sum(a[i, i + 1] for i in range(n - 1)) / n,
        "block": sum(block) / len(block),
    }


def test_block_feature_averages_over_the_non_special_queries_only():
    # a pure block map: every sentence token attends within its own sentence only (the specials spread evenly);
    # averaging over the 3 special queries too (their own-sentence mass is 0) would give 17 / 20 = 0.85
    features = pattern_features(torch.tensor(block())[None, None], *masks(N, pair_at=9))
    assert features["block"].item() == pytest.approx(1.0, abs=1e-12)
    assert classify(block(), pair_at=9) == "block"
    rng = np.random.default_rng(5)
    for pair_at in (4, 9, 15):
        a = rng.dirichlet(np.full(N, 0.3), size=N)
        features = pattern_features(torch.tensor(a)[None, None], *masks(N, pair_at=pair_at))
        expected = features_by_hand(a, pair_at)
        assert {name: value.item() for name, value in features.items()} == pytest.approx(expected, rel=1e-12)


def test_pattern_examples_do_not_depend_on_the_file_name(tiny_bert):
    from conftest import TEXTS

    from bertology.core.engine import Engine
    from bertology.core.text.corpora import Example
    from bertology.families.patterns.analyzer import HeadPatterns

    def kept(folder):
        analyzer = HeadPatterns(examples_per_class=2, seed=3)
        Engine(tiny_bert, progress=False).run([Example(text, source=f"{folder}:{line}") for line, text in enumerate(TEXTS, 1)], [analyzer])
        return {p: [(e.key, e.layer, e.head, e.text) for e in items] for p, items in analyzer.examples().items()}

    first = kept("corpus.txt")
    assert first == kept("elsewhere/copy-of-corpus.txt") and sum(map(len, first.values())) > 0


def test_the_mixed_rule_needs_the_total_as_well_as_each_part():
    # vertical 0.288 and diagonal 0.271 are each >= mixed_min 0.25, but their sum 0.559 is < mixed_total 0.6
    a = np.zeros((N, N))
    for i in range(N):
        a[i, 0] += 0.22  # [CLS]
        a[i, 1 if i == 0 else i - 1] += 0.26  # the previous token (the first: the next one)
        far = [j for j in range(1, N - 1) if abs(i - j) >= 2]
        a[i, far] += 0.52 / len(far)
    column = a.sum(0) / N
    vertical = column[[0, N - 1]].sum() + column[1 : N - 1].max()
    diagonal = (np.trace(a, offset=-1) + np.trace(a, offset=1)) / N
    features = pattern_features(torch.tensor(a)[None, None], *masks(N))
    assert features["vertical"].item() == pytest.approx(vertical, rel=1e-12) and features["diagonal"].item() == pytest.approx(diagonal, rel=1e-12)
    assert vertical >= 0.25 and diagonal >= 0.25 and vertical + diagonal < 0.6
    assert classify(a) == "heterogeneous"  # not vertical+diagonal
    assert classify(a, thresholds=PatternThresholds(mixed_total=0.55)) == "vertical+diagonal"
    assert classify(a, thresholds=PatternThresholds(mixed_min=0.28, mixed_total=0.55)) == "heterogeneous"


def test_examples_are_distinct_heads_each_with_its_smallest_hash_and_its_tokens(tiny_bert):
    """Issue 26: a class's examples are maps of distinct heads (not one head four times), the same as the brute force
    (keep every head's smallest-hash map, then the heads with the smallest), with the tokens of the map's rows and columns,
    kept as plain data that a state stores."""
    from conftest import TEXTS

    from bertology.core.engine import Engine
    from bertology.core.storage.states import decode, encode
    from bertology.core.text.corpora import Example
    from bertology.families.patterns.analyzer import HeadPatterns

    examples = [Example(text, source=f"c:{line}") for line, text in enumerate(TEXTS * 3, 1)]

    def run(per_class, batch_size):
        # the rules without the uniform map's comparison (margin -1): the random model's near-uniform maps then fall in
        # several classes, which is what this test of the kept examples needs
        analyzer = HeadPatterns(RuleClassifier(PatternThresholds(margin=-1.0)), examples_per_class=per_class, seed=4, min_example_length=3)
        Engine(tiny_bert, batch_size=batch_size, progress=False).run(examples, [analyzer])
        return analyzer

    few, every = run(3, 1), run(10_000, 4)
    for pattern, items in few.examples().items():
        heads = [(item.layer, item.head) for item in items]
        assert len(set(heads)) == len(heads)
        assert [(item.key, *head) for item, head in zip(items, heads)] == [(item.key, item.layer, item.head) for item in every.examples()[pattern][:3]]
    kept = [item for items in few.examples().values() for item in items]
    assert len(kept) > 3
    for item in kept:
        pieces = tiny_bert.tokenizer(item.text)["input_ids"]
        expected = tiny_bert.tokenizer.convert_ids_to_tokens(pieces)  # WordPiece: "##" marks a piece that goes on a word
        assert len(item.tokens) == len(expected) and item.attention.shape == (len(expected), len(expected))
        assert all(token == piece or (piece == "[UNK]" and token in item.text.split()) for token, piece in zip(item.tokens, expected))  # [UNK]: its text
    assert any(token.startswith("##") for item in kept for token in item.tokens)
    arrays = {}
    restored = decode(encode(few, arrays), arrays)
    assert [item.tokens for item in restored.examples()["heterogeneous"]] == [item.tokens for item in few.examples()["heterogeneous"]]


def test_thumbnails_draw_each_kept_map_with_its_tokens_on_both_axes():
    from bertology.families.patterns.analyzer import _Example
    from bertology.families.patterns.report import THUMBNAILS_PER_CLASS, pattern_thumbnails

    rng = np.random.default_rng(0)

    def example(layer, head, n):
        return _Example(-rng.random(), layer, head, "s:1", "text", rng.dirichlet(np.ones(n), size=n).astype(np.float16),
                        ["[CLS]", *(f"w{k}" for k in range(n - 2)), "[SEP]"])

    examples = {"vertical": [example(0, 1, 5), example(1, 0, 9), example(1, 1, 7)], "diagonal": [example(0, 2, 6)], "block": [],
                "heterogeneous": [example(1, 1, 4)]}
    figure = pattern_thumbnails(examples)
    drawn = [axis for axis in figure.axes if axis.images]
    items = [item for items in examples.values() for item in items[:THUMBNAILS_PER_CLASS]]  # the first two of each class
    assert len(drawn) == len(items) == 4
    figure.canvas.draw()
    for axis, item in zip(drawn, items):
        np.testing.assert_array_equal(axis.images[0].get_array(), item.attention.astype(float))
        for which, side in (("xtick", "x"), ("ytick", "y")):  # each token named at its row and column, outside the map
            labels = [text for text in axis.texts if text.get_gid() == which]
            assert [label.get_text() for label in labels] == item.tokens
            assert [label.get_position()[0 if side == "x" else 1] for label in labels] == list(range(len(item.tokens)))
            boxes = [label.get_window_extent() for label in labels]
            frame = axis.get_window_extent()
            assert all(box.y1 <= frame.y0 for box in boxes) if side == "x" else all(box.x1 <= frame.x0 for box in boxes)
        assert axis.get_title().endswith(f"layer {item.layer}, head {item.head}")
    assert "no map of class block" in figure._suptitle.get_text()


def test_the_summary_gives_each_class_share_of_all_maps_and_the_majority_counts():
    """Two layers of two heads; the printed shares are the table's ``layer = -1`` rows and the majority counts count heads."""
    import pandas as pd

    from bertology.families import FamilyResult, get_family
    from bertology.studies.analyze.weightings import combine_views

    overall = {"vertical": 0.5, "diagonal": 0.125, "vertical+diagonal": 0.0, "block": 0.0, "heterogeneous": 0.375}
    by_layer = pd.DataFrame([(layer, pattern, share) for layer in (0, 1, -1) for pattern, share in overall.items()], columns=["layer", "pattern", "share"])
    majority = {(0, 0): "vertical", (0, 1): "vertical", (1, 0): "heterogeneous", (1, 1): "diagonal"}
    patterns = pd.DataFrame([(layer, head, pattern, 0.2, 8, kind) for (layer, head), kind in majority.items() for pattern in PATTERNS],
                            columns=["layer", "head", "pattern", "share", "n", "majority"])
    result = FamilyResult(tables={"patterns": patterns, "patterns_by_layer": by_layer})
    expected = ("pattern classes, share of all maps: vertical 50%, diagonal 12%, vertical+diagonal 0%, block 0%, heterogeneous 38%; "
                "heads by majority class (of 4): vertical 2, diagonal 1, heterogeneous 1")
    assert get_family("patterns").summary(result) == [expected]
    both = combine_views({"attention": result, "norm": result})
    assert get_family("patterns").summary(both) == ["[attention weights] " + expected, "[norm shares] " + expected]


def test_the_summary_of_a_run_matches_its_tables(tiny_bert):
    from conftest import tiny_examples

    from bertology.api import analyze
    from bertology.families import get_family

    result = analyze(tiny_bert, tiny_examples(), analyses=["patterns"], progress=False, view=False)
    [line] = get_family("patterns").summary(result.results["patterns"])
    overall = result.table("patterns_by_layer")[result.table("patterns_by_layer").layer == -1].set_index("pattern").share
    assert line.startswith("pattern classes, share of all maps: " + ", ".join(f"{p} {overall[p]:.0%}" for p in PATTERNS))
    heads = result.table("patterns").drop_duplicates(["layer", "head"])
    assert f"heads by majority class (of {len(heads)}): " in line
    for pattern, count in heads.majority.value_counts().items():
        assert f"{pattern} {count}" in line
