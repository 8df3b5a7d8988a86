"""Decoder head types (docs/methods.md#decoder-head-types): each score against a port of TransformerLens's head detector
with the denominator fixed, computed from transformers' own eager maps; a planted previous-token head found and nothing
else; the uniform null silent; the encoder's duplicate-token score; the synthetic probe; the command line."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TEXTS, WORDS, eager_reference

from bertology import analyze
from bertology.core.engine import Engine
from bertology.core.errors import BertologyError
from bertology.core.model.models import load_model
from bertology.core.text.corpora import Example
from bertology.core.text.synthetic import synthetic_repeats, whole_word_pieces
from bertology.families.headtypes.analyzer import DUPLICATE, HEAD_TYPES, INDUCTION, PREVIOUS, HeadTypes, head_types

EXAMPLES = [Example(text) for text in TEXTS]


def repeat_corpus(count: int = 12, length: int = 6, seed: int = 0) -> list[Example]:
    """Lines that each repeat a random sequence of whole words of the tests' vocabulary: ``w_1 .. w_L w_1 .. w_L``."""
    rng = np.random.default_rng(seed)
    words = [word for word in WORDS if not word.startswith("##")]
    lines = []
    for _ in range(count):
        half = list(rng.choice(words, size=length))
        lines.append(Example(" ".join(half + half)))
    return lines


# -- a port of TransformerLens's detector (transformer_lens/head_detector.py), on one sequence's token ids ------------------

def tl_previous(tokens: np.ndarray) -> np.ndarray:
    n = len(tokens)
    pattern = np.zeros((n, n))
    pattern[1:, :-1] = np.eye(n - 1)
    return np.tril(pattern)


def tl_duplicate(tokens: np.ndarray) -> np.ndarray:
    token_pattern = np.tile(tokens, (len(tokens), 1))
    equal = np.equal(token_pattern, token_pattern.T).astype(int)
    np.fill_diagonal(equal, 0)
    return np.tril(equal).astype(float)


def tl_induction(tokens: np.ndarray) -> np.ndarray:
    shifted = np.roll(tl_duplicate(tokens), shift=1, axis=1)
    shifted[:, 0] = 0
    return np.tril(shifted)


TL_PATTERNS = {PREVIOUS: tl_previous, DUPLICATE: tl_duplicate, INDUCTION: tl_induction}


def tl_score_fixed(attention: np.ndarray, pattern: np.ndarray) -> float:
    """TransformerLens's ``mul`` score ``sum(A * D) / sum(A)`` with the denominator fixed: the mean over the rows that have a
    target of each row's mass on them; NaN where no row has one."""
    rows = pattern.any(axis=1)
    return float((attention * pattern).sum(axis=1)[rows].mean()) if rows.any() else np.nan


def causal_uniform(n: int) -> np.ndarray:
    return np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]


def second_copy_rows(tokens: np.ndarray, special: set[int], length: int) -> np.ndarray:
    """The rows of a probe sequence's second copy: from its ``length``-th non-special piece on (counted by hand)."""
    words = np.array([token not in special for token in tokens])
    return np.cumsum(words) > length


def reference_table(loaded, examples, roles=HEAD_TYPES) -> pd.DataFrame:
    """``layer, head, role, value, uniform, n`` from transformers' eager maps, one sequence at a time, with the TL port; on a
    probe sequence (``second_copy``) the induction pattern's rows before the second copy are emptied (prefix matching)."""
    layers, heads = loaded.num_layers, loaded.num_heads
    scores = {role: np.full((len(examples), layers, heads), np.nan) for role in roles}
    uniform = {role: np.full(len(examples), np.nan) for role in roles}
    for s, reference in enumerate(eager_reference(loaded, examples)):
        tokens = np.array(reference["ids"])
        for role in roles:
            pattern = TL_PATTERNS[role](tokens)
            if role == INDUCTION and examples[s].second_copy is not None:
                pattern = pattern * second_copy_rows(tokens, set(loaded.tokenizer.all_special_ids), examples[s].second_copy)[:, None]
            uniform[role][s] = tl_score_fixed(causal_uniform(len(tokens)), pattern)
            for layer in range(layers):
                for head in range(heads):
                    scores[role][s, layer, head] = tl_score_fixed(reference["attentions"][layer, head], pattern)
    rows = [(layer, head, role, np.nanmean(scores[role][:, layer, head]), np.nanmean(uniform[role]), int((~np.isnan(uniform[role])).sum()))
            for layer in range(layers) for head in range(heads) for role in roles]
    return pd.DataFrame(rows, columns=["layer", "head", "role", "value", "uniform", "n"])


