"""``bertology ablate``'s zero, mean and resample ablation (issue 51, docs/methods.md#importance-ablation-and-pruning): each
against a reference written from transformers' own modules (a forward pre-hook on the output projection that replaces the
head's slice, each text run alone, float64), ``mask`` against ``zero`` and against the old head gate, output projections at
zero (every change exactly 0, nothing matters) beside a planted head (it matters), every bad input in one line, and the
command line's table against the Python API."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import CLASSIFIER_SENTENCES, TEXTS
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from typer.testing import CliRunner

from bertology.cli import app
from bertology.core.errors import BertologyError
from bertology.core.learning.tasks import TaskData, load_language_model, load_task, load_task_model
from bertology.core.model.interventions import Intervention
from bertology.core.text.corpora import Example
from bertology.studies.heads.ablation import COLUMNS, LeaveOneOut, ablation_table, loss_ablation_table
from bertology.studies.heads.replacements import draw_donors
from bertology.studies.heads.study import study_heads

KINDS = ("gpt2", "llama")
#: 20 texts: enough for --min-sample 10.
CORPUS = TEXTS + CLASSIFIER_SENTENCES


@pytest.fixture(scope="module", params=KINDS)
def decoder(request, tiny_decoder_dirs):
    """``(kind, folder, LanguageModel in float64, its encoded TEXTS)``."""
    folder = tiny_decoder_dirs[request.param]
    language_model = load_language_model(folder, device="cpu")
    language_model.model.double()
    return request.param, folder, language_model, language_model.encode([Example(text) for text in TEXTS])


def projections(model, kind: str) -> list[torch.nn.Module]:
    """Each layer's output projection by transformers' own module names."""
    return [block.attn.c_proj for block in model.transformer.h] if kind == "gpt2" else [block.self_attn.o_proj for block in model.model.layers]


class Reference:
    """Transformers' own causal LM in float64 (SDPA attention, no bertology hook), each text run alone and unpadded: its
    output projections' inputs ``z`` and its summed next-token cross-entropy with a head's slice replaced."""

    def __init__(self, folder, kind: str):
        self.model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").double().eval()
        self.modules = projections(self.model, kind)
        self.heads = self.model.config.num_attention_heads
        self.width = self.model.config.hidden_size // self.heads

    def inputs(self, ids: list[int]) -> list[torch.Tensor]:
        """Each layer's ``z`` ``[pieces, heads * d_head]`` on ``ids``."""
        seen = []
        handles = [module.register_forward_pre_hook(lambda m, args: seen.append(args[0][0].clone())) for module in self.modules]
        with torch.no_grad():
            self.model(input_ids=torch.tensor([ids]))
        for handle in handles:
            handle.remove()
        return seen

    def loss(self, ids: list[int], layer: int | None = None, head: int = -1, value: torch.Tensor | None = None) -> float:
        """``ids``' summed next-token cross-entropy, with head ``head`` of ``layer`` (-1: every head) reading ``value``
        ``[pieces, heads * d_head]`` instead of its own slice."""
        columns = slice(None) if head < 0 else slice(head * self.width, (head + 1) * self.width)

        def put(module, args):
            z = args[0].clone()
            z[0, :, columns] = value[:, columns]
            return (z,)

        handle = self.modules[layer].register_forward_pre_hook(put) if layer is not None else None
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0]
        if handle is not None:
            handle.remove()
        return float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum"))

    def changes(self, texts: list[list[int]], value) -> np.ndarray:
        """``[layers * (heads + 1), texts]``: each head, then the whole layer, read ``value(text, layer)``; less the intact loss."""
        intact = [self.loss(ids) for ids in texts]
        return np.array([[self.loss(ids, layer, head, value(i, layer)) - intact[i] for i, ids in enumerate(texts)]
                         for layer in range(len(self.modules)) for head in [*range(self.heads), -1]])


def _predicted_changes(language_model, rows, intervention, **settings) -> tuple[np.ndarray, LeaveOneOut]:
    """``[variants, draws, texts]``: bertology's change of each text's summed cross-entropy, and the method that computed it."""
    loo = LeaveOneOut(language_model, intervention, batch_size=3, progress=False, **settings)
    base, variants = loo.predict(rows)
    return variants[..., 0] - base[None, None, :, 0], loo


