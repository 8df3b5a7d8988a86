import dataclasses

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from bertology.core.engine import Engine, RunStats
from bertology.core.statistics.stats import bootstrap_weights
from bertology.core.text.corpora import Example
from bertology.families.syntax.analyzer import OFFSETS, RelationHeads

# "the cat sat on the mat ." with UD-style heads (1-based, 0 = root)
WORDS = ("the", "cat", "sat", "on", "the", "mat", ".")
HEADS = (2, 3, 0, 6, 6, 3, 3)
RELATIONS = ("det", "nsubj", "root", "case", "det", "obl", "punct")


def tree_example(text="the cat sat on the mat.", source="toy:1"):
    spans, position = [], 0
    for word in WORDS:
        position = text.index(word, position)
        spans.append((position, position + len(word)))
        position += len(word)
    return Example(text=text, source=source, words=WORDS, word_spans=tuple(spans), heads=HEADS, relations=RELATIONS)


def batch_with(model, examples, attention_for):
    """A real batch of ``examples`` whose attention is replaced by ``attention_for(batch, b)`` maps."""
    engine = Engine(model, progress=False)
    (items,) = list(engine.batches(engine.encode(enumerate(examples), RunStats())))
    batch = engine.run_batch(items)
    attentions = torch.zeros_like(batch.attentions)
    for b in range(batch.size):
        n = int(batch.lengths[b])
        attentions[:, b, :, :n, :n] = attention_for(batch, b)  # [n, n] for every head, or [layer, head, n, n]
    return dataclasses.replace(batch, attentions=attentions)


def pieces_of(batch, b, word):
    alignment = batch.alignments[b]
    return np.flatnonzero(alignment.unit_of_piece == alignment.word_unit[word])


def gold_pointer(batch, b):
    """Every piece of a dependent attends to the first piece of its gold head (root and specials to [CLS])."""
    n = int(batch.lengths[b])
    matrix = torch.zeros(n, n)
    matrix[:, 0] = 1.0
    for word, head in enumerate(batch.examples[b].heads):
        if head > 0:
            for piece in pieces_of(batch, b, word):
                matrix[piece] = 0
                matrix[piece, pieces_of(batch, b, head - 1)[0]] = 1.0
    return matrix


def wrong_pointer(batch, b):
    """Every piece attends to the final "." (word 6): wrong for every dependent but the ones of "."."""
    n = int(batch.lengths[b])
    matrix = torch.zeros(n, n)
    matrix[:, pieces_of(batch, b, 6)[0]] = 1.0
    return matrix


def test_attention_at_the_gold_head_scores_100_percent_dep_to_head(tiny_bert):
    batch = batch_with(tiny_bert, [tree_example()], gold_pointer)
    analyzer = RelationHeads(tiny_bert.kind, bootstrap=100)
    analyzer.update(batch)
    table = analyzer.result()
    dep_to_head = table[table.direction == "dep->head"]
    assert (dep_to_head.accuracy == 1.0).all()
    assert dict(zip(dep_to_head.relation, dep_to_head.n)) == {"all": 6, "det": 2, "nsubj": 1, "case": 1, "obl": 1, "punct": 1}


def test_head_attending_to_its_dependent_scores_in_the_head_to_dep_direction(tiny_bert):
    # "mat" attends to its dependent "on"; everything else attends to [CLS]
    def pointer(batch, b):
        n = int(batch.lengths[b])
        matrix = torch.zeros(n, n)
        matrix[:, 0] = 1.0
        for piece in pieces_of(batch, b, 5):
            matrix[piece] = 0
            matrix[piece, pieces_of(batch, b, 3)[0]] = 1.0
        return matrix

    analyzer = RelationHeads(tiny_bert.kind, bootstrap=100)
    analyzer.update(batch_with(tiny_bert, [tree_example()], pointer))
    case = analyzer.result().query("relation == 'case'").set_index("direction").accuracy
    assert (case["head->dep"] == 1.0).all()
    # "on" attends to no word: its six candidates tie at 0, and a tie of t scores 1/t (what a random pick would)
    assert case["dep->head"].to_numpy() == pytest.approx(np.full(len(case["dep->head"]), 1 / 6))


