"""[SEP] as a no-op (Clark et al. 2019, section 3.2; METHODS.md section 9): dL/da against finite differences and against
transformers' own eager attention, the per-layer table against numpy, the loss options and the command; on decoders (METHODS.md
section 10) the causal LM loss, the first token in [CLS]'s place and no [SEP]."""

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TEXTS
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError, ModelError
from bertology.core.learning.tasks import NEXT_TOKEN_LOSS, load_task, masked_positions
from bertology.core.model.hooks import Hooks
from bertology.core.model.kinds import DECODER, ENCODER
from bertology.core.model.models import load_model
from bertology.core.text.corpora import Example
from bertology.studies.gradients.gradients import AttentionGradients, attention_gradients, gradient_targets

ENCODER_TARGETS, DECODER_TARGETS = ("sep", "cls", "punct", "all"), ("first", "punct", "all")


def test_the_targets_are_the_kinds_anchors_punctuation_and_every_key():
    assert gradient_targets(ENCODER) == ENCODER_TARGETS
    assert gradient_targets(DECODER) == DECODER_TARGETS  # no [SEP]: the first token in [CLS]'s place


@pytest.fixture(scope="module")
def mlm64(tiny_mlm_dir):
    model = load_model(tiny_mlm_dir, device="cpu", head="masked-lm")
    model.model.double()
    return model


def one_batch(model, texts, seed=0, share=0.15):
    engine = Engine(model, batch_size=len(texts), progress=False)
    items = sorted(engine.encode(enumerate(Example(t, source=f"t:{k + 1}") for k, t in enumerate(texts)), RunStats()), key=len)
    return engine, items


def reference_gradients(folder, items, seed, share):
    """dL/da and a by transformers' own eager attention (``output_attentions`` with ``retain_grad``), one sequence at a time,
    the masked-LM loss the mean cross-entropy over the masked pieces."""
    model = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").double().eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = []
    for item in items:
        ids = torch.tensor([item.input_ids])
        original = ids[0].numpy().copy()  # the token sets are the input's, masked pieces included
        chosen = masked_positions(item, share, seed)
        labels = torch.full_like(ids, -100)
        labels[0, chosen] = ids[0, chosen]
        ids[0, chosen] = tokenizer.mask_token_id
        outputs = model(ids, output_attentions=True)
        for attention in outputs.attentions:
            attention.retain_grad()
        loss = torch.nn.functional.cross_entropy(outputs.logits[0], labels[0], ignore_index=-100)
        loss.backward()
        out.append((original, np.stack([a.detach()[0].numpy() for a in outputs.attentions]),
                    np.stack([a.grad[0].numpy() for a in outputs.attentions])))
    return out


def test_masking_is_fixed_by_the_sequence_and_seed_and_spares_special_tokens(mlm64):
    _, items = one_batch(mlm64, TEXTS)
    for item in items:
        chosen = masked_positions(item, 0.15, seed=1)
        assert len(chosen) == max(1, round(0.15 * (len(item) - 2)))
        assert 0 not in chosen and len(item) - 1 not in chosen
        assert (chosen == masked_positions(item, 0.15, seed=1)).all()
    assert any((masked_positions(i, 0.5, 1) != masked_positions(i, 0.5, 2)).any() for i in items)


def test_gradient_table_equals_numpy_from_transformers_eager_attention(mlm64, tiny_mlm_dir):
    engine, items = one_batch(mlm64, TEXTS)
    study = AttentionGradients(engine, mask_share=0.2, seed=4)
    study.update(items)
    assert tuple(study.result().target.unique()) == ENCODER_TARGETS
    table = study.result().set_index(["layer", "target"])
    sep, cls = mlm64.sep_token_id, mlm64.cls_token_id
    punct = mlm64.punct_by_id
    per_sequence = []
    for ids, maps, grads in reference_gradients(tiny_mlm_dir, items, 4, 0.2):
        sets = {"sep": ids == sep, "cls": ids == cls, "punct": punct[ids], "all": np.ones(len(ids), bool)}
        heads, n = maps.shape[1], len(ids)
        rows = []
        for layer in range(maps.shape[0]):
            rows.append([(maps[layer][:, :, sets[t]].sum() / (heads * n), np.abs(grads[layer][:, :, sets[t]]).sum() / (heads * n * sets[t].sum())
                          if sets[t].any() else np.nan) for t in ENCODER_TARGETS])
        per_sequence.append(rows)
    expected = np.array(per_sequence)  # [sequence, layer, target, (attention, gradient)]
    for layer in range(2):
        for k, target in enumerate(ENCODER_TARGETS):
            values = expected[:, layer, k]
            values = values[~np.isnan(values[:, 1])]
            row = table.loc[(layer, target)]
            assert row.attention == pytest.approx(values[:, 0].mean(), rel=1e-10)
            assert row.gradient == pytest.approx(values[:, 1].mean(), rel=1e-8)
            assert row.n == len(values)
    assert table.loc[(0, "all"), "attention"] == pytest.approx(1.0)


