"""Michel et al.'s importance and pruning on decoders (METHODS.md sections 6 and 10): the causal LM loss against transformers'
own ``labels=`` loss, the importance against autograd and finite differences on transformers' own model with a gate on each
head, padding that changes nothing, the pruning curve against the masked model's loss, and the commands end to end."""

import json
import subprocess
import sys
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TEXTS
from transformers import AutoModelForCausalLM, AutoTokenizer

from bertology.core.errors import BertologyError, ModelError
from bertology.core.learning.tasks import NEXT_TOKEN_LOSS, load_language_model, next_token_losses, seeded_subset
from bertology.core.text.corpora import Example
from bertology.studies.heads.importance import GradientImportance, normalise_importance
from bertology.studies.heads.pruning import pruning_curve
from bertology.studies.heads.study import study_heads

KINDS = ("gpt2", "llama")


@pytest.fixture(scope="module", params=KINDS)
def decoder(request, tiny_decoder_dirs):
    """``(kind, folder, LanguageModel in float64)``."""
    folder = tiny_decoder_dirs[request.param]
    language_model = load_language_model(folder, device="cpu")
    language_model.model.double()
    return request.param, folder, language_model


class GatedReference:
    """Transformers' own causal LM, no bertology hook (its SDPA attention: float64 throughout, where Llama's eager one takes the
    softmax in float32), with a gate ``xi[layer, head]`` on each head's slice of the output projection's input (GPT-2's
    ``c_proj``, Llama's ``o_proj``). The loss of one text alone is the mean next-token cross-entropy of its logits, what
    ``model(ids, labels=ids).loss`` computes (that one in float32: transformers upcasts the logits to float, so it is
    compared to 1e-6 only; float64 is kept here for exactness)."""

    def __init__(self, kind, folder):
        self.model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").double().eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        config = self.model.config
        self.layers, self.heads = config.num_hidden_layers, config.num_attention_heads
        size = config.hidden_size // self.heads
        blocks = [layer.attn.c_proj for layer in self.model.transformer.h] if kind == "gpt2" else [layer.self_attn.o_proj for layer in self.model.model.layers]
        self.gates = torch.ones(self.layers, self.heads, dtype=torch.float64)
        for layer, projection in enumerate(blocks):
            projection.register_forward_pre_hook(lambda module, args, layer=layer: (args[0] * self.gates[layer].repeat_interleave(size),))

    def ids(self, text):
        return self.tokenizer(text, return_tensors="pt")["input_ids"]

    def loss(self, text, gates=None, labels=False):
        """``L(text)`` with the gates at ``gates`` (default all 1); ``labels``: transformers' own ``labels=`` loss instead."""
        self.gates = torch.ones(self.layers, self.heads, dtype=torch.float64) if gates is None else gates
        ids = self.ids(text)
        if labels:
            return self.model(ids, labels=ids).loss
        return torch.nn.functional.cross_entropy(self.model(ids).logits[0, :-1], ids[0, 1:])

    def gradients(self, texts):
        """``dL(x)/d xi`` ``[texts, layers, heads]``, one text at a time."""
        out = []
        for text in texts:
            gates = torch.ones(self.layers, self.heads, dtype=torch.float64, requires_grad=True)
            out.append(torch.autograd.grad(self.loss(text, gates), gates)[0].numpy())
        return np.stack(out)

    def corpus_loss(self, texts, masked=()):
        """The next-token cross-entropy over every predicted piece of ``texts`` with the heads ``masked`` zeroed: each text's
        mean loss weighted by its ``n - 1`` predicted pieces."""
        gates = torch.ones(self.layers, self.heads, dtype=torch.float64)
        for layer, head in masked:
            gates[layer, head] = 0.0
        with torch.no_grad():
            losses = [self.loss(text, gates).item() * (self.ids(text).shape[1] - 1) for text in texts]
        return sum(losses) / sum(self.ids(text).shape[1] - 1 for text in texts)


@pytest.fixture(scope="module")
def reference(decoder):
    kind, folder, _ = decoder
    return GatedReference(kind, folder)


