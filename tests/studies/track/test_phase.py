"""Issue 52, steps 2 and 3: track tells induction from position, and the phase-change verdict. The rise window, the loss bump and
the heads' names are checked on series made by hand (their numbers computed here), the verdict's four words on made-up probes
(a null series claims nothing), and the probe's scores against transformers' own eager maps on a GPT-2 with a planted
positional head, through the command line."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from families.headtypes.test_headtypes import plant_previous_token_head
from test_cli import bertology
from transformers import AutoTokenizer, GPT2LMHeadModel

from bertology.core.model.models import load_model
from bertology.core.text.synthetic import induction_probe, probe_periods
from bertology.studies.track.phase import ABRUPT_SHARE, loss_bump, phase_verdict, probe_heads, rise_window
from bertology.studies.track.probe import ProbeResult

STEPS = np.arange(0, 1100, 100)


def test_the_rise_window_runs_between_the_checkpoints_around_its_10_and_90_percent_crossings():
    jump = np.where(np.arange(11) >= 5, 1.0, 0.0)[:, None]  # from 0 to 1 between steps 400 and 500
    window = rise_window(STEPS, jump)
    x = np.log1p([400.0, 500.0])  # crossings interpolated in ln(1 + step)
    assert window["start"] == pytest.approx(np.expm1(x[0] + 0.1 * (x[1] - x[0])))
    assert window["end"] == pytest.approx(np.expm1(x[0] + 0.9 * (x[1] - x[0])))
    assert (window["bracket_low"], window["bracket_high"], window["span_high"], window["span_share"]) == (400, 500, 100, 0.1)
    assert window["abrupt"] and (window["low"], window["high"]) == (400, 500)  # no replicate: the data's brackets
    late = np.where(np.arange(11) >= 6, 1.0, 0.0)  # a replicate in which it comes a checkpoint later
    replicates = np.stack([jump[:, 0]] * 40 + [late] * 2, axis=1)  # [checkpoint, 1 + 41]
    window = rise_window(STEPS, replicates)
    assert (window["low"], window["high"], window["span_high"]) == (400, 600, 100)  # 2 of 41 late: past the 97.5th of the spans
    ramp = np.linspace(0, 1, 11)[:, None]
    window = rise_window(STEPS, ramp)
    assert (window["bracket_low"], window["bracket_high"], window["span_share"], window["abrupt"]) == (0, 900, 0.9, False)
    assert not rise_window(STEPS, np.zeros((11, 1)))["abrupt"]  # no rise, no window


def test_a_loss_bump_is_a_plateau_above_the_lower_convex_hull():
    loss = np.array([4.0, 3.9, 3.8, 3.7, 3.6, 2.0, 1.9, 1.85, 1.8, 1.78, 1.77])
    bump = loss_bump(STEPS, loss[:, None])
    # the hull runs from (0, 4.0) to (500, 2.0): at step 400 it is 2.4, the loss 1.2 above it; the whole fall is 4.0 - 1.77
    assert bump["share"] == pytest.approx(1.2 / 2.23) and (bump["peak_step"], bump["end_step"]) == (400, 500) and bump["bump"]
    convex = 1 + 3 * np.exp(-STEPS / 200.0)
    assert loss_bump(STEPS, convex[:, None])["share"] == pytest.approx(0.0, abs=1e-12) and not loss_bump(STEPS, convex[:, None])["bump"]
    small = convex + np.where(STEPS == 400, 0.15, 0.0)  # step 400 raised above the chord from 300 to 500, by less than a tenth of the fall
    height = small[4] - (small[3] + small[5]) / 2
    bump = loss_bump(STEPS, small[:, None])
    assert bump["share"] == pytest.approx(height / (small[0] - small[-1])) and bump["peak_step"] == 400 and not bump["bump"]


def made_probe(induction: np.ndarray, previous: np.ndarray, by_period: np.ndarray, uniform: float = 0.05, replicates: int = 40,
               icl: float = 0.0, seed: int = 0) -> ProbeResult:
    """A :class:`ProbeResult` from each head's data (``[layer, head]``; ``by_period [period, layer, head]`` at periods 6, 7, ...),
    its replicates the data with Gaussian noise of 0.005, its excess the score less ``uniform`` (exactly 0 where it equals it)."""
    rng = np.random.default_rng(seed)

    def replicated(values: np.ndarray) -> np.ndarray:
        values = np.where(np.isclose(values, uniform), uniform, values)
        noise = 0.005 * rng.normal(size=(replicates, *values.shape)) * (values != uniform)
        return np.concatenate([values[None], values[None] + noise])

    scores, prior = replicated(induction), replicated(previous)
    icl_replicates = icl + 0.01 * rng.normal(size=1 + replicates) * np.r_[0, np.ones(replicates)]
    periods = np.arange(6, 6 + len(by_period))
    return ProbeResult(scores, scores - uniform, prior, prior - uniform, periods, by_period, by_period - uniform, icl_replicates, (6, 64), 100,
                       np.zeros((*induction.shape, 4, 4)), 2)


def named_heads() -> ProbeResult:
    """Two layers of three heads: 0-0 copies at period 8 alone, 0-1 scores at every period (in layer 0), 0-2 is a previous-token
    head, 1-0 an induction head, 1-1 the uniform head's score throughout, 1-2 copies at period 12 alone."""
    by_period = np.full((7, 2, 3), 0.05)
    by_period[2, 0, 0], by_period[:, 0, 1], by_period[:, 1, 0], by_period[6, 1, 2] = 0.95, 0.9, 0.9, 0.9
    induction = by_period.mean(axis=0)
    previous = np.full((2, 3), 0.05)
    previous[0, 2] = 0.95
    return made_probe(induction, previous, by_period)