def test_offset_baselines_by_hand(tiny_bert):
    analyzer = RelationHeads(tiny_bert.kind, bootstrap=100)
    analyzer.update(batch_with(tiny_bert, [tree_example()], gold_pointer))
    baselines = analyzer.baselines()
    # dependents (0-based word, head): the->cat (+1), cat->sat (+1), on->mat (+2), the->mat (+1), mat->sat (-3), .->sat (-4)
    expected_all = {-3: 1 / 6, -2: 0, -1: 0, 1: 3 / 6, 2: 1 / 6, 3: 0}
    for direction in ("dep->head", "head->dep"):  # an encoder's rows see every pair in both directions
        got = baselines.query("relation == 'all' and direction == @direction").set_index("offset").accuracy.to_dict()
        assert got == pytest.approx(expected_all)
    assert (baselines.query("relation == 'all'").n == 6).all()
    assert (baselines.query("relation == 'det' and offset == 1").accuracy == 1.0).all()
    assert baselines.query("relation == 'punct'").accuracy.max() == 0.0  # offset -4 is outside -3..+3
    assert set(baselines.offset) == set(OFFSETS)


def test_best_row_interval_and_paired_test(tiny_bert):
    examples = [tree_example(source=f"toy:{i}") for i in range(30)]
    analyzer = RelationHeads(tiny_bert.kind, bootstrap=400, seed=1)
    analyzer.update(batch_with(tiny_bert, examples, gold_pointer))
    best = analyzer.best(min_dependents=40).set_index("relation")
    assert best.loc["all", "accuracy"] == 1.0 and best.loc["all", "ci_low"] == 1.0
    assert best.loc["all", "baseline_offset"] == 1 and best.loc["all", "baseline_accuracy"] == pytest.approx(0.5)
    # the head is right on every replicate and the baseline never is better: p = 1 / (1 + B)
    assert best.loc["all", "p_value"] == pytest.approx(1 / 401)
    assert bool(best.loc["all", "significant"]) and not bool(best.loc["all", "few"])
    assert bool(best.loc["det", "few"]) is False and bool(best.loc["punct", "few"]) is True  # 60 vs 30 dependents


def test_bootstrap_interval_matches_a_direct_bootstrap_of_sentences(tiny_bert):
    """Replicates are Poisson-weighted sentence totals: the percentile interval agrees with one
    computed directly from the same weights on per-sentence hit counts."""
    rng = np.random.default_rng(0)
    examples = [tree_example(source=f"toy:{i}") for i in range(25)]
    hits = rng.random(25) < 0.6  # sentence i's "det" dependents are right (pointer) or wrong (uniform)

    def mixed(batch, b):
        pointer = gold_pointer if hits[int(batch.examples[b].source.split(":")[1])] else wrong_pointer
        matrix = pointer(batch, b)
        # a background growing with the query breaks argmax ties: in head->dep the last word wins, wrongly
        return matrix + 1e-3 * torch.arange(1, len(matrix) + 1)[:, None]

    analyzer = RelationHeads(tiny_bert.kind, bootstrap=300, seed=2)
    analyzer.update(batch_with(tiny_bert, examples, mixed))
    weights = np.stack([bootstrap_weights(2, 300, e)[1:] for e in examples])  # [sentence, B]
    correct = hits.astype(float) * 2  # two det dependents per sentence
    replicate = (weights * correct[:, None]).sum(0) / (weights * 2).sum(0)
    row = analyzer.result().query("relation == 'det' and direction == 'dep->head' and layer == 0 and head == 0")
    assert row.accuracy.item() == pytest.approx(hits.mean())
    best = analyzer.best().set_index("relation").loc["det"]
    assert best.ci_low == pytest.approx(np.percentile(replicate, 2.5))
    assert best.ci_high == pytest.approx(np.percentile(replicate, 97.5))
    # and the interval is close to a normal-theory one for a proportion over sentences
    sem = scipy_stats.sem(hits.astype(float))
    assert best.ci_high - best.ci_low == pytest.approx(2 * 1.96 * sem, rel=0.35)