def test_zero_ablation_equals_the_reference_and_mask_is_its_name(decoder):
    kind, folder, language_model, rows = decoder
    reference = Reference(folder, kind)
    texts = [row["input_ids"] for row in rows]
    expected = reference.changes(texts, lambda i, layer: torch.zeros(len(texts[i]), reference.heads * reference.width, dtype=torch.float64))
    assert np.abs(expected).max() > 1e-2  # the heads change the loss: a wrong head or layer would show
    zero, _ = _predicted_changes(language_model, rows, "zero")
    np.testing.assert_allclose(zero[:, 0], expected, rtol=0, atol=1e-9)
    mask, _ = _predicted_changes(language_model, rows, "mask")
    np.testing.assert_array_equal(mask, zero)
    # the old head gate (Michel et al.'s xi_h = 0) gives the same lm_loss as zero ablation's table
    table = study_heads(language_model, corpus=TEXTS, ablate=True, intervention="mask", bootstrap=200, progress=False).ablation
    gated = language_model.score(rows, intervention=Intervention.of("mask", 1, 2))["lm_loss"]
    assert table.query("metric == 'lm_loss' and layer == 1 and head == 2").value.item() == pytest.approx(gated, rel=1e-10)


@pytest.mark.parametrize("mean_over", ["positions", "examples"])
def test_mean_ablation_equals_the_reference(decoder, mean_over):
    kind, folder, language_model, rows = decoder
    reference = Reference(folder, kind)
    texts = [row["input_ids"] for row in rows]
    z = [reference.inputs(ids) for ids in texts]  # [text][layer] -> [pieces, width]
    layers = len(reference.modules)
    if mean_over == "positions":
        means = [torch.cat([z_text[layer] for z_text in z]).mean(0) for layer in range(layers)]
        value = lambda i, layer: means[layer].expand(len(texts[i]), -1)  # noqa: E731
    else:
        def value(i, layer):
            return torch.stack([torch.stack([z_text[layer][j] for z_text in z if len(z_text[layer]) > j]).mean(0) for j in range(len(texts[i]))])
    expected = reference.changes(texts, value)
    changes, _ = _predicted_changes(language_model, rows, "mean", mean_over=mean_over)
    np.testing.assert_allclose(changes[:, 0], expected, rtol=0, atol=1e-9)
    zero, _ = _predicted_changes(language_model, rows, "zero")
    assert np.abs(changes - zero).max() > 1e-3  # mean ablation is not zero ablation here


def test_resample_ablation_equals_the_reference_draw_by_draw(decoder):
    kind, folder, language_model, rows = decoder
    reference = Reference(folder, kind)
    texts = [row["input_ids"] for row in rows]
    z = [reference.inputs(ids) for ids in texts]
    fill = [torch.cat([z_text[layer] for z_text in z]).mean(0) for layer in range(len(reference.modules))]
    changes, loo = _predicted_changes(language_model, rows, "resample", resamples=3, seed=4)
    donors = loo.replacement.donors
    assert changes.shape[1] == 3 and donors.shape == (3, len(texts))
    for draw in range(3):
        def value(i, layer, draw=draw):
            donor = z[donors[draw, i]][layer][: len(texts[i])]  # the donor's z at the same piece index, the mean past its end
            return torch.cat([donor, fill[layer].expand(len(texts[i]) - len(donor), -1)])

        np.testing.assert_allclose(changes[:, draw], reference.changes(texts, value), rtol=0, atol=1e-9)
    table = study_heads(language_model, corpus=TEXTS, ablate=True, intervention="resample", resamples=3, seed=4, bootstrap=200,
                        progress=False).ablation
    pieces = np.array([len(ids) - 1 for ids in texts])
    expected_loss = np.array([language_model.score(rows)["lm_loss"]]) + changes.mean(1).sum(1) / pieces.sum()  # averaged over the draws
    np.testing.assert_allclose(table.query("metric == 'lm_loss'").value, expected_loss, rtol=1e-9)


