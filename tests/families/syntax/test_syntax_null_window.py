"""Syntactic heads on a sliding-window null (issue 49): a Mistral whose queries are zeroed attends uniformly over the keys its
window lets each query see, so every head is the uniform head and no relation may be called significant, though some beat
their offset baselines (the uniform head does too); a relation that no offset reaches gets p = 1; a head planted to point at
the gold head in the same model is significant. Through the command line, on real EWT trees where the data is there."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import byte_level_bpe
from test_cli import bertology
from test_no_claim_under_the_null import ewt_trees

from bertology.core.model.models import load_model
from bertology.core.text.corpora import Corpus
from bertology.families.syntax.analyzer import OFFSETS, RelationHeads
from families.syntax.test_syntax import batch_with


def zero_query_mistral(folder, window: int):
    """A random 2-layer, 4-head Mistral (2 key-value heads) with ``sliding_window=window`` pieces and every query projection 0:
    each head spreads each row evenly over the keys its window shows it, the uniform head (docs/methods.md#the-null-model)."""
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe("<s>"), bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64,
                           max_position_embeddings=4096, sliding_window=window, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = MistralForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def windowed_null(tmp_path_factory):
    return zero_query_mistral(tmp_path_factory.mktemp("mistral-window-4"), window=4)


def syntax_best(model, corpus, out, *options) -> pd.DataFrame:
    done = bertology("syntax", "--model", model, "--corpus", corpus, "--no-probe", "--out", out, "--device", "cpu", "--quiet", *options)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "claims: 0" in done.stdout, done.stdout[-2000:]
    return pd.read_csv(out / "syntax_best.csv")


def test_a_sliding_window_null_beats_offsets_but_not_the_uniform_head(windowed_null, shared_data, tmp_path):
    """The issue's case: ``obj`` dep->head of the null beat its offset baseline and was called significant though the uniform
    head scored the same (a float32 head's 1/3 rounded above the uniform head's float64 1/3). Every head is the uniform head:
    its accuracy is the uniform column's exactly, in every bootstrap replicate, so p = 1 for every tested relation."""
    corpus = ewt_trees(shared_data, tmp_path, count=120)
    best = syntax_best(windowed_null, corpus, tmp_path / "run")
    tested = best[~best.few.astype(bool)]
    assert len(tested) >= 10 and not best.significant.astype(bool).any()
    assert (tested.accuracy == tested.uniform).all(), tested
    assert (tested.n_ties == 2 * 4).all()  # every head of the direction ties: they are all the uniform head
    beats_offsets = tested[tested.accuracy > tested.baseline_accuracy]
    assert len(beats_offsets) >= 2, tested  # obj and flat on these trees: the offsets alone would have called them
    assert (tested.p_value == 1.0).all(), tested[["relation", "accuracy", "uniform", "p_value"]]


def far_trees(path, count: int = 40):
    """``count`` eight-word sentences whose words 5-8 depend on word 1 (``far``: 4 to 7 words away, beyond every offset
    of -3..+3) and words 2-4 on word 1 too (``near``), as a CoNLL-U file."""
    words = "the cat sat on the mat and dog ran fast big small red house tree we saw it".split()
    rng = np.random.default_rng(0)
    blocks = []
    for number in range(count):
        sentence = rng.choice(words, size=8)
        lines = [f"# sent_id = far-{number}", f"# text = {' '.join(sentence)}"]
        for i, word in enumerate(sentence, start=1):
            head, relation = (0, "root") if i == 1 else (1, "near" if i <= 4 else "far")
            lines.append(f"{i}\t{word}\t_\t_\t_\t_\t{head}\t{relation}\t_\t_")
        blocks.append("\n".join(lines))
    path.write_text("\n\n".join(blocks) + "\n\n", encoding="utf-8")
    return path


def test_a_relation_no_offset_reaches_gets_p_1_on_the_null(tmp_path):
    """``far``: every offset baseline scores 0 and the null's heads score the uniform head's chance, ``1/t`` of t tied
    single-piece words (1/6, 1/7 round up in float32): p = 1, never NaN nor small (while a float32 head's hits were
    its own 1/t, far, near and all were each called significant here)."""
    model = zero_query_mistral(tmp_path / "mistral-window-32", window=32)
    best = syntax_best(model, far_trees(tmp_path / "far.conllu"), tmp_path / "run", "--min-dependents", "20").set_index("relation")
    far = best.loc["far"]
    assert far.n == 4 * 40 and far.direction == "dep->head" and not far.few  # a causal row sees its earlier head
    assert far.baseline_accuracy == 0.0 and 0 < far.accuracy == far.uniform < 1
    assert far.p_value == 1.0 and far.p_adj == 1.0 and not far.significant
    baselines = pd.read_csv(tmp_path / "run" / "syntax_baselines.csv")
    assert (baselines[baselines.relation == "far"].accuracy.fillna(0) == 0).all() and set(baselines.offset) == set(OFFSETS)


def test_a_head_planted_on_the_gold_head_is_significant_on_the_windowed_model(windowed_null, shared_data, tmp_path):
    """The positive control on the same model and trees: layer 0's head 2 points every piece of a dependent at the last piece
    of its gold head where the window shows it one (other rows: the null's own uniform rows), a test that can reject."""
    loaded = load_model(windowed_null, device="cpu")
    examples = list(Corpus(ewt_trees(shared_data, tmp_path, count=60)))

    def gold_where_seen(batch, b):
        null = batch.attentions[:, b].clone()  # [layer, head, n, n]: the model's own uniform rows over its window
        alignment = batch.alignments[b]
        for word, head in enumerate(batch.examples[b].heads):
            if head == 0 or alignment.word_unit[word] < 0 or alignment.word_unit[head - 1] < 0:
                continue
            target = int(np.flatnonzero(alignment.unit_of_piece == alignment.word_unit[head - 1])[-1])
            for piece in np.flatnonzero(alignment.unit_of_piece == alignment.word_unit[word]):
                if null[0, 2, piece, target] > 0:
                    null[0, 2, piece] = 0
                    null[0, 2, piece, target] = 1.0
        return null[..., : int(batch.lengths[b]), : int(batch.lengths[b])]

    analyzer = RelationHeads(loaded.kind, bootstrap=200, seed=0)
    for start in range(0, len(examples), 20):
        analyzer.update(batch_with(loaded, examples[start : start + 20], gold_where_seen))
    best = analyzer.best(min_dependents=25).set_index("relation")
    planted = best.loc["all"]
    assert (planted.layer, planted["head"], planted.direction, planted.n_ties) == (0, 2, "dep->head", 1)
    assert planted.accuracy > max(planted.uniform, planted.baseline_accuracy) + 0.05 and planted.significant