def test_best_accuracy_replicates_average_the_best_head_of_each_relation(tiny_bert):
    rng = np.random.default_rng(3)
    examples = [tree_example(source=f"toy:{i}") for i in range(12)]
    hits = rng.random(12) < 0.5

    def mixed(batch, b):
        pointer = gold_pointer if hits[int(batch.examples[b].source.split(":")[1])] else wrong_pointer
        return pointer(batch, b) + 1e-3 * torch.arange(1, int(batch.lengths[b]) + 1)[:, None]

    analyzer = RelationHeads(tiny_bert.kind, bootstrap=50, seed=4)
    analyzer.update(batch_with(tiny_bert, examples, mixed))
    best = analyzer.best(min_dependents=20)
    eligible = best[(best.relation != "all") & (best.n >= 20)]
    assert set(eligible.relation) == {"det"}  # 24 det dependents; the other relations have 12
    replicates = analyzer.best_accuracy_replicates(min_dependents=20)
    assert replicates.shape == (51,)
    assert replicates[0] == pytest.approx(eligible.accuracy.mean())
    # every head of every layer sees the same maps here, so the best head's replicate is the det interval's source
    assert np.percentile(replicates[1:], 2.5) == pytest.approx(eligible.ci_low.item())
    assert np.isnan(analyzer.best_accuracy_replicates(min_dependents=1000)).all()


def units_of_words(batch, b):
    """Unit index of each word; the toy sentence has one piece per word: [CLS]=0, words 1..7, [SEP]=8."""
    alignment = batch.alignments[b]
    assert alignment.num_units == len(WORDS) + 2 and list(alignment.word_unit[: len(WORDS)]) == list(range(1, len(WORDS) + 1))
    return np.arange(1, len(WORDS) + 1)


def numpy_accuracy(matrix: np.ndarray, direction: str) -> dict:
    """Clark et al.'s argmax parser on one unit-level map, written independently: per relation (and
    ``all``, root excluded), the share of dependents whose maximum other word is the gold head (1/t of a tie of t)."""
    scores = matrix if direction == "dep->head" else matrix.T
    words = list(range(1, len(WORDS) + 1))  # units of the words; 0 and 8 are [CLS] and [SEP]
    hits: dict[str, list[bool]] = {}
    for word, (head, relation) in enumerate(zip(HEADS, RELATIONS)):
        if head == 0:
            continue
        unit = word + 1
        candidates = [c for c in words if c != unit]
        values = np.array([scores[unit, c] for c in candidates])
        tied = [c for c, v in zip(candidates, values) if v == values.max()]  # a tie of t scores 1/t if the head is in it
        for name in ("all", relation):
            hits.setdefault(name, []).append(1 / len(tied) if head in tied else 0.0)  # the gold head's unit is its 1-based word id
    return {name: sum(h) / len(h) for name, h in hits.items()}


# Each dependent's row peaks on itself (0.4), then on [CLS] (even words) or [SEP] (odd words) (0.3); of the
# other words, the gold head is next (0.2, then a wrong word 0.1) for RIGHT, a wrong word (0.2) for the rest.
RIGHT = {0, 3, 5}  # "the"(det), "on"(case), "mat"(obl); wrong: "cat"(nsubj), the second "the"(det), "."(punct)