def test_donors_are_other_examples_long_enough_and_seeded():
    lengths = np.array([3, 5, 5, 8, 2, 9])
    donors = draw_donors(lengths, lengths, 200, seed=1, same=True)
    for i, length in enumerate(lengths):
        assert i not in donors[:, i]
        expected = {j for j in range(6) if j != i and lengths[j] >= length} or {3}  # the longest (9) has only the longest other, 8
        assert set(donors[:, i]) == expected
    np.testing.assert_array_equal(donors, draw_donors(lengths, lengths, 200, seed=1, same=True))
    assert not np.array_equal(donors, draw_donors(lengths, lengths, 200, seed=2, same=True))
    assert set(draw_donors(np.array([4]), np.array([4, 1]), 50, seed=0, same=False)[:, 0]) == {0}  # another file: itself may donate


def test_the_loss_table_by_hand():
    """``lm_loss = sum s / sum pieces`` with each text's ``s`` averaged over the draws, ``perplexity = exp(lm_loss)``; a variant that
    changes nothing has p 1, one that raises every text's loss has p 2/(B + 1) and matters."""
    pieces = np.array([3.0, 5.0, 2.0, 4.0] * 3)
    base = 2.0 * pieces
    variants = np.stack([np.stack([base, base]), np.stack([base + 1.0, base + 3.0])])  # [2 variants, 2 draws, 12 texts]
    layout = pd.DataFrame({"layer": [0, 0], "head": [0, -1]})
    table = loss_ablation_table(base, variants, pieces, layout, "resample", replicates=400, seed=3)
    assert list(table.columns) == COLUMNS and table.metric.tolist() == ["lm_loss", "lm_loss", "perplexity", "perplexity"]
    raised = 2.0 + 12 * 2.0 / pieces.sum()  # each text +2 nats on average over the draws
    np.testing.assert_allclose(table.value, [2.0, raised, np.exp(2.0), np.exp(raised)], rtol=1e-12)
    np.testing.assert_allclose(table.delta, [0.0, raised - 2.0, 0.0, np.exp(raised) - np.exp(2.0)], rtol=1e-12, atol=0)
    assert table.p.tolist() == [1.0, 2 / 401, 1.0, 2 / 401] and table.matters.tolist() == [False, True, False, True]
    assert (table.ci_low[table.delta > 0] > 0).all() and (table.n == 12).all()


def test_a_task_metric_over_draws_is_that_of_the_mean_confusion_matrix():
    task = TaskData("sst2", ("accuracy",), ("0", "1"), [], [])
    gold = np.tile([1, 0, 1, 1, 0, 0, 1, 0], 5)
    right = np.eye(2)[gold]
    half = np.eye(2)[np.where(np.arange(40) < 20, 1 - gold, gold)]
    table = ablation_table(task, gold, right, np.stack([np.stack([right, half])]), pd.DataFrame({"layer": [0], "head": [0]}), "resample",
                           replicates=300, seed=0)
    assert table.value.tolist() == [0.75] and table.delta.tolist() == [-0.25] and table.matters.tolist() == [True]


def test_uniform_ablation_of_a_decoder_equals_its_gate_path(decoder):
    _, _, language_model, rows = decoder
    table = study_heads(language_model, corpus=TEXTS, ablate=True, intervention="uniform", bootstrap=200, progress=False).ablation
    for layer, head in [(0, 1), (1, -1)]:
        flat = language_model.score(rows, intervention=Intervention.of("uniform", layer, head))["lm_loss"]
        assert table.query(f"metric == 'lm_loss' and layer == {layer} and head == {head}").value.item() == pytest.approx(flat, rel=1e-10)


def _projections_zeroed(language_model, kind: str, keep: tuple[int, int] | None = None):
    """``language_model`` with every output projection's weight at 0 (biases kept), but head ``keep``'s columns times 20."""
    width = language_model.model.config.hidden_size // language_model.model.config.num_attention_heads
    with torch.no_grad():
        for layer, module in enumerate(projections(language_model.model, kind)):
            weight = module.weight.clone()
            module.weight.zero_()
            if keep is not None and keep[0] == layer:
                columns = slice(keep[1] * width, (keep[1] + 1) * width)
                if kind == "gpt2":  # Conv1D: weight [in, out]
                    module.weight[columns] = 20 * weight[columns]
                else:
                    module.weight[:, columns] = 20 * weight[:, columns]
    return language_model


