"""Issue 41, part 2: induction heads and the in-context learning score over a decoder's checkpoints. The expected numbers come
from transformers' own logits and eager attention maps (``output_attentions=True``), computed here by hand in numpy, and the
verdict from series made by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, GPT2LMHeadModel

from bertology.core.errors import BertologyError
from bertology.core.model.kinds import DECODER
from bertology.core.model.models import load_model
from bertology.core.text.corpora import Example
from bertology.studies.track.dynamics import track
from bertology.studies.track.induction import InductionReplicates, icl_positions
from bertology.testing.analyzers import check_analyzer
from studies.track.test_measured_loss_and_sinks import save_gpt2

#: Lines with repeats, most of them longer than the 48 pieces the track pass reads (the late token of the ICL score).
LINES = [
    "the cat sat on the mat and the dog ran to the house; the cat sat on the mat and the dog ran to the house again.",
    "we saw the big red house under the tree, and we saw the big red house under the tree once more today.",
    "why does the small cat not sit here? why does the small cat not sit here, where the dog sat before?",
    "a dog, a cat and a tree. a dog, a cat and a tree. a dog, a cat and a tree, and then nothing at all.",
    "they walked slowly to the house; the dog was running. they walked slowly to the house; the dog was running.",
    "short line, too short.",
]
MAX_LENGTH = 48


def hand_scores(checkpoint: str, lines: list[str]) -> tuple[float, int, np.ndarray, np.ndarray]:
    """By transformers and numpy alone: the mean over lines of at least ``late`` pieces of (loss of the late token - loss of the
    early one), their count, and each head's induction score ``[layer, head]`` averaged over the lines with a repeated piece, and
    its excess over the uniform head's (row i: ``1/(i + 1)`` on each of the keys it sees) on the same lines."""
    early, late = max(2, round(MAX_LENGTH / 10)), MAX_LENGTH
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = GPT2LMHeadModel.from_pretrained(checkpoint, attn_implementation="eager").double().eval()
    differences, scores, excess = [], [], []
    with torch.inference_mode():
        for line in lines:
            ids = tokenizer(line)["input_ids"][:MAX_LENGTH]
            output = model(input_ids=torch.tensor([ids]), output_attentions=True)
            log_p = torch.log_softmax(output.logits[0], dim=-1).numpy()
            if len(ids) >= late:  # the k-th token (1-based) is ids[k - 1], predicted at position k - 2
                differences.append(-log_p[late - 2, ids[late - 1]] + log_p[early - 2, ids[early - 1]])
            n = len(ids)
            targets = np.zeros((n, n), dtype=bool)
            for i in range(n):
                for j in range(i):
                    if ids[j] == ids[i]:
                        targets[i, j + 1] = True
            rows = targets.any(axis=1)
            if rows.any():
                maps = np.stack([a[0].numpy() for a in output.attentions])  # [layer, head, n, n]
                scores.append((maps * targets).sum(axis=-1)[..., rows].mean(axis=-1))
                excess.append(scores[-1] - (targets.sum(axis=-1) / np.arange(1, n + 1))[rows].mean())
    return float(np.mean(differences)), len(differences), np.mean(scores, axis=0), np.mean(excess, axis=0)