def self_and_specials_first(batch, b):
    matrix = torch.zeros(len(WORDS) + 2, len(WORDS) + 2, dtype=torch.float64)
    matrix[0] = matrix[-1] = 1 / matrix.shape[0]
    for word, head in enumerate(HEADS):
        unit = word + 1
        matrix[unit, unit] = 0.4
        matrix[unit, 0 if word % 2 == 0 else -1] = 0.3
        if head == 0:
            matrix[unit, 4] = 0.3  # the root "sat" looks at "on"
            continue
        wrong = 7 if 7 not in (unit, head) else 1  # "." unless it is the dependent or its head; then the first "the"
        matrix[unit, head], matrix[unit, wrong] = (0.2, 0.1) if word in RIGHT else (0.1, 0.2)
    return matrix


def test_argmax_skips_the_dependent_itself_and_the_special_tokens(tiny_bert):
    batch = batch_with(tiny_bert, [tree_example()], self_and_specials_first)
    units_of_words(batch, 0)
    matrix = self_and_specials_first(batch, 0).numpy()
    np.testing.assert_allclose(matrix.sum(1), 1.0)
    analyzer = RelationHeads(tiny_bert.kind, bootstrap=10)
    analyzer.update(batch)
    table = analyzer.result().query("layer == 1 and head == 2")
    for direction in ("dep->head", "head->dep"):
        got = table[table.direction == direction].set_index("relation").accuracy.to_dict()
        assert got == pytest.approx(numpy_accuracy(matrix, direction))
    got = table[table.direction == "dep->head"].set_index("relation").accuracy.to_dict()
    # self or [CLS]/[SEP] as candidates would make every prediction wrong (0.0 everywhere)
    assert got == {"all": 0.5, "det": 0.5, "nsubj": 0.0, "case": 1.0, "obl": 1.0, "punct": 0.0}


def right_neighbour(batch, b):
    """Every dependent attends to the next word (the last one to [SEP]); specials and the root to [CLS]."""
    n = int(batch.lengths[b])
    matrix = torch.zeros(n, n)
    matrix[:, 0] = 1.0
    for word, head in enumerate(batch.examples[b].heads):
        if head > 0:
            piece = pieces_of(batch, b, word)[0]
            matrix[piece] = 0
            matrix[piece, piece + 1] = 1.0
    return matrix