def test_heads_are_named_by_their_layer_and_by_whether_they_score_at_most_periods_or_at_one():
    heads = probe_heads(10, named_heads(), mass=0.3).set_index(["layer", "head"])
    assert heads.role.to_dict() == {(0, 0): "positional", (0, 1): "", (0, 2): "previous-token", (1, 0): "induction", (1, 1): "",
                                    (1, 2): "positional"}
    assert heads.loc[(0, 0), "best_period"] == 8 and heads.loc[(0, 0), "best_period_score"] == pytest.approx(0.95)
    assert heads.loc[(0, 1), "median_period_score"] == pytest.approx(0.9)  # in layer 0: never an induction head
    assert heads.loc[(1, 0), "induction_low"] < heads.loc[(1, 0), "induction"] < heads.loc[(1, 0), "induction_high"]
    assert (heads.loc[(1, 1), ["induction_low", "induction_high"]] == 0.05).all()  # the uniform head's: no interval, no name


def series(jump: int | None, rise: float = 0.85, ramp: bool = False) -> np.ndarray:
    """``[checkpoint]``: 0.05 before checkpoint ``jump``, ``0.05 + rise`` from it on (a straight ramp with ``ramp``; None: flat)."""
    if ramp:
        return 0.05 + rise * np.linspace(0, 1, len(STEPS))
    return 0.05 + (0.0 if jump is None else rise) * (np.arange(len(STEPS)) >= (jump or 0))


def probes(head: np.ndarray, partner: np.ndarray, icl: np.ndarray) -> list[ProbeResult]:
    """One probe per checkpoint: head 1-0's induction score ``head`` at every period, head 0-1's previous-token score ``partner``,
    and the in-context learning score ``icl``; every other score the uniform head's (0.05)."""
    made = []
    for k in range(len(STEPS)):
        by_period = np.full((7, 2, 2), 0.05)
        by_period[:, 1, 0] = head[k]
        previous = np.full((2, 2), 0.05)
        previous[0, 1] = partner[k]
        made.append(made_probe(by_period.mean(axis=0), previous, by_period, icl=icl[k], seed=k))
    return made


BUMP = np.array([4.0, 3.95, 3.9, 3.85, 3.8, 2.6, 2.5, 2.45, 2.42, 2.4, 2.39])[:, None] + np.zeros((1, 41))


