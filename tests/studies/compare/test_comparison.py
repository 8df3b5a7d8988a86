import re

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import tiny_examples
from transformers import AutoTokenizer, BertConfig, BertModel

from bertology.core.errors import BertologyError
from bertology.core.model.models import load_model
from bertology.studies.compare.comparison import HeadSimilarity, compare, map_cosine
from bertology.testing.analyzers import check_analyzer


@pytest.fixture(scope="module")
def deep_bert_dirs(tmp_path_factory, tiny_bert_dir):
    """A 4-layer tiny BERT, and a copy whose layer 2 was re-initialised."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    torch.manual_seed(1)
    # a larger init than BERT's 0.02 makes every layer's attention depend on its input
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64, initializer_range=0.3)
    original, changed = tmp_path_factory.mktemp("deep"), tmp_path_factory.mktemp("deep-reinit")
    model = BertModel(config)
    model.save_pretrained(original)
    torch.manual_seed(2)
    for parameter in model.encoder.layer[2].parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    model.save_pretrained(changed)
    for folder in (original, changed):
        tokenizer.save_pretrained(folder)
    return original, changed


def test_map_cosine_by_hand():
    a = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    b = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert map_cosine(a, b).item() == pytest.approx(1.5 / (np.sqrt(1.5) * np.sqrt(2.0)))
    assert map_cosine(a, a).item() == pytest.approx(1.0)


def test_a_model_compared_with_itself_is_identical_everywhere(tiny_bert):
    result = compare(tiny_bert, tiny_bert, [e for e in tiny_examples()], progress=False)
    np.testing.assert_allclose(result.similarity.cosine, 1.0, atol=1e-6)
    assert (result.similarity.n == len(tiny_examples())).all()
    np.testing.assert_allclose(result.profile_delta.delta, 0.0, atol=1e-6)
    assert result.roles_delta.empty


def test_reinitialising_layer_k_changes_layer_k_and_above_only(deep_bert_dirs, tmp_path):
    original, changed = (load_model(path, device="cpu") for path in deep_bert_dirs)
    result = compare(original, changed, tiny_examples(), progress=False, out=tmp_path / "run")
    by_layer = result.similarity_layers.set_index("layer").cosine
    assert by_layer[0] == pytest.approx(1.0, abs=1e-6) and by_layer[1] == pytest.approx(1.0, abs=1e-6)
    assert by_layer[2] < 0.99 and by_layer[3] < 1 - 1e-4  # well below the 1e-6 of identical layers
    below = result.similarity[result.similarity.layer < 2]
    assert (below.cosine > 1 - 1e-6).all()
    for name in ("similarity.csv", "similarity.parquet", "profile_delta.csv", "roles_delta.csv", "similarity_heatmap.png", "report.html"):
        assert (tmp_path / "run" / name).is_file(), name
    delta = result.profile_delta
    assert list(delta.columns) == ["layer", "head", "metric", "value_a", "value_b", "delta"]
    assert (delta[delta.layer < 2].delta.abs() < 1e-6).all() and (delta[delta.layer >= 2].delta.abs() > 1e-6).any()


def test_similarity_contract(tiny_bert_dir, deep_bert_dirs):
    a, b = (load_model(path, device="cpu") for path in deep_bert_dirs)
    for model in (a, b):
        model.model.double()
    check_analyzer(HeadSimilarity, a, tiny_examples(), compare_with=b, rtol=1e-9, atol=1e-12)


def test_models_with_different_vocabularies_are_refused(tiny_bert, tiny_roberta):
    with pytest.raises(BertologyError, match="different vocabularies"):
        compare(tiny_bert, tiny_roberta, tiny_examples(), progress=False)


def test_models_of_two_kinds_are_refused(tiny_bert):
    """One vocabulary and one shape, but an encoder's maps and a decoder's are not measured alike."""
    import dataclasses
    from types import SimpleNamespace

    from bertology.core.model.kinds import DECODER
    from bertology.core.paired import CompareEngine

    as_decoder = dataclasses.replace(tiny_bert, kind=DECODER)
    with pytest.raises(BertologyError, match="of kind encoder and .* of kind decoder: compare models of one kind"):
        CompareEngine(SimpleNamespace(model=tiny_bert), SimpleNamespace(model=as_decoder))


def test_the_layer_view_sets_both_models_probes_side_by_side(tiny_bert_dir, shared_data, tmp_path):
    """A model compared with itself on real trees: the same probe accuracy on both sides, no change, attention identical;
    each side's probes equal the layers family's own run of that model."""
    import bertology
    from bertology.studies.compare.comparison import compare

    corpus = shared_data / "ud_english_ewt" / "en_ewt-ud-test.conllu"
    result = compare(tiny_bert_dir, tiny_bert_dir, corpus, limit=60, progress=False, out=tmp_path / "cmp", probe_sentences=60)
    layers = result.layer_comparison
    assert list(layers.columns) == ["layer", "task", "accuracy_a", "accuracy_b", "change", "selectivity_a", "selectivity_b", "cosine"]
    assert (layers.change == 0).all() and (layers.accuracy_a == layers.accuracy_b).all()
    assert layers.cosine[layers.layer == 0].isna().all() and np.allclose(layers.cosine[layers.layer > 0], 1.0)
    alone = bertology.analyze(tiny_bert_dir, corpus, limit=60, analyses=["layers"], progress=False, view=False, probe_bootstrap=1000).table("layer_probes")
    side = result.layer_probes[result.layer_probes.model == "A"].drop(columns="model").reset_index(drop=True)
    pd.testing.assert_frame_equal(side, alone)
    assert (tmp_path / "cmp" / "layer_comparison.csv").exists() and "What changed, layer by layer" in (tmp_path / "cmp" / "report.html").read_text()


def test_the_layer_view_on_too_few_sentences_is_a_one_line_error(tiny_bert_dir, shared_data, tmp_path):
    from bertology.studies.compare.comparison import compare

    corpus = shared_data / "ud_english_ewt" / "en_ewt-ud-test.conllu"
    with pytest.raises(BertologyError, match="layer probes need at least 10 sentences"):
        compare(tiny_bert_dir, tiny_bert_dir, corpus, limit=5, progress=False)
    with pytest.raises(BertologyError, match="layer probes need dependency trees"):
        compare(tiny_bert_dir, tiny_bert_dir, ["the cat sat."], layer_probes=True, progress=False)
    capped = compare(tiny_bert_dir, tiny_bert_dir, corpus, limit=30, probe_sentences=12, progress=False)
    assert len(capped.warnings) == 2 and all(re.fullmatch(r"layer probes: kept the first 12 of (29|30) sentences \(--probe-sentences\)", w)
                                             for w in capped.warnings)  # of those whose words all kept their pieces


def test_models_whose_tokenizers_cut_the_corpus_otherwise_are_refused_before_the_pass(tiny_gpt2_dir, tiny_llama_dir, tmp_path, monkeypatch):
    """GPT-2's tokenizer and the tiny Llama's share one vocabulary, but Llama's puts BOS first; a copy of GPT-2 whose tokenizer
    lowercases agrees on lowercase lines only. Either pair would run model B on model A's pieces: refused in one line that
    names both models and the first piece that differs, as transformers' own tokenizers give it, before anything runs."""
    import json
    import shutil

    from bertology.core.paired import CompareEngine

    monkeypatch.setattr(CompareEngine, "run", lambda *args, **kwargs: pytest.fail("the pass ran"))
    gpt2, llama = AutoTokenizer.from_pretrained(tiny_gpt2_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert gpt2.get_vocab() == llama.get_vocab()
    texts = ["the cat sat.", "The dog ran."]
    first = gpt2.convert_ids_to_tokens(gpt2(texts[0])["input_ids"])[0]
    with pytest.raises(BertologyError) as error:
        compare(str(tiny_gpt2_dir), str(tiny_llama_dir), texts, out=tmp_path / "run", device="cpu", progress=False)
    assert str(error.value) == (f"{tiny_gpt2_dir} and {tiny_llama_dir} cut the corpus into different pieces (example 1: piece 0 is {first!r} for "
                                f"{tiny_gpt2_dir} and '<s>' for {tiny_llama_dir}): the comparison runs both on model A's pieces, so compare "
                                "models whose tokenizers agree")
    lower = tmp_path / "gpt2-lowercase"
    shutil.copytree(tiny_gpt2_dir, lower)
    document = json.loads((lower / "tokenizer.json").read_text())
    document["normalizer"] = {"type": "Lowercase"}
    (lower / "tokenizer.json").write_text(json.dumps(document))
    pieces = [tokenizer.convert_ids_to_tokens(tokenizer(texts[1])["input_ids"]) for tokenizer in (gpt2, AutoTokenizer.from_pretrained(lower))]
    k = next(k for k, (a, b) in enumerate(zip(*pieces)) if a != b)
    with pytest.raises(BertologyError, match=re.escape(f"(example 2: piece {k} is {pieces[0][k]!r} for {tiny_gpt2_dir} and {pieces[1][k]!r} for {lower})")):
        compare(str(tiny_gpt2_dir), str(lower), texts, out=tmp_path / "run", device="cpu", progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("seed", [2**70, 2**32, -1])
def test_a_seed_numpy_cannot_take_is_refused_before_a_model_loads(seed, tmp_path):
    with pytest.raises(ValueError):
        np.random.RandomState(seed)  # the head map's scikit-learn random state is one of numpy's
    with pytest.raises(BertologyError, match=f"^seed must be a whole number from 0 to 4294967295, not {seed}$"):
        compare("nobody/a", "nobody/b", tmp_path / "no-such-corpus.txt", seed=seed, out=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_the_layer_view_figure_marks_the_embeddings_and_numbers_the_blocks_as_every_figure(tmp_path):
    """Issue 39: layer_probes.csv and layer_comparison.csv count the embeddings as layer 0; the compared probes' figure
    marks them emb. and numbers the blocks from 0, and the section says how the tables count."""
    from families.layers.test_layers import probe_table

    from bertology.core.storage.runfolder import RunFolder
    from bertology.families.layers.report import HIDDEN_STATES_NUMBERED, probes_by_layer
    from bertology.studies.compare.report import layer_view_section

    probes = pd.concat([probe_table().assign(model=side) for side in "AB"], ignore_index=True)
    for axis in probes_by_layer(probes, by="model").axes:
        assert [tick.get_text() for tick in axis.get_xticklabels()] == ["emb.", "0", "1"]
    comparison = pd.DataFrame({"layer": [0, 1, 2], "task": "upos", "cosine": [np.nan, 1.0, 1.0]})
    with RunFolder(tmp_path / "cmp") as folder:
        section = layer_view_section(folder, probes, comparison, "a", "b")
    assert section.intro.endswith(HIDDEN_STATES_NUMBERED)
    assert "(0 = embeddings)" not in section.figures[0].caption and "after the embeddings (emb.) and after each block" in section.figures[0].caption
