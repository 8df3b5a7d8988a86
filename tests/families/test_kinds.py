"""One function per measure, of the kind of model (docs/methods.md#decoders): each family's names and measures for an encoder
and a decoder against numpy written from the definitions; analyzers built for one kind refuse another's batches and
analyzers; the families say on which kinds they run, and their reports read the kind from the run."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from bertology.core.engine import Batch
from bertology.core.model.kinds import DECODER, ENCODER
from bertology.core.text.corpora import Example
from bertology.families import get_family
from bertology.families.classes.analyzer import ClassAttention, TokenClass, class_rows
from bertology.families.mixing.analyzer import ContextMixing
from bertology.families.profile.analyzer import GeneralProfile, clark_threshold_values, profile_metric_names, profile_metrics
from bertology.families.roles.analyzer import SUMMARY_ROLES, HeadRoles, role_names, role_scores, syntactic_scores
from bertology.families.rollout.analyzer import AttentionRollout, rollout_rows, rollout_targets
from bertology.families.rollout.report import row_titles, target_titles
from bertology.families.sinks.analyzer import AttentionSinks
from bertology.families.syntax.analyzer import RelationHeads

KINDS = {"encoder": ENCODER, "decoder": DECODER}


def test_each_kind_names_the_measures_it_had_before_the_kinds():
    assert profile_metric_names(ENCODER) == ("cls", "sep", "punct", "self", "prev", "next", "entropy", "cls_entropy", "distance")
    assert profile_metric_names(DECODER) == ("first", "punct", "self", "prev", "entropy", "distance")
    assert list(clark_threshold_values(ENCODER).items()) == [("entropy", 3.8), ("prev", 0.5), ("next", 0.5), ("cls", 0.6), ("sep", 0.6), ("punct", 0.6)]
    assert list(clark_threshold_values(DECODER).items()) == [("entropy", 3.8), ("prev", 0.5), ("first", 0.6), ("punct", 0.6)]
    assert role_names(ENCODER) == ("local", "delimiter", "cls", "sep", "block") and role_names(DECODER) == ("local", "delimiter", "block")
    assert SUMMARY_ROLES == ("local", "delimiter", "cls", "sep", "block", "syntactic")
    assert rollout_rows(ENCODER) == ("all", "cls_row") and rollout_rows(DECODER) == ("all", "last_row")
    assert rollout_targets(ENCODER) == ("cls", "sep", "punct", "self") and rollout_targets(DECODER) == ("first", "punct", "self")
    assert class_rows(ENCODER) == ("all", "cls_row") and class_rows(DECODER) == ("all", "last_row")
    assert row_titles(ENCODER) == {"cls_row": "the [CLS] position", "all": "every position (mean)"}
    assert row_titles(DECODER) == {"last_row": "the last position", "all": "every position but the first (mean)"}
    assert target_titles(ENCODER) == {"cls": "input [CLS]", "sep": "input [SEP]", "punct": "input punctuation", "self": "its own input token"}
    assert target_titles(ENCODER, "cls_row")["self"] == "its own input token (= input [CLS] here)"
    assert target_titles(DECODER, "last_row") == target_titles(DECODER) == {"first": "input first token", "punct": "input punctuation",
                                                                             "self": "its own input token"}


def random_map(rng, n: int, kind: str) -> np.ndarray:
    """A row-stochastic n x n map: every key for an encoder, keys j <= i for a decoder (zeros above the diagonal)."""
    if kind == "encoder":
        return rng.dirichlet(np.full(n, 0.5), size=n)
    a = np.zeros((n, n))
    for i in range(n):
        a[i, : i + 1] = rng.dirichlet(np.full(i + 1, 0.5))
    return a


def padded(maps: list[np.ndarray]) -> torch.Tensor:
    """``[batch, head, width, width]`` float64, zero-padded, from per-sequence ``[head, n, n]`` maps."""
    width = max(m.shape[-1] for m in maps)
    attention = torch.zeros(len(maps), maps[0].shape[0], width, width, dtype=torch.float64)
    for b, m in enumerate(maps):
        attention[b, :, : m.shape[-1], : m.shape[-1]] = torch.tensor(m)
    return attention


def flags(lengths, width, marked) -> torch.Tensor:
    """``[batch, width]`` bool with ``marked[b]`` the positions set in sequence b."""
    out = torch.zeros(len(lengths), width, dtype=torch.bool)
    for b, positions in enumerate(marked):
        out[b, list(positions)] = True
    return out


def profile_by_hand(a: np.ndarray, kind: str, anchors: dict[str, list[int]], punct: list[int]) -> dict[str, float]:
    """The profile of one map from docs/methods.md#head-profile and #decoders: an encoder's means over its n queries, a
    decoder's over i >= 1 with the entropy smoothed over the i + 1 keys row i sees."""
    n = a.shape[0]
    queries = range(n) if kind == "encoder" else range(1, n)
    seen = (lambda i: range(n)) if kind == "encoder" else (lambda i: range(i + 1))
    m = len(queries)

    def entropy(i):
        return -sum(s * math.log(s) for s in (0.9999 * a[i, j] + 0.0001 / len(seen(i)) for j in seen(i)))

    values = {name: sum(a[i, j] for i in queries for j in positions) / m for name, positions in anchors.items()}
    values.update({
        "punct": sum(a[i, j] for i in queries for j in punct) / m,
        "self": sum(a[i, i] for i in queries) / m,
        "prev": sum(a[i, i - 1] for i in queries if i >= 1) / m,
        "entropy": sum(entropy(i) for i in queries) / m,
        "distance": sum(a[i, j] * abs(i - j) for i in queries for j in range(n)) / m,
    })
    if kind == "encoder":
        values["next"] = sum(a[i, i + 1] for i in queries if i + 1 < n) / m
        values["cls_entropy"] = entropy(anchors["cls"][0])
    return values