@pytest.mark.parametrize("head, icl, loss, word", [
    (series(5), -series(5, 2.0), BUMP, "supported"),
    (series(5), -series(5, 2.0), 1 + 3 * np.exp(-STEPS / 300.0)[:, None] + np.zeros((1, 41)), "abrupt"),  # no loss bump
    (series(5), -series(9, 2.0), BUMP, "abrupt"),  # the in-context learning score drops later
    (series(None, ramp=True), -series(None, 2.0, ramp=True), BUMP, "smooth"),
    (series(None), -series(None, 2.0), BUMP, "no evidence"),  # the uniform head's score throughout: no claim
])
def test_the_phase_change_verdict(head, icl, loss, word):
    verdict = phase_verdict(STEPS.tolist(), probes(head, series(5), icl), loss, mass=0.3)
    assert verdict["verdict"] == word and verdict["statement"].endswith(f": {word}.")
    followed = verdict["induction_head"]
    assert (followed["layer"], followed["head"]) == (1, 0) and followed["window_abrupt"] == (word in ("supported", "abrupt"))
    assert (verdict["previous_token_head"]["layer"], verdict["previous_token_head"]["head"]) == (0, 1)
    if word != "no evidence":
        assert verdict["previous_token_head"]["rises"] == "before or with it" and followed["role_at_last"] == "induction"
        assert followed["window_span_share"] <= ABRUPT_SHARE or word == "smooth"
    json.dumps(verdict, allow_nan=False)  # verdict.json holds no NaN


def test_a_layer_0_head_that_copies_by_position_is_never_the_induction_head():
    """Head 0-0 copies at period 8 alone and rises abruptly: the verdict follows layer 1 (flat: no evidence) and names 0-0 positional."""
    made = []
    for k in range(len(STEPS)):
        by_period = np.full((7, 2, 2), 0.05)
        by_period[2, 0, 0] = series(5)[k]
        made.append(made_probe(by_period.mean(axis=0), np.full((2, 2), 0.05), by_period, seed=k))
    verdict = phase_verdict(STEPS.tolist(), made, BUMP, mass=0.3)
    assert verdict["verdict"] == "no evidence" and verdict["induction_head"]["layer"] == 1
    assert [(h["layer"], h["head"], h["role"]) for h in verdict["named_heads"]] == [(0, 0, "positional")]
    assert "head 0-0 is positional (0.90 at period 8" in verdict["statement"]
    one_layer = [made_probe(p.induction[0, :1], p.previous[0, :1], p.period_scores[:, :1]) for p in made]
    assert "One layer" in phase_verdict(STEPS.tolist(), one_layer, BUMP, mass=0.3)["statement"]


def hand_probe_scores(checkpoint, examples) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """By transformers and numpy alone: each head's induction score ``[layer, head]`` on the probe (over the rows from each
    sequence's second copy on, the mass on the keys after earlier occurrences of the query's piece), averaged over sequences,
    and the same averaged over the sequences of each period."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = GPT2LMHeadModel.from_pretrained(checkpoint, attn_implementation="eager").double().eval()
    scores, periods = [], []
    with torch.inference_mode():
        for example in examples:
            ids = tokenizer(example.text)["input_ids"]
            maps = np.stack([a[0].numpy() for a in model(input_ids=torch.tensor([ids]), output_attentions=True).attentions])
            rows = []
            for i in range(example.second_copy, len(ids)):
                targets = sorted({j + 1 for j in range(i) if ids[j] == ids[i]})
                rows.append(maps[:, :, i, targets].sum(axis=-1))
            scores.append(np.mean(rows, axis=0))
            periods.append(example.period)
    scores, periods = np.array(scores), np.array(periods)
    return scores.mean(axis=0), {p: scores[periods == p].mean(axis=0) for p in sorted(set(periods))}


def test_a_planted_positional_head_is_named_positional_and_the_probes_scores_are_transformers(tiny_gpt2_dir, tmp_path):
    """GPT-2's head 0-1 planted to attend 7 positions back (a head that copies at period 8), every other head uniform: on the
    probe it is positional, at period 8; no head is an induction head, and the verdict claims nothing. The probe's induction
    scores, per period too, are transformers' maps by hand."""
    checkpoints = []
    for step, scale in ((0, 0.0), (100, 2000.0)):
        loaded = load_model(tiny_gpt2_dir, device="cpu")
        plant_previous_token_head(loaded, head=1, scale=scale, offset=7)
        folder = tmp_path / f"step-{step:06d}"
        loaded.model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
        checkpoints.append(str(folder))
    tracked = bertology("track", *checkpoints, "--steps", "0,100", "--synthetic-repeats", 8, "--synthetic-length", 10, "--induction-probe", 60,
                        "--bootstrap", 100, "--out", tmp_path / "t", "--device", "cpu", "-q")
    assert tracked.returncode == 0, tracked.stderr
    assert "induction heads' phase change: no evidence:" in tracked.stdout and "head 0-1 is positional" in tracked.stdout
    named = pd.read_csv(tmp_path / "t" / "induction_probe.csv")
    last = named[named.step == 100].set_index(["layer", "head"])
    assert last.role.fillna("").to_dict() == {**{(layer, head): "" for layer in range(2) for head in range(4)}, (0, 1): "positional"}
    assert last.loc[(0, 1), "best_period"] == 8 and last.loc[(0, 1), "best_period_score"] > 0.9
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["settings"]["induction_probe"] == 60 and manifest["settings"]["probe_length"] == 64 and probe_periods(64) == (6, 24)
    examples = induction_probe(AutoTokenizer.from_pretrained(checkpoints[-1]), 60, 64, seed=0)
    overall, by_period = hand_probe_scores(checkpoints[-1], examples)
    np.testing.assert_allclose(last.induction.to_numpy().reshape(2, 4), overall, atol=1e-5)
    assert last.loc[(0, 1), "best_period_score"] == pytest.approx(by_period[8][0, 1], abs=1e-5)
    assert (tmp_path / "t" / "phase_maps.png").is_file() and "the phase change" in (tmp_path / "t" / "report.html").read_text()