def run_headtypes(loaded, examples, batch_size: int = 3, min_sample: int = 5, min_mass: float = 0.0) -> pd.DataFrame:
    analyzer = HeadTypes(loaded.kind)
    Engine(loaded, batch_size=batch_size, progress=False).run(examples, [analyzer])
    return analyzer.test(min_sample=min_sample, min_mass=min_mass)


def assert_matches(table: pd.DataFrame, expected: pd.DataFrame, rtol: float, atol: float) -> None:
    got = table.set_index(["layer", "head", "role"]).loc[expected.set_index(["layer", "head", "role"]).index].reset_index()
    assert (got.n.to_numpy() == expected.n.to_numpy()).all()
    np.testing.assert_allclose(got.value, expected.value, rtol=rtol, atol=atol)
    np.testing.assert_allclose(got.uniform, expected.uniform, rtol=rtol, atol=atol)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_every_score_equals_transformer_lens_with_the_denominator_fixed(model, gpt2_64, llama64):
    """Padded batches of three, through bertology's hook, against each sequence alone through transformers' eager attention."""
    loaded = {"gpt2": gpt2_64, "llama": llama64}[model]
    examples = EXAMPLES + repeat_corpus(count=4)
    table = run_headtypes(loaded, examples)
    assert list(table.columns) == ["layer", "head", "role", "value", "ci_low", "ci_high", "n", "uniform", "excess", "t_excess", "p_excess",
                                   "p_adj", "holds"]
    expected = reference_table(loaded, examples)
    assert (expected[expected.role == DUPLICATE].n < len(examples)).all()  # some lines repeat no token: they give no duplicate score
    rtol = 1e-9 if model == "gpt2" else 1e-6  # transformers' eager Llama takes its softmax in float32
    assert_matches(table, expected, rtol=rtol, atol=1e-12)


def test_induction_scores_on_lines_that_repeat_a_word_sequence_equal_the_eager_reference(tiny_gpt2_dir):
    """The issue's "done when": a float32 GPT-2 over lines that repeat a random word sequence, within 1e-4."""
    loaded = load_model(tiny_gpt2_dir, device="cpu")
    examples = repeat_corpus()
    table = run_headtypes(loaded, examples, batch_size=5)
    expected = reference_table(loaded, examples, roles=(INDUCTION,))
    assert (expected.n == len(examples)).all()
    assert_matches(table, expected, rtol=0, atol=1e-4)


def test_the_paired_test_and_its_correction_within_each_role(gpt2_64):
    from scipy import stats

    examples = repeat_corpus(count=10)
    table = run_headtypes(gpt2_64, examples, min_sample=5).set_index(["layer", "head", "role"])
    references = eager_reference(gpt2_64, examples)
    tested = 0
    for (layer, head, role), row in table.iterrows():
        excess = []
        for reference in references:
            pattern = TL_PATTERNS[role](np.array(reference["ids"]))
            score, uniform = tl_score_fixed(reference["attentions"][layer, head], pattern), tl_score_fixed(causal_uniform(len(pattern)), pattern)
            excess.append(0.0 if abs(score - uniform) <= 1e-5 * max(1.0, uniform) else score - uniform)  # float noise counts as 0
        if np.std(excess) == 0:
            assert np.mean(excess) == 0 and row.t_excess == 0 and row.p_excess == 1  # no excess: the test decides nothing
            continue
        t, p = stats.ttest_1samp(excess, 0.0, alternative="greater")
        np.testing.assert_allclose([row.excess, row.t_excess, row.p_excess], [np.mean(excess), t, p], rtol=1e-7, atol=1e-12)
        tested += 1
    assert tested > 10
    table = table.reset_index()
    from statsmodels.stats.multitest import multipletests

    for role in HEAD_TYPES:
        rows = table[table.role == role]
        reject, adjusted, _, _ = multipletests(rows.p_excess, method="fdr_bh")
        np.testing.assert_allclose(rows.p_adj, adjusted)
        assert (rows.holds.to_numpy() == reject).all()
    # --head-type-mass: a head holds a role only where the corrected test rejects and its mean mass reaches the floor
    for floor in (float(table.value.median()), float(table.value.max()) + 1e-9):
        floored = run_headtypes(gpt2_64, examples, min_sample=5, min_mass=floor).set_index(["layer", "head", "role"])
        expected = table.set_index(["layer", "head", "role"])
        assert (floored.holds == (expected.holds & (expected.value >= floor))).all()
    assert not floored.holds.any()
    few = run_headtypes(gpt2_64, examples[:4], min_sample=5)
    assert few.p_excess.isna().all() and few.p_adj.isna().all() and not few.holds.any()  # below --min-sample: no p-value, no claim