@pytest.mark.parametrize("kind", KINDS)
def test_profile_metrics_of_each_kind_equal_numpy(kind):
    rng = np.random.default_rng(5)
    lengths = [4, 9, 6]
    anchors = ([{"cls": [0], "sep": [n - 1]} for n in lengths] if kind == "encoder" else [{"first": [0]} for _ in lengths])
    punct = [[2], [3, 7], []]
    maps = [np.stack([random_map(rng, n, kind) for _ in range(2)]) for n in lengths]
    attention, width = padded(maps), max(lengths)
    mask = flags(lengths, width, [range(n) for n in lengths])
    masks = {name: flags(lengths, width, [a[name] for a in anchors]) for name in anchors[0]}
    values = profile_metrics(attention, mask, masks, flags(lengths, width, punct), KINDS[kind]).numpy()
    names = profile_metric_names(KINDS[kind])
    assert values.shape == (3, 2, len(names))
    for b, n in enumerate(lengths):
        for head in range(2):
            expected = profile_by_hand(maps[b][head], kind, anchors[b], punct[b])
            assert set(expected) == set(names)
            for k, name in enumerate(names):
                assert values[b, head, k] == pytest.approx(expected[name], rel=1e-12, abs=1e-15), (kind, b, head, name)


def roles_by_hand(a: np.ndarray, kind: str, anchors: dict[str, list[int]], segments: list[int], window: int = 2) -> dict[str, float]:
    """Pande et al.'s sieve scores of one map from docs/methods.md#roles-and-the-sieve-score and #decoders: over the queries
    (a decoder's i >= 1), the mean attention to the visible part of the sieve set against the row's uniform 1/|V_i|."""
    n = a.shape[0]
    queries = list(range(n)) if kind == "encoder" else list(range(1, n))
    visible = (lambda i: list(range(n))) if kind == "encoder" else (lambda i: list(range(i + 1)))

    def score(sieve, weight=lambda i: 1.0):
        terms = [np.mean([a[i, j] for j in sieve(i)]) * len(visible(i)) * weight(i) for i in queries if sieve(i)]
        return np.mean(terms)

    every = sorted(j for positions in anchors.values() for j in positions)
    values = {"local": score(lambda i: [j for j in visible(i) if abs(i - j) <= window]),
              "delimiter": score(lambda i: [j for j in every if j in visible(i)])}
    if len(anchors) > 1:
        values.update({name: score(lambda i, p=positions: [j for j in p if j in visible(i)]) for name, positions in anchors.items()})
    if 1 in segments:
        first_sep = min(anchors["sep"]) if "sep" in anchors else n

        def own(i):
            return segments[i] if segments[i] >= 0 else (1 if i >= first_sep else 0)

        def entropy(i):
            return -sum(x * math.log(x) for x in a[i] if x > 0)

        values["block"] = score(lambda i: [j for j in visible(i) if segments[j] == own(i)], entropy)
    return values