def test_icl_score_and_induction_scores_match_a_hand_computation(tiny_gpt2_dir, tmp_path):
    checkpoints = [save_gpt2(tiny_gpt2_dir, tmp_path / f"step-{step:06d}", seed) for seed, step in enumerate((0, 50, 100))]
    (tmp_path / "step-000050" / "pretraining_step.json").write_text(json.dumps({"step": 50, "lm_loss": 5.0}))
    examples = [Example(line) for line in LINES]
    result = track(checkpoints, examples, out=tmp_path / "t", bootstrap=30, batch_size=4, max_length=MAX_LENGTH, device="cpu", progress=False)
    assert icl_positions(MAX_LENGTH) == (5, 48)
    in_context, induction = result.in_context, result.induction
    assert in_context.step.tolist() == [0, 50, 100]
    for k, checkpoint in enumerate(checkpoints):
        expected_icl, long_enough, expected_heads, expected_excess = hand_scores(checkpoint, LINES)
        assert 2 <= long_enough < len(LINES) and in_context.n.iloc[k] == long_enough  # the short lines take no part
        assert (in_context.early.iloc[k], in_context.late.iloc[k]) == (5, 48)
        assert in_context.value.iloc[k] == pytest.approx(expected_icl, abs=1e-4)
        assert in_context.ci_low.iloc[k] <= in_context.value.iloc[k] <= in_context.ci_high.iloc[k]
        heads = induction[induction.step == result.steps[k]].sort_values(["layer", "head"]).value.to_numpy().reshape(expected_heads.shape)
        np.testing.assert_allclose(heads, expected_heads, atol=1e-5)
        np.testing.assert_allclose(result.results[k].induction_excess[0], expected_excess, atol=1e-5)
        # the head-types family's induction rows in track.csv are the same scores
        family = result.table[(result.table.step == result.steps[k]) & (result.table.metric == "headtype:induction")]
        np.testing.assert_allclose(family.sort_values(["layer", "head"]).value.to_numpy(), expected_heads.ravel(), atol=1e-5)
        copying = result.table[(result.table.step == result.steps[k]) & (result.table.metric == "copying:copying_score")]
        assert len(copying) == expected_heads.size and copying.value.between(-1, 1).all()
        share = result.table[(result.table.step == result.steps[k]) & (result.table.metric == "copying:positive_eigenvalue_share")]
        assert len(share) == expected_heads.size and share.value.between(0, 1).all()
    verdict = json.loads((tmp_path / "t" / "verdict.json").read_text())["induction"]
    assert verdict["verdict"] in ("supported", "abrupt", "smooth", "no evidence") and verdict["statement"]
    for name in ("induction", "in_context", "induction_probe"):
        assert (tmp_path / "t" / f"{name}.csv").is_file()
    assert "Induction heads over training" in (tmp_path / "t" / "report.html").read_text()
    # a rerun reads every part back, the induction and in-context scores with them
    again = track(checkpoints, examples, out=tmp_path / "t", bootstrap=30, batch_size=4, max_length=MAX_LENGTH, device="cpu", progress=False)
    np.testing.assert_array_equal(again.in_context.value, in_context.value)
    np.testing.assert_array_equal(again.induction.value, induction.value)


def test_induction_replicates_pass_the_analyzer_contract(tiny_gpt2_dir):
    model = load_model(tiny_gpt2_dir, device="cpu")
    check_analyzer(lambda: InductionReplicates(DECODER, bootstrap=20, seed=3), model, [Example(line) for line in LINES])


def test_track_on_the_synthetic_probe(tiny_gpt2_dir, tmp_path):
    """--synthetic-repeats: Olsson et al.'s probe drawn from the series' vocabulary; every sequence is 2 x length pieces, so all
    take part in the in-context score, whose late token lies in the repeated half and early one in the first."""
    checkpoints = [save_gpt2(tiny_gpt2_dir, tmp_path / f"step-{step:06d}", seed) for seed, step in enumerate((0, 10))]
    result = track(checkpoints, synthetic_repeats=12, synthetic_length=10, max_length=20, bootstrap=10, device="cpu", progress=False)
    assert result.corpus["name"] == "synthetic-repeats-12x10" and result.corpus["examples"] == 12
    assert result.in_context.n.tolist() == [12, 12] and result.in_context.late.tolist() == [20, 20]
    assert result.induction.value.notna().all()  # every sequence repeats its pieces
    with pytest.raises(BertologyError, match="give no corpus"):
        track(checkpoints, [Example("the cat sat.")], synthetic_repeats=3, device="cpu", progress=False)
    with pytest.raises(BertologyError, match=r"^--synthetic-length 11 makes sequences of 22 pieces .* more than --max-length 20: .* "
                                             r"the longest that fits is --synthetic-length 10$"):  # GPT-2 adds no special token
        track(checkpoints, synthetic_repeats=3, synthetic_length=11, max_length=20, device="cpu", progress=False)


def test_sequence_maps_pass_the_analyzer_contract(tiny_gpt2_dir):
    """Track's keeper of one probe sequence's maps: its table the same whatever the batch size, order or split, and the maps it
    keeps those of the sequence named, equal to transformers' eager maps of that sequence alone."""
    from bertology.studies.track.probe import SequenceMaps

    model = load_model(tiny_gpt2_dir, device="cpu")
    examples = [Example(line, source=f"line:{i}") for i, line in enumerate(LINES)]
    check_analyzer(lambda: SequenceMaps(DECODER, "line:1"), model, examples)
    keeper = SequenceMaps(DECODER, "line:1")
    from bertology.core.engine import Engine, PassSettings

    Engine(model, PassSettings(batch_size=2, device="cpu"), progress=False).run(examples, [keeper])
    reference = GPT2LMHeadModel.from_pretrained(tiny_gpt2_dir, attn_implementation="eager").eval()
    ids = AutoTokenizer.from_pretrained(tiny_gpt2_dir)(LINES[1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        maps = torch.stack(reference(input_ids=ids, output_attentions=True).attentions)[:, 0].numpy()
    np.testing.assert_allclose(keeper.maps, maps, rtol=0, atol=1e-5)