def test_the_loss_of_a_padded_batch_is_each_texts_own_labels_loss(decoder, reference):
    _, _, language_model = decoder
    rows = language_model.encode([Example(t) for t in TEXTS])
    assert len({len(row["input_ids"]) for row in rows}) > 3  # the batch is padded
    batched = language_model.losses(rows).detach().numpy()
    alone = np.array([language_model.losses([row]).item() for row in rows])
    by_hand = np.array([reference.loss(text).item() for text in TEXTS])
    np.testing.assert_allclose(batched, alone, rtol=1e-12)
    np.testing.assert_allclose(batched, by_hand, rtol=1e-10)
    np.testing.assert_allclose(batched, [reference.loss(text, labels=True).item() for text in TEXTS], rtol=1e-6)


def test_next_token_losses_ignore_whatever_the_padding_holds():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator, dtype=torch.float64)
    input_ids = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 1, 2]])
    mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    summed, predicted = next_token_losses(logits, input_ids, mask)
    assert predicted.tolist() == [2, 4]
    by_hand = -sum(torch.log_softmax(logits[0, i], -1)[input_ids[0, i + 1]] for i in range(2))
    assert summed[0].item() == pytest.approx(by_hand.item(), rel=1e-12)
    scrambled_logits, scrambled_ids = logits.clone(), input_ids.clone()
    scrambled_logits[0, 3:] = torch.randn(2, 7, generator=generator, dtype=torch.float64)
    scrambled_ids[0, 3:] = torch.tensor([6, 5])
    again, _ = next_token_losses(scrambled_logits, scrambled_ids, mask)
    assert torch.equal(again, summed)


def test_importance_equals_autograd_on_transformers_own_gated_model(decoder, reference):
    _, _, language_model = decoder
    rows = language_model.encode([Example(t) for t in TEXTS])
    padded = GradientImportance(language_model, batch_size=3, progress=False).attribute(rows)
    one_by_one = GradientImportance(language_model, batch_size=1, progress=False).attribute(rows)
    expected = np.abs(reference.gradients(TEXTS)).mean(axis=0)  # Michel et al.: E_x |dL(x)/d xi_h|
    assert expected.min() > 0
    np.testing.assert_allclose(padded, expected, rtol=1e-9)
    np.testing.assert_allclose(one_by_one, padded, rtol=1e-12)  # padding changes nothing


def test_the_reference_gradient_is_the_finite_difference_of_the_loss(tiny_gpt2_dir):
    """On GPT-2, float64 throughout (Llama's RMSNorm computes in float32, too coarse for a difference quotient)."""
    reference = GatedReference("gpt2", tiny_gpt2_dir)
    gradients = reference.gradients(TEXTS[:2])
    eps = 1e-6
    for layer, head in [(0, 1), (1, 3)]:
        for k, text in enumerate(TEXTS[:2]):
            up, down = torch.ones(2, 4, dtype=torch.float64), torch.ones(2, 4, dtype=torch.float64)
            up[layer, head], down[layer, head] = 1 + eps, 1 - eps
            with torch.no_grad():
                numeric = (reference.loss(text, up).item() - reference.loss(text, down).item()) / (2 * eps)
            assert gradients[k, layer, head] == pytest.approx(numeric, rel=1e-6, abs=1e-12)


def test_pruning_masks_the_least_important_heads_and_the_loss_is_the_masked_models(decoder, reference):
    _, _, language_model = decoder
    rows = language_model.encode([Example(t) for t in TEXTS])
    curve = pruning_curve(language_model, rows, partial(language_model.score, rows, 4), step=0.25, progress=False)
    table = curve.table.pivot(index="heads_pruned", columns="metric", values="value")
    assert table.index.tolist() == [0, 2, 4, 6]
    first = normalise_importance(GradientImportance(language_model, progress=False).attribute(rows))
    lowest = {tuple(map(int, np.unravel_index(k, first.shape))) for k in np.argsort(first, axis=None)[:2]}
    assert {tuple(map(int, pair)) for pair in np.argwhere(curve.masks[2] == 0)} == lowest
    for pruned, mask in curve.masks.items():
        masked = [tuple(map(int, pair)) for pair in np.argwhere(mask == 0)]
        expected = reference.corpus_loss(TEXTS, masked)
        assert table.loc[pruned, "lm_loss"] == pytest.approx(expected, rel=1e-10)
        assert table.loc[pruned, "perplexity"] == pytest.approx(np.exp(expected), rel=1e-10)
    assert abs(table.loc[6, "lm_loss"] - table.loc[0, "lm_loss"]) > 1e-5  # pruning changed the loss