def by_hand_percentile(values, q):
    """numpy's default ("linear") percentile, written out: interpolate at rank (B - 1) q / 100 of the sorted values."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    upper = ordered[min(low + 1, len(ordered) - 1)]
    return ordered[low] + (rank - low) * (upper - ordered[low])


def test_best_interval_is_the_95_percent_percentile_interval_and_p_is_paired(tiny_bert):
    """Four sentences of 25 get every dependent right (6/6), the others attend to the right neighbour, which
    is right for 3 of 6 in 'all' and equals the best offset baseline (+1) exactly. Replicate r's head
    accuracy is (6 a_r + 3 b_r) / (6 (a_r + b_r)) with a_r, b_r the summed weights of the two kinds."""
    examples = [tree_example(source=f"toy:{i}") for i in range(25)]
    gold = {3, 9, 17, 22}
    analyzer = RelationHeads(tiny_bert.kind, bootstrap=400, seed=7)
    def maps(batch, b):
        matrix = (gold_pointer if batch.examples[b].line in gold else right_neighbour)(batch, b)
        if batch.examples[b].line not in gold:  # "." attends past the words, to [SEP]: a little to "the" makes it a miss, not a tie
            matrix[pieces_of(batch, b, 6)[0], pieces_of(batch, b, 0)[0]] += 0.01
        # a background growing with the query breaks head->dep's ties (a tie of t would score 1/t) towards the last row, wrongly
        return matrix + 1e-3 * torch.arange(1, len(matrix) + 1)[:, None]

    analyzer.update(batch_with(tiny_bert, examples, maps))
    best = analyzer.best().set_index("relation").loc["all"]
    assert (best["layer"], best["head"], best.direction) == (0, 0, "dep->head")
    assert (best.accuracy, best.baseline_offset, best.baseline_accuracy) == ((6 * 4 + 3 * 21) / (6 * 25), 1, 0.5)

    weights = [bootstrap_weights(7, 400, e)[1:] for e in examples]
    head = []
    for r in range(400):
        a = sum(w[r] for e, w in zip(examples, weights) if e.line in gold)
        b = sum(w[r] for e, w in zip(examples, weights) if e.line not in gold)
        head.append((6 * a + 3 * b) / (6 * (a + b)))
    assert best.ci_low == pytest.approx(by_hand_percentile(head, 2.5), rel=1e-12, abs=0)
    assert best.ci_high == pytest.approx(by_hand_percentile(head, 97.5), rel=1e-12, abs=0)
    assert by_hand_percentile(head, 5.0) != by_hand_percentile(head, 2.5)  # a 90% interval would differ
    # one-sided paired p: replicates where the head is no better than the baseline (0.5) are those with a_r = 0
    no_better = sum(1 for r in range(400) if sum(w[r] for e, w in zip(examples, weights) if e.line in gold) == 0)
    assert 0 < no_better < 400
    assert best.p_value == (1 + no_better) / 401


def children_pointer(batch, b):
    """Every head word spreads its attention over its dependents; words without dependents attend to [CLS]."""
    n = int(batch.lengths[b])
    matrix = torch.zeros(n, n)
    matrix[:, 0] = 1.0
    heads = batch.examples[b].heads
    for word in range(len(heads)):
        children = [child for child, head in enumerate(heads) if head == word + 1]
        if children:
            piece = pieces_of(batch, b, word)[0]
            matrix[piece] = 0
            for child in children:
                matrix[piece, pieces_of(batch, b, child)[0]] = 1 / len(children)
    return matrix


def test_best_lists_every_head_tied_at_the_best_accuracy(tiny_bert):
    # head 0-1 points each dependent at its head (dep->head 100%), head 1-2 each head at its dependents
    # (head->dep 100%); the other six heads attend uniformly (1 of 6 dependents right, in both directions)
    def maps(batch, b):
        n = int(batch.lengths[b])
        layers = torch.full((2, 4, n, n), 1 / n)
        layers[0, 1], layers[1, 2] = gold_pointer(batch, b), children_pointer(batch, b)
        return layers

    analyzer = RelationHeads(tiny_bert.kind, bootstrap=50)
    analyzer.update(batch_with(tiny_bert, [tree_example()], maps))
    best = analyzer.best().set_index("relation")
    for relation in ("all", "det", "nsubj", "obl", "case", "punct"):
        row = best.loc[relation]
        assert (row.accuracy, row.n_ties, row.ties) == (1.0, 2, "0-1 dep->head; 1-2 head->dep"), relation
        assert (row["layer"], row["head"], row["direction"]) == (0, 1, "dep->head")  # the first of the tied heads
    uniform = analyzer.result().query("relation == 'all' and not ((layer == 0 and head == 1) or (layer == 1 and head == 2))")
    assert uniform.accuracy.to_numpy() == pytest.approx(np.full(len(uniform), 1 / 6))  # six candidates tied: 1/6 each
    assert uniform.uniform.to_numpy() == pytest.approx(np.full(len(uniform), 1 / 6))


CONLLU_WORDS = [("the", "cat", "sat", "on", "the", "mat"), ("a", "dog", "ran", "under", "the", "table"),
                ("the", "big", "ran", "to", "a", "house"), ("a", "cat", "sat", "in", "the", "tree"),
                ("the", "dog", "sat", "with", "a", "cat"), ("a", "small", "ran", "from", "the", "mat"),
                ("the", "red", "sat", "at", "the", "table"), ("the", "cat", "ran", "by", "a", "tree")]


def write_treebank(path):
    """Eight CoNLL-U sentences with the toy tree (det noun verb prep det noun .)."""
    blocks = []
    for number, words in enumerate(CONLLU_WORDS, start=1):
        rows = [f"# sent_id = {number}", f"# text = {' '.join(words)}."]
        for i, (word, head, relation) in enumerate(zip((*words, "."), HEADS, RELATIONS), start=1):
            rows.append(f"{i}\t{word}\t_\t_\t_\t_\t{head}\t{relation}\t_\t{'SpaceAfter=No' if i == 6 else '_'}")
        blocks.append("\n".join(rows))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(blocks) + "\n\n")
    return path


def test_same_corpus_under_another_name_and_folder_gives_byte_identical_tables(tiny_bert, tmp_path):
    from bertology.api import analyze

    outputs = []
    for corpus in (tmp_path / "a" / "ewt-small.conllu", tmp_path / "elsewhere" / "deeper" / "copy.conllu"):
        out = tmp_path / f"run-{len(outputs)}"
        analyze(tiny_bert, write_treebank(corpus), analyses=["syntax"], bootstrap=200, seed=3, probe_folds=2, probe_epochs=1,
                min_dependents=2, view=False, progress=False, out=out)
        outputs.append(out)
    for name in ("syntax.csv", "syntax_best.csv", "syntax_baselines.csv", "probe.json"):
        assert (outputs[0] / name).read_bytes() == (outputs[1] / name).read_bytes(), name


def test_bootstrap_weights_follow_line_and_text_never_the_file_name():
    same = [Example("the cat sat.", source=source) for source in ("a.conllu:3", "runs/x/b.txt:3", "C:\\data\\c.tsv:3")]
    weights = [bootstrap_weights(0, 50, e) for e in same]
    assert all((w == weights[0]).all() for w in weights)
    assert not (bootstrap_weights(0, 50, Example("the cat sat.", source="a.conllu:4")) == weights[0]).all()  # repeated sentences stay apart
    assert not (bootstrap_weights(0, 50, Example("the dog sat.", source="a.conllu:3")) == weights[0]).all()
    assert (bootstrap_weights(0, 50, Example("the cat sat.")) == bootstrap_weights(0, 50, Example("the cat sat.", source="view"))).all()


def syntax_best_table():
    """``syntax_best`` as :meth:`RelationHeads.best` orders it (``all`` first, then by dependents): seven tested relations
    and two with too few dependents (``few``: not tested, no p-value), one of which has a perfect head."""
    import pandas as pd

    nan = float("nan")
    rows = [
        ("all", 900, 3, 1, "dep->head", 0.412, 0.39, 0.43, 1, 0.35, 0.1, 0.002, 0.004, True, False, 1, "3-1 dep->head"),
        ("nsubj", 120, 4, 2, "dep->head", 0.6, 0.52, 0.68, -1, 0.3, 0.1, 0.001, 0.004, True, False, 2, "4-2 dep->head; 5-0 head->dep"),
        ("det", 110, 2, 0, "dep->head", 0.9, 0.85, 0.94, 1, 0.88, 0.1, 0.3, 0.35, False, False, 1, "2-0 dep->head"),
        ("obj", 80, 5, 3, "head->dep", 0.7, 0.6, 0.8, -2, 0.2, 0.1, 0.001, 0.004, True, False, 1, "5-3 head->dep"),
        ("case", 70, 1, 1, "dep->head", 0.95, 0.9, 0.99, 1, 0.9, 0.1, 0.04, 0.07, False, False, 1, "1-1 dep->head"),
        ("amod", 60, 0, 0, "dep->head", 0.8, 0.7, 0.9, 1, 0.75, 0.1, 0.2, 0.25, False, False, 1, "0-0 dep->head"),
        ("advmod", 30, 1, 2, "dep->head", 0.5, 0.4, 0.6, 1, 0.45, 0.1, 0.3, 0.35, False, False, 1, "1-2 dep->head"),
        ("iobj", 9, 2, 2, "dep->head", 1.0, nan, nan, 1, 0.2, 0.1, nan, nan, False, True, 1, "2-2 dep->head"),
        ("expl", 3, 0, 1, "dep->head", 1.0, nan, nan, -1, 0.0, 0.1, nan, nan, False, True, 1, "0-1 dep->head"),
    ]
    return pd.DataFrame(rows, columns=["relation", "n", "layer", "head", "direction", "accuracy", "ci_low", "ci_high", "baseline_offset",
                                       "baseline_accuracy", "uniform", "p_value", "p_adj", "significant", "few", "n_ties", "ties"])


def test_the_summary_names_the_best_head_of_the_most_frequent_tested_relations_and_the_probe():
    from bertology.families import FamilyResult, get_family

    verdict = {"attn": {"uas": 0.612, "reference": "uniform_attn", "reference_uas": 0.6, "p_adj": 0.3, "beats_baselines": False},
               "attn+emb": {"uas": 0.77, "reference": "uniform_attn+emb", "reference_uas": 0.7, "p_adj": 0.002, "beats_baselines": True}}
    probe = {"evaluation": "5-fold cross-validation over sentences", "uas": {"attn": 0.61, "attn+emb": 0.774, "right_branching": 0.3}, "verdict": verdict}
    result = FamilyResult(tables={"syntax_best": syntax_best_table()}, documents={"probe": probe})
    assert get_family("syntax").summary(result) == [
        "syntactic heads: 3 of 7 tested relations have a head above both the best offset baseline and the uniform head "
        "after correction; "
        "2 with fewer dependents than --min-dependents not tested",
        "  all (900 dependents): 3-1 dep->head 0.412 (95% CI 0.390-0.430) vs offset +1 0.350, uniform 0.100, p_adj 0.004",
        "  nsubj (120 dependents): 4-2 dep->head 0.600 (95% CI 0.520-0.680) vs offset -1 0.300, uniform 0.100, p_adj 0.004, 2 heads tied",
        "  det (110 dependents): 2-0 dep->head 0.900 (95% CI 0.850-0.940) vs offset +1 0.880, uniform 0.100, p_adj 0.35",
        "  obj (80 dependents): 5-3 head->dep 0.700 (95% CI 0.600-0.800) vs offset -2 0.200, uniform 0.100, p_adj 0.004",
        "  case (70 dependents): 1-1 dep->head 0.950 (95% CI 0.900-0.990) vs offset +1 0.900, uniform 0.100, p_adj 0.07",
        "parsing probe UAS (5-fold cross-validation over sentences): attn 0.610, attn+emb 0.774, right_branching 0.300",
        "  parsing probe attn 0.612 does not beat the offset baselines and the uniform probe (best: uniform_attn 0.600; p_adj 0.3); "
        "parsing probe attn+emb 0.770 beats the offset baselines and the uniform probe (best: uniform_attn+emb 0.700; p_adj 0.002)",
    ]  # iobj's perfect head is on 9 dependents: not tested, not named
    probe_claims = [line for line in get_family("syntax").claims(result) if "parsing probe" in line]
    assert probe_claims == ["parsing probe attn+emb 0.770 beats the offset baselines and the uniform probe (best: uniform_attn+emb 0.700; p_adj 0.002)"]


def test_the_summary_of_two_views_names_each_view(tiny_bert):
    from bertology.api import analyze
    from bertology.families import get_family

    examples = [tree_example(source=f"toy:{k}") for k in range(1, 13)]
    result = analyze(tiny_bert, examples, analyses=["syntax"], weighting="attention,norm", probe=False, bootstrap=100, min_dependents=5,
                     progress=False, view=False)
    lines = get_family("syntax").summary(result.results["syntax"])
    best = result.table("syntax_best")
    for view, name in (("attention", "attention weights"), ("norm", "norm shares")):
        rows = best[(best.weighting == view) & ~best.few.astype(bool)]
        assert f"[{name}] syntactic heads: {int(rows.significant.sum())} of {len(rows)} tested relations" in lines[
            [line.startswith(f"[{name}] syntactic") for line in lines].index(True)]
        top = rows.iloc[0]
        assert f"[{name}]   all ({int(top.n)} dependents): {int(top.layer)}-{int(top['head'])} {top.direction} {top.accuracy:.3f}" in "\n".join(lines)