def test_the_gradient_is_the_finite_difference_of_the_loss(mlm64):
    """dL/da[l, h, i, j] by autograd through the pattern hook point, against (L(a + eps e_ij) - L(a - eps e_ij)) / 2 eps."""
    engine, items = one_batch(mlm64, ["the cat sat on the mat."])
    item = items[0]
    chosen = masked_positions(item, 0.3, 0)
    ids = torch.tensor([item.input_ids])
    labels = torch.full_like(ids, -100)
    labels[0, chosen] = ids[0, chosen]
    ids[0, chosen] = mlm64.tokenizer.mask_token_id

    def loss(nudge=None):
        hooks = Hooks()
        if nudge is not None:
            layer, head, i, j, eps = nudge

            def add(at, pattern):
                if at == layer:
                    pattern = pattern.clone()
                    pattern[0, head, i, j] += eps
                    return pattern
            hooks.add("pattern", add)
        with torch.no_grad(), hooks.attach(mlm64.model):
            logits = mlm64.model(ids).logits
        return torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100).item()

    captured = {}

    class Keep(AttentionGradients):
        def update(self, items):
            original = torch.autograd.grad

            def grad(loss, leaves):
                captured["grads"] = original(loss, leaves)
                return captured["grads"]
            torch.autograd.grad = grad
            try:
                super().update(items)
            finally:
                torch.autograd.grad = original

    Keep(engine, mask_share=0.3, seed=0).update(items)
    for layer, head, i, j in [(0, 1, 2, 0), (1, 3, 4, len(item) - 1), (1, 0, 1, 5)]:
        eps = 1e-6
        numeric = (loss((layer, head, i, j, eps)) - loss((layer, head, i, j, -eps))) / (2 * eps)
        assert captured["grads"][layer][0, head, i, j].item() == pytest.approx(numeric, rel=1e-5, abs=1e-9)


def test_a_model_without_a_masked_lm_head_is_refused_in_one_line(tiny_bert_dir):
    with pytest.raises(ModelError, match="the checkpoint has no masked-LM head"):
        attention_gradients(tiny_bert_dir, ["the cat sat."], progress=False)


def test_a_classifier_with_its_task_uses_the_task_loss(tiny_classifier_dir, cat_task):
    study = attention_gradients(tiny_classifier_dir, task=load_task(cat_task), progress=False, batch_size=5)
    table = study.gradients
    assert study.settings["loss"] == "sst2 cross-entropy"
    assert len(table) == 3 * len(ENCODER_TARGETS) and table.gradient.notna().all() and (table.gradient > 0).all()
    assert (table.n == 12).all()