def plant_previous_token_head(loaded, head: int, radius: float = 100.0, scale: float = 2000.0, offset: int = 1):
    """Make GPT-2's layer-0 head ``head`` attend to the previous position (``offset`` positions back: a head that copies by
    position), and every other head uniform (its queries zeroed).

    Position p's embedding puts ``radius (cos p theta, sin p theta)`` in coordinates 0, 1 and its negative in 2, 3, so the
    layer norm leaves ``4 (cos p theta, sin p theta)`` there whatever the token; the head's key reads those two coordinates and
    its query turns them back by ``offset`` steps: ``q_i . k_j`` is largest at ``j = i - offset``."""
    model, size, heads = loaded.model, loaded.model.config.n_embd, loaded.num_heads
    width, theta = size // heads, 2 * np.pi / 64
    positions = torch.arange(model.wpe.weight.shape[0], dtype=torch.float64) * theta
    angle = offset * theta
    turn = torch.tensor([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])  # x @ turn: x turned by -angle
    with torch.no_grad():
        model.wpe.weight.zero_()
        model.wpe.weight[:, 0], model.wpe.weight[:, 1] = radius * torch.cos(positions), radius * torch.sin(positions)
        model.wpe.weight[:, 2], model.wpe.weight[:, 3] = -model.wpe.weight[:, 0], -model.wpe.weight[:, 1]
        for layer, block in enumerate(model.h):
            for other in range(heads):
                query = slice(other * width, (other + 1) * width)
                block.attn.c_attn.weight[:, query] = 0
                block.attn.c_attn.bias[query] = 0
                if layer == 0 and other == head:
                    key = slice(size + other * width, size + (other + 1) * width)
                    block.attn.c_attn.weight[:, key], block.attn.c_attn.bias[key] = 0, 0
                    block.attn.c_attn.weight[0:2, key.start : key.start + 2] = torch.eye(2)
                    block.attn.c_attn.weight[0:2, query.start : query.start + 2] = scale * turn


def test_a_planted_previous_token_head_is_found_and_nothing_else(tiny_gpt2_dir):
    loaded = load_model(tiny_gpt2_dir, device="cpu")
    loaded.model.double()
    plant_previous_token_head(loaded, head=1)
    result = analyze(loaded, [text for text in TEXTS] + [e.text for e in repeat_corpus(count=4)], analyses=["headtypes"], min_sample=5,
                     view=False, progress=False)
    table = result.table("head_types")
    planted = table[(table.layer == 0) & (table["head"] == 1) & (table.role == PREVIOUS)].iloc[0]
    assert planted.value > 0.99 and planted.holds
    held = result.table("head_type_heads")
    assert list(zip(held.role, held.layer, held["head"])) == [(PREVIOUS, 0, 1)]
    assert result.claims() == {"headtypes": [f"0-1 previous-token head: {planted.value:.3f} vs uniform {planted.uniform:.3f} "
                                             f"(p_adj {planted.p_adj:.2g})"]}