def test_pretrain_synthetic_then_track_reads_the_probe_from_the_symbols_through_the_command_line(tmp_path):
    """The synthetic recipe end to end, small: an attention-only decoder on repeats of 12 symbols, tracked on text of its own
    symbols. The probe is drawn from the 12 symbols, 24 pieces long (the run's --max-length), every head named at every
    checkpoint, none of layer 0 an induction head, and the verdict one of its four words."""
    trained = bertology("pretrain", "--causal", "--synthetic", "repeats", "--attention-only", "--vocab-size", 12, "--min-period", 3,
                        "--max-period", 6, "--layers", 2, "--heads", 2, "--hidden", 16, "--max-length", 24, "--batch-size", 8, "--steps", 30,
                        "--checkpoints", 4, "--linear-checkpoints", "--out", tmp_path / "run", "--device", "cpu", "-q")
    assert trained.returncode == 0, trained.stderr
    corpus = tmp_path / "symbols.txt"
    corpus.write_text("\n".join(" ".join("abcdefghijkl"[(7 * k + i) % 12] for i in range(24)) for k in range(12)) + "\n")
    tracked = bertology("track", "--checkpoints", tmp_path / "run", "--corpus", corpus, "--induction-probe", 20, "--bootstrap", 100,
                        "--out", tmp_path / "t", "--device", "cpu", "-q")
    assert tracked.returncode == 0, tracked.stderr
    verdict = json.loads((tmp_path / "t" / "verdict.json").read_text())["induction"]
    assert verdict["verdict"] in ("supported", "abrupt", "smooth", "no evidence") and verdict["steps"] == [0, 10, 20, 30]
    assert verdict["induction_head"]["layer"] == 1 and verdict["previous_token_head"]["layer"] == 0
    settings = json.loads((tmp_path / "t" / "manifest.json").read_text())["settings"]
    assert (settings["induction_probe"], settings["probe_length"]) == (20, 24)
    named = pd.read_csv(tmp_path / "t" / "induction_probe.csv")
    assert len(named) == 4 * 2 * 2 and not ((named.layer == 0) & (named.role == "induction")).any()
    assert set(named.best_period) <= set(range(*np.add(probe_periods(24), (0, 1))))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "checkpoints" / "step-000030")
    assert {word for example in induction_probe(tokenizer, 20, 24, seed=0) for word in example.text.split()} <= set("abcdefghijkl")
    assert (tmp_path / "t" / "phase_change.png").is_file() and (tmp_path / "t" / "phase_maps.png").is_file()