def test_gradients_command_writes_table_figure_and_report(tiny_mlm_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "gradients", "-m", str(tiny_mlm_dir), "-c", str(corpus), "--out", str(out), "-q"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("layer 0: attention to [SEP]")
    table = pd.read_csv(out / "gradients.csv")
    assert set(table.target) == set(ENCODER_TARGETS) and len(table) == 2 * len(ENCODER_TARGETS)
    assert (out / "gradients_by_layer.png").exists() and "Attention to [SEP] and its gradient" in (out / "report.html").read_text()
    failed = subprocess.run([sys.executable, "-m", "bertology.cli", "gradients", "-c", str(corpus), "--out", str(tmp_path / "x"), "-q"],
                            capture_output=True, text=True)
    assert failed.returncode == 2 and "no masked-LM head" in failed.stderr and failed.stderr.count("\n") == 1


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def decoder64(request, tiny_decoder_dirs):
    """``(kind, folder, the decoder with its LM head in float64)``."""
    model = load_model(tiny_decoder_dirs[request.param], device="cpu", head="causal-lm")
    model.model.double()
    return request.param, tiny_decoder_dirs[request.param], model


def decoder_reference_gradients(folder, items):
    """dL/da and a by transformers' own eager attention (``output_attentions`` with ``retain_grad``), one sequence at a time,
    the loss the mean next-token cross-entropy of its logits (transformers' ``labels=`` loss, computed here in float64)."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").double().eval()
    out = []
    for item in items:
        ids = torch.tensor([item.input_ids])
        outputs = model(ids, output_attentions=True)
        for attention in outputs.attentions:
            attention.retain_grad()
        torch.nn.functional.cross_entropy(outputs.logits[0, :-1], ids[0, 1:]).backward()
        out.append((ids[0].numpy(), np.stack([a.detach()[0].numpy() for a in outputs.attentions]), np.stack([a.grad[0].numpy() for a in outputs.attentions])))
    return out


def test_decoder_gradient_table_equals_numpy_from_transformers_eager_attention(decoder64):
    kind, folder, model = decoder64
    engine, items = one_batch(model, TEXTS)  # one padded batch
    study = AttentionGradients(engine)
    study.update(items)
    result = study.result()
    assert tuple(result.target.unique()) == DECODER_TARGETS  # no [SEP]: left out, not zeros
    table = result.set_index(["layer", "target"])
    per_sequence = []
    for ids, maps, grads in decoder_reference_gradients(folder, items):
        heads, n = maps.shape[1], len(ids)
        visible = np.tril(np.ones((n, n), bool))  # query i sees the keys j <= i ...
        visible[0] = False  # ... and row 0, which sees only itself, is no query
        sets = {"first": np.arange(n) == 0, "punct": model.punct_by_id[ids], "all": np.ones(n, bool)}
        rows = []
        for layer in range(maps.shape[0]):
            row = []
            for target in DECODER_TARGETS:
                pairs = visible & sets[target][None, :]
                row.append((maps[layer][:, pairs].sum() / (heads * (n - 1)),
                            np.abs(grads[layer][:, pairs]).sum() / (heads * pairs.sum()) if pairs.any() else np.nan))
            rows.append(row)
        per_sequence.append(rows)
    expected = np.array(per_sequence)  # [sequence, layer, target, (attention, gradient)]
    close = 1e-10 if kind == "gpt2" else 1e-5  # Llama's eager attention takes the softmax in float32
    for layer in range(2):
        for k, target in enumerate(DECODER_TARGETS):
            values = expected[:, layer, k]
            values = values[~np.isnan(values[:, 1])]
            row = table.loc[(layer, target)]
            assert row.attention == pytest.approx(values[:, 0].mean(), rel=close)
            assert row.gradient == pytest.approx(values[:, 1].mean(), rel=close)
            assert row.n == len(values)
    assert table.loc[(1, "all"), "attention"] == pytest.approx(1.0)


def test_gradients_command_on_a_decoder_uses_the_causal_lm_loss_and_the_first_token(tiny_gpt2_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "bertology.cli", "gradients", "-m", str(tiny_gpt2_dir), "-c", str(corpus), "--out", str(out), "-q",
                           "--device", "cpu"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("layer 0: attention to the first token ")
    table = pd.read_csv(out / "gradients.csv")
    assert set(table.target) == set(DECODER_TARGETS) and (table.n == len(TEXTS)).all()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["loss"] == NEXT_TOKEN_LOSS and manifest["settings"]["mask_share"] is None
    report = (out / "report.html").read_text()
    assert "Attention to the first token and its gradient" in report and NEXT_TOKEN_LOSS in report


def test_mask_share_on_a_decoder_says_in_one_line_that_it_has_no_masked_lm_loss(tiny_gpt2_dir):
    with pytest.raises(BertologyError, match="is a decoder, which has none \\(its loss is the next-token cross-entropy\\)") as refused:
        attention_gradients(str(tiny_gpt2_dir), TEXTS, mask_share=0.2, device="cpu", progress=False)
    assert "\n" not in str(refused.value)


def test_one_piece_lines_are_skipped_and_counted_or_refused_in_one_line_and_zero_gradients_need_no_log_scale(tiny_gpt2_dir, tmp_path):
    # issue 37, cases 7 and 8: "cat" and "the" are one piece each for the tiny GPT-2; "the cat" and "the dog" two, whose one
    # next-token loss (piece 1 from piece 0) reads only row 0, which no mean counts: every |dL/da| measured is 0.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    assert [len(tokenizer(line)["input_ids"]) for line in ("cat", "the", "the cat", "the dog")] == [1, 1, 2, 2]

    def gradients(name, lines):
        (tmp_path / name).write_text("\n".join(lines) + "\n")
        return subprocess.run([sys.executable, "-m", "bertology.cli", "gradients", "-m", str(tiny_gpt2_dir), "-c", str(tmp_path / name), "--out",
                               str(tmp_path / f"{name}.run"), "-q", "--device", "cpu"], capture_output=True, text=True)

    refused = gradients("ones.txt", ["cat", "the"])
    assert refused.returncode == 2 and not (tmp_path / "ones.txt.run").exists()
    assert refused.stderr == "error: no sequence to analyse: every one was skipped, 2 of fewer than 2 pieces (the first: ones.txt:1)\n"
    done = gradients("twos.txt", ["the cat", "cat", "the dog"])
    assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr
    assert "2 sequences (0 truncated, 1 of fewer than 2 pieces skipped)" in done.stdout
    table = pd.read_csv(tmp_path / "twos.txt.run" / "gradients.csv")
    measured, punctuation = table[table.target != "punct"], table[table.target == "punct"]  # no line has punctuation
    assert (measured.gradient == 0).all() and (measured.n == 2).all() and punctuation.gradient.isna().all()
    manifest = json.loads((tmp_path / "twos.txt.run" / "manifest.json").read_text())
    assert (manifest["stats"]["sequences"], manifest["stats"]["degenerate"]) == (2, 1)