@pytest.mark.parametrize("kind", KINDS)
def test_zero_output_projections_change_nothing_and_nothing_matters(kind, tiny_decoder_dirs):
    language_model = _projections_zeroed(load_language_model(tiny_decoder_dirs[kind], device="cpu"), kind)
    for intervention, settings in [("zero", {}), ("mean", {"mean_over": "examples"}), ("resample", {"resamples": 2}), ("uniform", {})]:
        table = study_heads(language_model, corpus=CORPUS, ablate=True, intervention=intervention, bootstrap=500, progress=False, **settings).ablation
        assert (table.delta == 0).all() and (table.ci_low == 0).all() and (table.ci_high == 0).all(), intervention
        assert (table.p == 1).all() and not table.matters.any() and (table.n == len(CORPUS)).all()


def test_a_planted_head_and_its_layer_are_all_that_matter(tiny_gpt2_dir):
    """Every output projection at 0 but head 1-2's (times 20), the tied embedding times 10 so that the logits feel it: zero and
    mean ablation find that head and its layer, and only them; resample ablation changes nothing else (its donors' head 1-2
    carries much the same, so it is not asked to matter)."""
    language_model = _projections_zeroed(load_language_model(tiny_gpt2_dir, device="cpu"), "gpt2", keep=(1, 2))
    with torch.no_grad():
        language_model.model.transformer.wte.weight.mul_(10)
    for intervention in ("zero", "mean", "resample"):
        table = study_heads(language_model, corpus=CORPUS, ablate=True, intervention=intervention, bootstrap=1000, progress=False).ablation
        planted = (table.layer == 1) & table["head"].isin([2, -1])
        assert (table[~planted].delta == 0).all() and (table[planted].delta != 0).all(), intervention
        if intervention != "resample":
            mattering = table[table.matters & (table.metric == "lm_loss")]
            assert mattering[["layer", "head"]].values.tolist() == [[1, 2], [1, -1]], intervention


def test_mean_ablation_of_a_classifier_equals_the_reference(tiny_classifier_dir, cat_task):
    """The first-token classifier (its last layer computed for [CLS] alone) against transformers' own BERT, each example alone."""
    task_model = load_task_model(tiny_classifier_dir, device="cpu")
    task_model.model.double()
    rows, _ = task_model.encode(load_task(cat_task).dev, "dev.tsv")
    loo = LeaveOneOut(task_model, "mean", mean_over="examples", batch_size=5, progress=False)
    _, variants = loo.predict(rows)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir, attn_implementation="eager").double().eval()
    modules = [layer.attention.output.dense for layer in model.bert.encoder.layer]
    seen = {}
    handles = [module.register_forward_pre_hook(lambda m, args, layer=layer: seen.setdefault(layer, []).append(args[0][0].clone()))
               for layer, module in enumerate(modules)]
    with torch.no_grad():
        for row in rows:
            model(input_ids=torch.tensor([row["input_ids"]]))
    for handle in handles:
        handle.remove()
    for index, (layer, head) in enumerate(loo.variants().itertuples(index=False)):
        columns = slice(None) if head < 0 else slice(head * 8, (head + 1) * 8)
        for i, row in enumerate(rows):
            means = torch.stack([torch.stack([z[j] for z in seen[layer] if len(z) > j]).mean(0) for j in range(len(row["input_ids"]))])

            def put(module, args, means=means, columns=columns):
                z = args[0].clone()
                z[0, :, columns] = means[:, columns]
                return (z,)

            handle = modules[layer].register_forward_pre_hook(put)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
            handle.remove()
            np.testing.assert_allclose(variants[index, 0, i], logits.numpy(), rtol=0, atol=1e-9)


def ablate(*args) -> tuple[int, str]:
    """The exit code and the output of ``bertology ablate ARGS`` run here; a refusal's output is its error's text."""
    result = CliRunner().invoke(app, ["ablate", *map(str, args), "--device", "cpu", "-q"])
    if isinstance(result.exception, BertologyError):
        return 2, str(result.exception)
    return result.exit_code, result.output