def test_the_mass_floor_reaches_the_familys_test_from_the_command_line(tiny_gpt2_dir, tmp_path):
    """``--head-type-mass`` (issue 49): a planted previous-token head with a soft pointer (mass about 0.5) holds its role at the
    default floor, 0.3, and not at 0.6, above its mass, though its corrected test still rejects; no other head holds a role."""
    from test_cli import bertology

    loaded = load_model(tiny_gpt2_dir, device="cpu")
    plant_previous_token_head(loaded, head=1, scale=25.0)
    folder, corpus = tmp_path / "planted", tmp_path / "lines.txt"
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    corpus.write_text("\n".join([*TEXTS, *(e.text for e in repeat_corpus(count=4))]) + "\n", encoding="utf-8")

    def run(*floor):
        out = tmp_path / f"run{''.join(map(str, floor))}"
        done = bertology("headtypes", "--model", folder, "--corpus", corpus, "--min-sample", 5, "--out", out, "--device", "cpu", "--quiet", *floor)
        assert done.returncode == 0, done.stderr[-2000:]
        table = pd.read_csv(out / "head_types.csv")
        planted = table[(table.layer == 0) & (table["head"] == 1) & (table.role == PREVIOUS)].iloc[0]
        held = pd.read_csv(out / "head_type_heads.csv")
        return planted, list(zip(held.role, held.layer, held["head"])), done.stdout, json.loads((out / "manifest.json").read_text())

    planted, held, stdout, manifest = run()
    assert 0.4 < planted.value < 0.6 and planted.p_adj < 0.05 and planted.holds
    assert held == [(PREVIOUS, 0, 1)] and "claims: 1 (headtypes 1)" in stdout and manifest["settings"]["head_type_mass"] == 0.3
    floored, held, stdout, manifest = run("--head-type-mass", 0.6)
    assert floored.value == planted.value and floored.p_adj == planted.p_adj  # the same test; only the floor is above its mass
    assert not floored.holds and held == [] and "claims: 0" in stdout and manifest["settings"]["head_type_mass"] == 0.6


@pytest.mark.parametrize("model", ["tiny_gpt2_dir", "tiny_bert_dir"])
def test_the_uniform_null_makes_no_claim(model, request):
    loaded = load_model(request.getfixturevalue(model), device="cpu")
    result = analyze(loaded, [e.text for e in repeat_corpus(count=15)], analyses=["headtypes"], null="uniform", min_sample=5, view=False,
                     progress=False)
    table = result.table("head_types")
    assert (table.excess == 0).all() and (table.p_excess == 1).all() and not table.holds.any()
    assert result.claims() == {"headtypes": []} and result.claims_line().startswith("null model uniform: 0 claims")


def test_an_encoder_gets_duplicate_token_over_every_other_occurrence(bert64):
    assert head_types(bert64.kind) == (DUPLICATE,)
    examples = EXAMPLES + repeat_corpus(count=4) + [Example("the cat sat.", "the cat ran.")]
    table = run_headtypes(bert64, examples)
    assert set(table.role) == {DUPLICATE}
    special = set(bert64.tokenizer.all_special_ids)
    layers, heads = bert64.num_layers, bert64.num_heads
    scores, uniform = [], []
    bert64.model.config._attn_implementation = "eager"  # transformers' own maps, a pair with its segment ids, one sequence at a time
    try:
        references = []
        for example in examples:
            encoding = bert64.tokenizer(example.text, example.text_pair, return_tensors="pt")
            with torch.no_grad():
                maps = bert64.model(**encoding, output_attentions=True).attentions
            references.append({"ids": encoding["input_ids"][0].tolist(), "attentions": torch.stack(maps)[:, 0].numpy()})
    finally:
        bert64.model.config._attn_implementation = "bertology"
    for reference in references:
        ids = np.array(reference["ids"])
        words = np.array([piece not in special for piece in ids])  # [CLS] and both [SEP] are no occurrence of a token
        targets = (ids[:, None] == ids[None, :]) & words[:, None] & words[None, :] & ~np.eye(len(ids), dtype=bool)
        rows = targets.any(axis=1)
        if not rows.any():
            continue
        scores.append((reference["attentions"] * targets).sum(-1)[..., rows].mean(-1))
        uniform.append((targets.sum(-1) / len(ids))[rows].mean())
    got = table.set_index(["layer", "head"])
    np.testing.assert_allclose(got.value.to_numpy().reshape(layers, heads), np.mean(scores, axis=0), rtol=1e-9)
    np.testing.assert_allclose(got.uniform, np.mean(uniform), rtol=1e-9)
    assert (got.n == len(scores)).all()


