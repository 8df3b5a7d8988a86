"""The kinds of model (bertology.core.model.kinds): each kind's visible keys, queries, uniform reference and anchors, against
the definitions written out by hand (docs/methods.md#decoders), and against the masks transformers' own eager attention
applies."""

import math
import pickle

import numpy as np
import pytest
import torch
from conftest import float64_model, tiny_examples

from bertology.core.engine import Engine, RunStats
from bertology.core.model.kinds import DECODER, ENCODER, KINDS, kind_named

LENGTHS = (5, 3, 1)


def padded_mask(lengths=LENGTHS) -> torch.Tensor:
    width = max(lengths)
    return torch.tensor([[j < n for j in range(width)] for n in lengths])


def visible_by_hand(kind, n: int, width: int) -> np.ndarray:
    """``[width, width]``: query i sees key j, written out from the definition."""
    seen = np.zeros((width, width), dtype=bool)
    for i in range(n):
        for j in range(n):
            seen[i, j] = kind is ENCODER or j <= i
    return seen


@pytest.mark.parametrize("kind", [ENCODER, DECODER], ids=lambda kind: kind.name)
def test_visible_keys_and_counts_follow_the_definition(kind):
    mask = padded_mask()
    visible, counts = kind.visible_keys(mask).numpy(), kind.visible_counts(mask).numpy()
    for b, n in enumerate(LENGTHS):
        expected = visible_by_hand(kind, n, mask.shape[1])
        np.testing.assert_array_equal(visible[b], expected)
        np.testing.assert_array_equal(counts[b], expected.sum(axis=1))


@pytest.mark.parametrize("kind", [ENCODER, DECODER], ids=lambda kind: kind.name)
def test_queries_and_the_uniform_entropy_follow_the_definition(kind):
    mask = padded_mask()
    queries = kind.query_mask(mask).numpy()
    for b, n in enumerate(LENGTHS):
        rows = [i for i in range(n) if kind is ENCODER or i >= 1]  # a decoder's row 0 sees only itself: no query
        np.testing.assert_array_equal(np.flatnonzero(queries[b]), rows)
        sizes = visible_by_hand(kind, n, n).sum(axis=1)[rows]  # |S_i|: the uniform row is 1 / |S_i|, entropy ln |S_i|
        expected = float(np.mean(np.log(sizes))) if rows else math.nan
        np.testing.assert_allclose(kind.uniform_entropy(n), expected, rtol=1e-12, equal_nan=True)
    np.testing.assert_allclose(kind.uniform_entropies(np.array(LENGTHS)), [kind.uniform_entropy(n) for n in LENGTHS], equal_nan=True)


def test_anchors_are_an_encoders_cls_and_sep_and_a_decoders_first_token():
    ids = torch.tensor([[101, 7, 102, 8, 102], [101, 9, 102, 0, 0]])
    mask = ids != 0
    anchors = ENCODER.anchor_masks(ids, mask, 101, 102)
    assert tuple(anchors) == ENCODER.anchors == ("cls", "sep")
    assert anchors["cls"].tolist() == [[True, False, False, False, False], [True, False, False, False, False]]
    assert anchors["sep"].tolist() == [[False, False, True, False, True], [False, False, True, False, False]]
    first = DECODER.anchor_masks(ids, mask, None, None)
    assert tuple(first) == DECODER.anchors == ("first",)
    assert first["first"].tolist() == [[True, False, False, False, False], [True, False, False, False, False]]


def test_a_kind_is_one_object_by_name_through_pickles_and_stored_states():
    from bertology.core.storage import states

    for name, kind in KINDS.items():
        assert kind_named(name) is kind and pickle.loads(pickle.dumps(kind)) is kind
        arrays = {}
        assert states.decode(states.encode({"kind": kind}, arrays), arrays)["kind"] is kind
    with pytest.raises(ValueError, match="unknown kind"):
        kind_named("seq2seq")


@pytest.mark.parametrize("fixture", ["tiny_bert_dir", "tiny_gpt2_dir", "tiny_llama_dir"])
def test_the_visible_keys_are_where_transformers_eager_attention_puts_weight(fixture, request):
    """The keys a kind says each query sees are exactly those transformers' own eager attention gives weight (a padded batch)."""
    loaded = float64_model(request.getfixturevalue(fixture))
    engine = Engine(loaded, progress=False)
    items = list(engine.encode(enumerate(tiny_examples()[:3]), RunStats()))
    batch = engine.run_batch(items)
    visible = loaded.kind.visible_keys(batch.mask)
    weighted = batch.attentions.abs().amax(dim=(0, 2)) > 0  # [batch, n, n]: some head of some layer gives the key weight
    assert torch.equal(weighted, visible)
    assert torch.equal(batch.visible_counts, visible.sum(dim=-1))