@pytest.mark.parametrize("kind", KINDS)
def test_role_scores_of_each_kind_equal_numpy(kind):
    rng = np.random.default_rng(8)
    if kind == "encoder":  # [CLS] A [SEP] (B [SEP])
        segments = [[-1, 0, 0, 0, -1], [-1, 0, 0, -1, 1, 1, 1, -1], [-1, 0, 0, -1, -1, 1, 1, -1]]  # the last: RoBERTa's </s> </s>
        anchors = [{"cls": [0], "sep": [k for k, s in enumerate(seg) if s < 0 and k > 0]} for seg in segments]
    else:  # a decoder's first piece, BOS (special) or a word, then A (B)
        segments = [[0, 0, 0, 0, 0], [-1, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
        anchors = [{"first": [0]} for _ in segments]
    lengths = [len(seg) for seg in segments]
    width = max(lengths)
    maps = [np.stack([random_map(rng, n, kind) for _ in range(2)]) for n in lengths]
    maps[1][1, :, 2] = 0  # zeros in a row: 0 ln 0 = 0
    maps[1][1] /= maps[1][1].sum(-1, keepdims=True)
    segment_ids = torch.full((len(lengths), width), -1)
    for b, seg in enumerate(segments):
        segment_ids[b, : len(seg)] = torch.tensor(seg)
    mask = flags(lengths, width, [range(n) for n in lengths])
    masks = {name: flags(lengths, width, [a[name] for a in anchors]) for name in anchors[0]}
    scores = role_scores(padded(maps), mask, masks, segment_ids, KINDS[kind])
    assert tuple(scores) == role_names(KINDS[kind])
    for b in range(len(lengths)):
        for head in range(2):
            expected = roles_by_hand(maps[b][head], kind, anchors[b], segments[b])
            for role, value in scores.items():
                if role == "block" and role not in expected:
                    assert torch.isnan(value[b, head]), (kind, b)  # a single sentence has no block score
                else:
                    assert value[b, head].item() == pytest.approx(expected[role], rel=1e-12), (kind, b, head, role)


@pytest.mark.parametrize("kind", KINDS)
def test_syntactic_scores_of_each_kind_equal_numpy(kind):
    # pieces: 0 | un ##believ ##able (word 0) | cat (word 1) | sat (word 2) | . (word 3); units: piece 0 is unit 0, words 1..4
    rng = np.random.default_rng(2)
    n, unit_of_piece = 7, [0, 1, 1, 1, 2, 3, 4]
    assignment = np.zeros((5, n))
    assignment[unit_of_piece, range(n)] = 1
    heads, relations = (2, 0, 1, 2), ("amod", "root", "obj", "punct")  # 1-based: unbelievable -> cat; sat -> unbelievable; . -> cat
    a = np.stack([random_map(rng, n, kind) for _ in range(2)])[None]  # [layer 1, head 2, n, n]
    scores = syntactic_scores(torch.tensor(a), assignment, np.array([1, 2, 3, 4]), heads, relations, KINDS[kind])
    pieces = {word: [p for p in range(n) if unit_of_piece[p] == word + 1] for word in range(4)}
    by_relation = {}
    for word, (head, relation) in enumerate(zip(heads, relations)):
        if head == 0:
            continue
        dependent, target = pieces[word], pieces[head - 1]
        if kind == "decoder" and max(target) >= min(dependent):
            continue  # the dependent does not see its head word
        reference = (lambda p: n) if kind == "encoder" else (lambda p: p + 1)  # |V_p|
        value = np.mean([np.mean([a[0, :, p, q] for q in target], axis=0) * reference(p) for p in dependent], axis=0)
        by_relation.setdefault(f"syntactic:{relation}", []).append(value)
        by_relation.setdefault("syntactic", []).append(value)
    expected = {"syntactic", "syntactic:obj", "syntactic:punct"} | ({"syntactic:amod"} if kind == "encoder" else set())
    assert set(scores) == set(by_relation) == expected  # on a decoder, "unbelievable" does not see its head "cat"
    for role, values in by_relation.items():
        np.testing.assert_allclose(scores[role][0].numpy(), np.mean(values, axis=0), rtol=1e-12, err_msg=f"{kind} {role}")


def test_syntactic_scores_in_a_sliding_window_count_only_the_pairs_it_reaches():
    # a decoder layer whose queries see the last 3 keys (j <= i, i - j < 3): a dependent whose head word lies further back
    # sees none of it, so the pair is left out, and each piece row's reference is |V_p| = min(p + 1, 3)
    rng = np.random.default_rng(4)
    n, window = 8, 3
    unit_of_piece = [0, 1, 2, 2, 3, 4, 5, 6]  # piece 0 alone, then words 0..5 (word 1 has two pieces)
    assignment = np.zeros((7, n))
    assignment[unit_of_piece, range(n)] = 1
    visible = np.array([[0 <= i - j < window for j in range(n)] for i in range(n)])
    a = np.where(visible, rng.random((2, n, n)), 0.0)
    a = (a / a.sum(-1, keepdims=True))[None]  # [layer 1, head 2, n, n]
    heads, relations = (2, 0, 2, 2, 6, 1), ("det", "root", "obj", "nmod", "case", "punct")  # 1-based heads
    scores = syntactic_scores(torch.tensor(a), assignment, np.arange(1, 7), heads, relations, DECODER, visible=torch.tensor(visible))
    pieces = {word: [p for p in range(n) if unit_of_piece[p] == word + 1] for word in range(6)}
    by_relation = {}
    for word, (head, relation) in enumerate(zip(heads, relations)):
        if head == 0 or not all(visible[p, q] for p in pieces[word] for q in pieces[head - 1]):
            continue
        value = np.mean([np.mean([a[0, :, p, q] for q in pieces[head - 1]], axis=0) * visible[p].sum() for p in pieces[word]], axis=0)
        by_relation.setdefault(f"syntactic:{relation}", []).append(value)
        by_relation.setdefault("syntactic", []).append(value)
    # obj (word 2 -> word 1) is seen; det and case look ahead; nmod (pieces 5 -> 2..3) and punct (7 -> 1) are out of reach
    assert set(scores) == set(by_relation) == {"syntactic", "syntactic:obj"}
    for role, values in by_relation.items():
        np.testing.assert_allclose(scores[role][0].numpy(), np.mean(values, axis=0), rtol=1e-12, err_msg=role)


def built(kind):
    """An analyzer of every family whose measures depend on the kind, built for ``kind``."""
    return {
        "profile": GeneralProfile(kind),
        "roles": HeadRoles(kind, tau=1.0),
        "rollout": AttentionRollout(kind),
        "classes": ClassAttention(kind, (TokenClass("the", "words", "the", frozenset({"the"})),)),
        "syntax": RelationHeads(kind, bootstrap=10),
        "mixing": ContextMixing(kind, ("alti",)),
    }


@pytest.mark.parametrize("name", built(ENCODER))
def test_analyzers_of_different_kinds_refuse_to_merge(name):
    encoder, decoder = built(ENCODER)[name], built(DECODER)[name]
    with pytest.raises(ValueError, match="cannot merge .* of kind 'decoder' into one of kind 'encoder'"):
        encoder.merge(decoder)
    with pytest.raises(ValueError, match="of kind 'encoder' into one of kind 'decoder'"):
        decoder.merge(built(ENCODER)[name])
    assert encoder.merge(built(ENCODER)[name]) is encoder  # the same kind merges
    other = next(analyzer for key, analyzer in built(ENCODER).items() if key != name)
    with pytest.raises(TypeError):
        encoder.merge(other)


def one_batch(kind, n: int = 5) -> Batch:
    """A batch of one sequence of ``n`` pieces of a ``kind`` of model, uniform attention over the keys each row sees."""
    from types import SimpleNamespace

    mask = torch.ones(1, n, dtype=torch.bool)
    visible = kind.visible_keys(mask).double()
    attention = (visible / visible.sum(-1, keepdim=True))[:, None].expand(2, 1, 2, n, n).clone()  # [layer, batch, head, n, n]
    anchors = kind.anchor_masks(torch.tensor([[2] + [7] * (n - 2) + [3]]), mask, 2, 3)
    item = SimpleNamespace(example=Example("x"), input_ids=[0] * n, sequence_ids=[0] * n, offsets=[(0, 1)] * n, index=0)
    return Batch(items=[item], input_ids=torch.zeros(1, n, dtype=torch.long), mask=mask, anchors=anchors, punct_mask=torch.zeros_like(mask),
                 segment_ids=torch.zeros(1, n, dtype=torch.long), attentions=attention, kind=kind)


@pytest.mark.parametrize("name", ["profile", "roles", "rollout"])
def test_an_analyzer_refuses_a_batch_of_another_kind(name):
    built(ENCODER)[name].update(one_batch(ENCODER))
    built(DECODER)[name].update(one_batch(DECODER))
    with pytest.raises(ValueError, match="built for a model of kind 'encoder', not 'decoder'"):
        built(ENCODER)[name].update(one_batch(DECODER))
    with pytest.raises(ValueError, match="built for a model of kind 'decoder', not 'encoder'"):
        built(DECODER)[name].update(one_batch(ENCODER))


def test_uniform_attention_over_the_visible_keys_gives_each_kind_its_uniform_entropy():
    for kind in KINDS.values():
        profile = GeneralProfile(kind)
        profile.update(one_batch(kind, n=6))
        entropy = profile.result().query("metric == 'entropy'").value
        np.testing.assert_allclose(entropy, kind.uniform_entropy(6), rtol=1e-3)  # smoothing aside
        assert profile.entropy_ceiling() == pytest.approx(kind.uniform_entropy(6), rel=1e-15)
    assert GeneralProfile(DECODER).entropy_ceiling() != GeneralProfile(DECODER).entropy_ceiling()  # NaN before any sequence


def test_the_families_say_on_which_kinds_they_run():
    sinks, mixing, profile = get_family("sinks"), get_family("mixing"), get_family("profile")
    assert sinks.kinds == frozenset({"decoder"}) and sinks.fits(DECODER) is None
    assert sinks.fits(ENCODER) == "it measures attention sinks, a decoder's (an encoder's [CLS] and [SEP] are in the profile)"
    with pytest.raises(ValueError, match="measured on decoders"):
        AttentionSinks(ENCODER)
    assert mixing.fits(ENCODER) is None and mixing.fits(ENCODER, {"contributions": None}) is None
    assert mixing.fits(DECODER, {"contributions": ("alti",)}) is None
    assert mixing.fits(DECODER) == mixing.fits(DECODER, {"contributions": None}) == mixing.unfit
    assert mixing.unfit.startswith("its ratios take the residual and the layer norm after attention")
    with pytest.raises(ValueError, match="needs a contribution measure"):
        ContextMixing(DECODER)
    assert ContextMixing(ENCODER).ratios and not ContextMixing(DECODER, ("alti",)).ratios
    assert profile.fits(ENCODER) is None and profile.fits(DECODER) is None
    for family in ("profile", "roles", "patterns", "syntax", "classes", "frames", "layers", "rollout"):
        assert get_family(family).kinds == frozenset({"encoder", "decoder"}), family


def test_a_report_section_takes_the_kind_from_the_run_not_from_the_table(tmp_path):
    """The rollout's section on a decoder's run: its rows, titles and note follow ``settings["kind"]``."""
    from bertology.core.storage.runfolder import RunFolder
    from bertology.families import FamilyResult

    rows = [(layer, row, target, 0.1 * layer, 0.0, 1.0, 5) for layer in range(2) for row in rollout_rows(DECODER) for target in rollout_targets(DECODER)]
    table = pd.DataFrame(rows, columns=["layer", "row", "target", "value", "ci_low", "ci_high", "n"])
    with RunFolder(tmp_path / "run") as folder:
        section = get_family("rollout").section(folder, FamilyResult(tables={"rollout": table}), {"kind": "decoder"})
    assert "On a decoder the first token's row sees only itself" in section.intro
    [(caption, wide)] = section.tables
    assert caption == "The last position's rolled-out attention per layer" and list(wide.columns) == ["layer", "first", "punct", "self"]
    assert get_family("rollout").by_layer(FamilyResult(tables={"rollout": table})).quantity.unique().tolist() == [
        "last row rolled out to the first token", "last row rolled out to punctuation"]