@pytest.mark.parametrize("args, message", [
    (["--intervention", "drop"], "unknown intervention 'drop'; use zero, mask, mean, resample or uniform"),
    (["--intervention", "resample", "--resamples", "0"], "--resamples must be at least 1, not 0"),
    (["--intervention", "mean", "--reference", "{folder}/missing.txt"], "missing.txt: no such file"),
    (["--intervention", "mean", "--reference", "{folder}/blank.txt"], "blank.txt: the --reference holds no text to take z_h from"),
    (["--intervention", "resample", "--reference", "{folder}/short.txt"], "short.txt: no text of the --reference has two pieces or more"),
    (["--intervention", "mean", "--mean-over", "tokens"], "unknown --mean-over 'tokens'; use positions or examples"),
    (["--resamples", "3"], "--resamples applies only to --intervention resample"),
    (["--intervention", "uniform", "--reference", "{folder}/short.txt"], "--reference applies only to --intervention mean or resample"),
])
def test_bad_input_is_refused_in_one_line_and_nothing_is_written(tiny_gpt2_dir, tmp_path, args, message):
    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "short.txt").write_text("a\n.\n")
    code, output = ablate("-m", tiny_gpt2_dir, "--corpus", corpus, "--out", tmp_path / "run", *(arg.format(folder=tmp_path) for arg in args))
    assert code == 2 and message in output and "\n" not in output, output
    assert not (tmp_path / "run").exists()


def test_the_command_line_writes_the_table_of_the_python_api(tiny_gpt2_dir, tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(CORPUS) + "\n")
    reference = tmp_path / "reference.txt"
    reference.write_text("\n".join(TEXTS[:5]) + "\n")
    code, output = ablate("-m", tiny_gpt2_dir, "--corpus", corpus, "--intervention", "mean", "--reference", reference, "--bootstrap", 300,
                          "--out", tmp_path / "run")
    assert code == 0, output
    assert "mean ablation (z_h's mean over every position of reference.txt) of each head and layer on 20 texts" in output
    table = pd.read_csv(tmp_path / "run" / "ablation.csv")
    assert list(table.columns) == COLUMNS and len(table) == 2 * 2 * (4 + 1)
    api = study_heads(str(tiny_gpt2_dir), corpus=corpus, ablate=True, intervention="mean", reference=reference, bootstrap=300, device="cpu",
                      progress=False).ablation
    pd.testing.assert_frame_equal(table, api, check_exact=False, rtol=1e-12)
    assert set(table.intervention) == {"mean"} and set(table.metric) == {"lm_loss", "perplexity"} and (table.n == 20).all()
    lm_loss = table[table.metric == "lm_loss"]
    np.testing.assert_allclose(table[table.metric == "perplexity"].value, np.exp(lm_loss.value), rtol=1e-12)
    assert (lm_loss.delta != 0).any() and (table.p >= 2 / 301).all()


def test_a_decoder_given_a_task_is_told_that_a_task_needs_a_classifier_and_a_decoder_a_corpus(tiny_gpt2_dir, cat_task, tmp_path):
    code, output = ablate(cat_task, "--model", tiny_gpt2_dir, "--out", tmp_path / "run")
    assert code != 0 and len(output.strip().splitlines()) == 1, output
    assert "a GPT2LMHeadModel, not a sequence classifier" in output and "--corpus instead of a task" in output
    assert not (tmp_path / "run").exists()


def test_a_change_within_float_rounding_of_the_metric_never_matters():
    """Two variants whose loss changes exclude 0 by their intervals: one of 1e-7 nats on a loss of 5 (float rounding), one of
    1e-2; only the second matters."""
    from bertology.studies.heads.ablation import loss_ablation_table

    rng = np.random.default_rng(0)
    n = 40
    pieces = np.full(n, 10.0)
    base = 50.0 + rng.normal(0, 1, n)  # summed cross-entropy: 5 nats a piece
    variants = np.stack([base + 1e-6 * (1 + 0.1 * rng.normal(size=n)), base + 0.1 * (1 + 0.1 * rng.normal(size=n))])[:, None, :]
    table = loss_ablation_table(base, variants, pieces, pd.DataFrame({"layer": [0, 0], "head": [0, 1]}), "zero", replicates=1000)
    rows = table[table.metric == "lm_loss"]
    assert (rows.ci_low > 0).all() and (rows.p_adj < 0.05).all() and rows.matters.tolist() == [False, True]