def test_study_heads_on_a_corpus_measures_the_seeded_subset_and_names_the_loss(decoder, reference, tmp_path):
    _, _, language_model = decoder
    study = study_heads(language_model, corpus=TEXTS, importance=True, importance_examples=5, out=tmp_path / "run", progress=False)
    chosen = [example.text for example in seeded_subset([Example(t) for t in TEXTS], 5, 0)]
    expected = np.abs(reference.gradients(chosen)).mean(axis=0)
    np.testing.assert_allclose(study.importance.importance.to_numpy().reshape(2, 4), expected, rtol=1e-9)
    assert study.baseline["lm_loss"] == pytest.approx(reference.corpus_loss(TEXTS), rel=1e-10)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["loss"] == NEXT_TOKEN_LOSS and manifest["corpus"]["examples"] == 8 and manifest["importance_examples"] == 5
    assert "importance_split" not in manifest["settings"]
    assert NEXT_TOKEN_LOSS in (tmp_path / "run" / "report.html").read_text()


@pytest.mark.parametrize("settings, message", [
    ({"importance": True, "importance_split": "dev"}, "^--importance-split applies only to a task"),
    ({"prune": True, "prune_to": 4}, "--prune-to removes heads physically, which bertology knows for encoders"),
])
def test_what_does_not_apply_to_a_corpus_is_refused_in_one_line(tiny_gpt2_dir, settings, message):
    with pytest.raises(BertologyError, match=message) as refused:
        study_heads(str(tiny_gpt2_dir), corpus=TEXTS, device="cpu", progress=False, **settings)
    assert "\n" not in str(refused.value)


def test_an_encoder_has_no_causal_lm_loss(tiny_bert_dir):
    with pytest.raises(ModelError, match="is an encoder, not a causal language model"):
        study_heads(str(tiny_bert_dir), corpus=TEXTS, importance=True, device="cpu", progress=False)


def bertology(*args):
    return subprocess.run([sys.executable, "-m", "bertology.cli", *map(str, args)], capture_output=True, text=True, timeout=300)


def test_importance_and_prune_commands_on_a_decoder_folder_and_a_text_file(tiny_gpt2_dir, tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    done = bertology("importance", "--model", tiny_gpt2_dir, "--corpus", corpus, "--device", "cpu", "-q", "--out", tmp_path / "importance")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("text.txt: 8 texts; with no intervention: lm_loss ")
    assert f"importance measured on 8 texts of the corpus ({NEXT_TOKEN_LOSS})" in done.stdout
    table = pd.read_csv(tmp_path / "importance" / "importance.csv")
    assert len(table) == 2 * 4 and (table.importance > 0).all()
    assert json.loads((tmp_path / "importance" / "manifest.json").read_text())["loss"] == NEXT_TOKEN_LOSS

    done = bertology("prune", "-m", tiny_gpt2_dir, "-c", corpus, "--step", 0.25, "--device", "cpu", "-q", "--out", tmp_path / "prune")
    assert done.returncode == 0, done.stderr
    assert "heads can be pruned before lm_loss rises by more than 0.01 nats" in done.stdout
    pruning = pd.read_csv(tmp_path / "prune" / "pruning.csv")
    assert set(pruning.metric) == {"lm_loss", "perplexity"} and pruning.heads_pruned.max() == 8 - 2
    assert (tmp_path / "prune" / "pruning_curve.png").is_file()


@pytest.mark.parametrize("args, message", [
    (["--corpus", "{corpus}", "{task}"], "give a TASK (for a classifier) or --corpus (for a causal language model), not both"),
    ([], "give a TASK folder (or --train and --dev) for a classifier, or --corpus for a causal language model"),
    (["--corpus", "{corpus}", "--prune-to", "4"], "--prune-to removes heads physically"),
])
def test_the_prune_command_refuses_in_one_line(tiny_gpt2_dir, cat_task, tmp_path, args, message):
    from typer.testing import CliRunner

    from bertology.cli import app

    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    given = [arg.format(corpus=corpus, task=cat_task) for arg in args]
    result = CliRunner().invoke(app, ["prune", "-m", str(tiny_gpt2_dir), "--device", "cpu", "-q", "--out", str(tmp_path / "run"), *given])
    assert isinstance(result.exception, BertologyError) and str(result.exception).startswith(message)
    assert "\n" not in str(result.exception) and not (tmp_path / "run").exists()