@pytest.mark.parametrize("model", ["tiny_gpt2_dir", "tiny_llama_dir", "tiny_bert_dir"])
def test_the_synthetic_probe_tokenizes_back_to_the_pieces_drawn(model, request):
    loaded = load_model(request.getfixturevalue(model), device="cpu")
    tokenizer = loaded.tokenizer
    pool = whole_word_pieces(tokenizer)
    assert len(pool) > 10 and not set(pool) & set(tokenizer.all_special_ids)
    probe = list(synthetic_repeats(tokenizer, 6, 9, seed=4))
    assert [example.source for example in probe] == [f"synthetic:{k}" for k in range(1, 7)]
    for example in probe:
        ids = tokenizer(example.text, add_special_tokens=False)["input_ids"]
        assert len(ids) == 18 and ids[:9] == ids[9:] and set(ids) <= set(pool)
    assert [e.text for e in synthetic_repeats(tokenizer, 6, 9, seed=4)] == [e.text for e in probe]  # seeded
    assert [e.text for e in synthetic_repeats(tokenizer, 6, 9, seed=5)] != [e.text for e in probe]


def test_induction_on_the_synthetic_probe_is_prefix_matching(llama64):
    """Through analyze: the probe drawn from the model's vocabulary with the run's seed, the induction score against the eager
    reference; on the probe's second half every query has exactly one target."""
    result = analyze(llama64, synthetic_repeats=8, synthetic_length=7, seed=2, analyses=["headtypes"], min_sample=5, view=False,
                     progress=False)
    assert result.corpus["name"] == "synthetic-repeats-8x7" and result.corpus["examples"] == 8
    probe = list(synthetic_repeats(llama64.tokenizer, 8, 7, seed=2))
    assert all(example.second_copy == 7 for example in probe)
    halves = [llama64.tokenizer(example.text, add_special_tokens=False)["input_ids"][:7] for example in probe]
    assert any(len(set(half)) < 7 for half in halves)  # chance repeats in a first copy, whose rows prefix matching leaves out
    expected = reference_table(llama64, probe)
    assert_matches(result.table("head_types"), expected, rtol=1e-6, atol=1e-12)  # eager Llama's softmax is float32
    # the first copy's chance repeats count not: every counted row is in the second copy, where each query has one target
    first = eager_reference(llama64, probe[:1])[0]["ids"]
    assert first[0] == llama64.tokenizer.bos_token_id and len(first) == 1 + 2 * 7
    assert second_copy_rows(np.array(first), set(llama64.tokenizer.all_special_ids), 7).tolist() == [False] * 8 + [True] * 7
    with pytest.raises(BertologyError, match="give no corpus"):
        analyze(llama64, ["a line"], synthetic_repeats=2, view=False, progress=False)


def test_the_command_line_runs_the_synthetic_probe(tiny_gpt2_dir, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "analyze", "--model", str(tiny_gpt2_dir), "--synthetic-repeats", "12",
                           "--synthetic-length", "8", "--no-profile", "--no-sinks", "--no-roles", "--no-patterns", "--no-rollout", "--out", str(out),
                           "--device", "cpu", "--quiet"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "induction heads:" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["analyses"] == ["headtypes"] and manifest["corpus"]["name"] == "synthetic-repeats-12x8"
    table = pd.read_csv(out / "head_types.csv")
    assert len(table) == 2 * 4 * 3 and (table[table.role == INDUCTION].n == 12).all()
    assert (out / "head_type_heads.csv").is_file() and (out / "head_types_grid.png").is_file()
    assert "Head types: previous-token, duplicate-token, induction" in (out / "report.html").read_text()


def test_on_real_sentences_every_score_equals_transformer_lens_with_the_denominator_fixed(gpt2_64, shared_data):
    """Natural text, where tokens repeat by chance rather than by design: the first 30 sentences of the UD English EWT test
    set (../shared/data; skipped without it), padded batches of eight through bertology's hook, against each sentence alone
    through transformers' eager attention and the TransformerLens port."""
    from bertology.core.text.corpora import Corpus

    examples = list(itertools.islice(Corpus(shared_data / "ud_english_ewt" / "en_ewt-ud-test.conllu"), 30))
    table, expected = run_headtypes(gpt2_64, examples, batch_size=8), reference_table(gpt2_64, examples)
    assert (expected.n >= 20).all()  # most sentences have a row with a target of every role
    assert_matches(table, expected, rtol=1e-9, atol=1e-12)
