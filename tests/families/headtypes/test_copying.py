"""The copying score (Elhage et al. 2021) against numpy's eigenvalues of the full [vocab, vocab] OV circuit, built here from
the weights indexed by hand (not through copying.py's helpers or the layouts), in memory and from the checkpoint's files through
the command line: a tied GPT-2, and a Llama whose lm_head is its own (not loaded by a bare AutoModel, read from its checkpoint)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import tiny_decoder_configs, tiny_encoder_configs
from transformers import BertConfig, BertModel, GPTNeoConfig, GPTNeoModel, LlamaConfig, LlamaModel

from bertology.core.model.kinds import kind_of
from bertology.core.model.layouts import layout_of
from bertology.core.model.models import load_model
from bertology.families.headtypes.copying import copying_scores, ov_eigenvalues

TINY_NAMES = [*tiny_encoder_configs(), *tiny_decoder_configs()]


def in_memory(model: torch.nn.Module, heads: int) -> SimpleNamespace:
    """What copying_scores reads of a LoadedModel, for a model built here (no folder, no hub name)."""
    return SimpleNamespace(model=model, num_heads=heads, layout=layout_of(model.config), kind=kind_of(model.config), source=None,
                           name="built-in-memory")


def numpy_of(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().double().numpy()


def perturb_norm_gains(model: torch.nn.Module) -> None:
    """Random norm gains (they start at 1), so that folding them in is tested."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ("ln_" in name or "norm" in name) and name.endswith("weight"):
                parameter.copy_(0.5 + torch.rand(parameter.shape, generator=generator))


def full_circuit_summary(w_e: np.ndarray, w_v: np.ndarray, w_o: np.ndarray, w_u: np.ndarray) -> tuple[float, float]:
    """The copying score sum Re(lambda) / sum |lambda| over all eigenvalues of W_E W_V W_O W_U ([vocab, vocab]), and the
    share of positive real parts among its d_head largest eigenvalues."""
    eigenvalues = np.linalg.eigvals(w_e @ w_v @ w_o @ w_u)
    top = eigenvalues[np.argsort(-np.abs(eigenvalues))[: w_v.shape[1]]]
    return float(eigenvalues.real.sum() / np.abs(eigenvalues).sum()), float((top.real > 0).mean())


def test_small_matrix_has_the_nonzero_eigenvalues_of_the_full_circuit():
    rng = np.random.default_rng(0)
    w_e, w_v, w_o, w_u = rng.normal(size=(50, 16)), rng.normal(size=(16, 4)), rng.normal(size=(4, 16)), rng.normal(size=(16, 50))
    full = np.linalg.eigvals(w_e @ w_v @ w_o @ w_u)
    nonzero = full[np.argsort(-np.abs(full))[:4]]
    assert np.abs(full[np.argsort(-np.abs(full))[4:]]).max() < 1e-8 * np.abs(nonzero).max()
    small = ov_eigenvalues(w_e, w_v, w_o, w_u)
    assert np.allclose(np.sort_complex(small), np.sort_complex(nonzero), rtol=1e-8, atol=1e-8)


def test_gpt2_copying_scores_match_the_full_circuit(tiny_gpt2_dir):
    loaded = load_model(tiny_gpt2_dir, head="causal-lm", device="cpu")
    perturb_norm_gains(loaded.model)
    table, reason = copying_scores(loaded)
    assert reason is None and len(table) == 2 * 4
    gpt2 = loaded.model.transformer
    hidden, heads = gpt2.config.n_embd, gpt2.config.n_head
    d = hidden // heads
    w_e = numpy_of(gpt2.wte.weight)
    w_u = numpy_of(gpt2.ln_f.weight)[:, None] * numpy_of(loaded.model.lm_head.weight).T
    for row in table.itertuples():
        block = gpt2.h[row.layer]
        w_v = numpy_of(block.ln_1.weight)[:, None] * numpy_of(block.attn.c_attn.weight)[:, 2 * hidden + row.head * d : 2 * hidden + (row.head + 1) * d]
        w_o = numpy_of(block.attn.c_proj.weight)[row.head * d : (row.head + 1) * d]
        score, share = full_circuit_summary(w_e, w_v, w_o, w_u)
        assert row.copying_score == pytest.approx(score, abs=1e-9)
        assert row.positive_eigenvalue_share == pytest.approx(share)
    assert table.copying_score.between(-1, 1).all() and table.positive_eigenvalue_share.between(0, 1).all()


def test_llama_query_heads_read_their_groups_value_head(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir, head="causal-lm", device="cpu")
    perturb_norm_gains(loaded.model)
    table, reason = copying_scores(loaded)
    assert reason is None
    llama = loaded.model.model
    config = llama.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = config.hidden_size // heads
    w_e = numpy_of(llama.embed_tokens.weight)
    w_u = numpy_of(llama.norm.weight)[:, None] * numpy_of(loaded.model.lm_head.weight).T  # untied: its own lm_head
    assert not np.allclose(w_u, w_e.T)
    for row in table.itertuples():
        layer = llama.layers[row.layer]
        group = row.head // (heads // kv_heads)
        w_v = numpy_of(layer.input_layernorm.weight)[:, None] * numpy_of(layer.self_attn.v_proj.weight)[group * d : (group + 1) * d].T
        w_o = numpy_of(layer.self_attn.o_proj.weight)[:, row.head * d : (row.head + 1) * d].T
        score, share = full_circuit_summary(w_e, w_v, w_o, w_u)
        assert row.copying_score == pytest.approx(score, abs=1e-9)
        assert row.positive_eigenvalue_share == pytest.approx(share)


def test_a_head_whose_ov_circuit_is_the_identity_copies():
    """W_O W_U W_E W_V = c * I (positive c): every eigenvalue is c, both scores are 1; with -c, copying_score -1 and
    positive_eigenvalue_share 0."""
    config = BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, max_position_embeddings=16)
    torch.manual_seed(0)
    bert = BertModel(config, add_pooling_layer=False)
    with torch.no_grad():
        embeddings = torch.randn(40, 8)
        bert.embeddings.word_embeddings.weight.copy_(embeddings)
        gram = embeddings.T @ embeddings  # W_U W_E with tied embeddings: W_U = W_E^T, so W_E^T W_E
        value = bert.encoder.layer[0].attention.self.value
        output = bert.encoder.layer[0].attention.output.dense
        value.weight.copy_(torch.eye(8))  # x W_V = x
        output.weight.copy_(torch.linalg.inv(gram).T * torch.tensor([1.0] * 4 + [-1.0] * 4))  # head 0: +gram^-1, head 1: -gram^-1 rows
    table, reason = copying_scores(in_memory(bert, heads=2))
    assert reason is None
    # head h's circuit W_O^h W_U W_E W_V^h = (±gram^-1)[h rows] gram [:, h cols] = ±I
    assert table.copying_score.tolist() == pytest.approx([1.0, -1.0])
    assert table.positive_eigenvalue_share.tolist() == [1.0, 0.0]


def test_no_unembedding_or_unknown_architecture_gives_a_reason(tmp_path):
    llama = LlamaModel(LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                   tie_word_embeddings=False))
    table, reason = copying_scores(in_memory(llama, heads=2))  # untied, no head, no checkpoint
    assert table is None and reason.startswith("no copying score: the model has no unembedding")
    llama.save_pretrained(tmp_path)  # a bare model's checkpoint: no lm_head in it either
    table, reason = copying_scores(SimpleNamespace(**{**vars(in_memory(llama, heads=2)), "source": tmp_path}))
    assert table is None and "no unembedding" in reason
    neo = GPTNeoModel(GPTNeoConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, attention_types=[[["global"], 1]]))
    table, reason = copying_scores(in_memory(neo, heads=2))
    assert table is None and reason == "no copying score for 'gpt_neo' models: bertology does not know where they keep their layers"


def copying_by_hand(folder, model: str, layers: int, heads: int, kv_heads: int) -> pd.DataFrame:
    """docs/methods.md's definition from the checkpoint's own tensors (safetensors, by key): each head's full circuit
    ``W_E W_V^h W_O^h W_U`` with the input norm's gain folded into ``W_V`` and the final norm's into ``W_U``, ``W_U`` the
    checkpoint's lm_head, or ``W_E^T`` where it has none (tied)."""
    from safetensors.numpy import load_file

    weights = {key: value.astype(np.float64) for key, value in load_file(folder / "model.safetensors").items()}
    if model == "gpt2":  # Conv1D weights [in, out]; c_attn's values are its last third
        w_e, final = weights["transformer.wte.weight"], weights["transformer.ln_f.weight"]
        parts = [(weights[f"transformer.h.{layer}.ln_1.weight"], weights[f"transformer.h.{layer}.attn.c_attn.weight"][:, 2 * w_e.shape[1] :],
                  weights[f"transformer.h.{layer}.attn.c_proj.weight"]) for layer in range(layers)]
    else:  # Llama: nn.Linear weights [out, in]
        w_e, final = weights["model.embed_tokens.weight"], weights["model.norm.weight"]
        parts = [(weights[f"model.layers.{layer}.input_layernorm.weight"], weights[f"model.layers.{layer}.self_attn.v_proj.weight"].T,
                  weights[f"model.layers.{layer}.self_attn.o_proj.weight"].T) for layer in range(layers)]
    w_u = final[:, None] * weights.get("lm_head.weight", w_e).T
    d = w_e.shape[1] // heads
    rows = []
    for layer, (gain, values, outputs) in enumerate(parts):
        for head in range(heads):
            group = head // (heads // kv_heads)
            w_v = gain[:, None] * values[:, group * d : (group + 1) * d]
            rows.append((layer, head, *full_circuit_summary(w_e, w_v, outputs[head * d : (head + 1) * d], w_u)))
    return pd.DataFrame(rows, columns=["layer", "head", "copying_score", "positive_eigenvalue_share"])


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_the_command_line_writes_the_definitions_copying_scores(model, tiny_decoder_dirs, tmp_path):
    """``bertology headtypes`` loads the bare model (no language-model head): a tied GPT-2 reads ``W_E^T``, and an untied Llama
    (``tie_word_embeddings=False``) its own lm_head from the checkpoint, where it used to get no table. Norm gains random."""
    from conftest import TEXTS
    from test_cli import bertology

    loaded = load_model(tiny_decoder_dirs[model], head="causal-lm", device="cpu")
    perturb_norm_gains(loaded.model)
    folder, corpus = tmp_path / "model", tmp_path / "lines.txt"
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    corpus.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    config = loaded.model.config
    assert config.tie_word_embeddings == (model == "gpt2")
    done = bertology("headtypes", "--model", folder, "--corpus", corpus, "--out", tmp_path / "run", "--device", "cpu", "--quiet")
    assert done.returncode == 0 and "no copying score" not in done.stdout + done.stderr, done.stdout + done.stderr[-2000:]
    table = pd.read_csv(tmp_path / "run" / "copying_scores.csv")
    kv_heads = getattr(config, "num_key_value_heads", None) or loaded.num_heads
    expected = copying_by_hand(folder, model, loaded.num_layers, loaded.num_heads, kv_heads)
    pd.testing.assert_frame_equal(table, expected, check_exact=False, rtol=0, atol=1e-9)
    # the weights as the engine holds them: the bare model, whose head is read from the checkpoint or tied
    bare, _ = copying_scores(load_model(folder, device="cpu"))
    pd.testing.assert_frame_equal(bare, table, check_exact=False, rtol=0, atol=1e-12)


def test_a_hub_models_unembedding_is_read_from_its_snapshot_in_the_cache(tiny_llama_dir, monkeypatch):
    """Loaded by hub name (no folder of its own), the bare model's lm_head comes from its snapshot in the local cache."""
    import huggingface_hub

    loaded = load_model(tiny_llama_dir, device="cpu")
    from_folder, _ = copying_scores(loaded)
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda name, **options: asked.append((name, options)) or str(tiny_llama_dir))
    from_hub, reason = copying_scores(SimpleNamespace(**{**vars(in_memory(loaded.model, loaded.num_heads)), "name": "someone/tiny-llama"}))
    assert reason is None and asked == [("someone/tiny-llama", {"local_files_only": True, "allow_patterns": ["*.safetensors"]})]
    pd.testing.assert_frame_equal(from_hub, from_folder)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_every_layout_gets_copying_scores_unless_its_embeddings_are_not_its_layers_width(name):
    """No architecture is named in copying.py: every layout's tiny model (tests/core/model/test_layouts.py, a decoder with its
    language-model head, an encoder tied) gets a score per head, but ALBERT's and ELECTRA's, whose 16-wide embeddings a
    projection widens to the layers' 32, get a reason."""
    from core.model.test_layouts import tiny_model

    model = tiny_model(name)
    table, reason = copying_scores(in_memory(model, heads=4))
    if name in ("albert", "electra"):
        assert table is None and reason == ("no copying score: its embeddings are 16 wide, its unembedding reads 16 and its layers write 32: "
                                            "the OV circuit would pass a projection between them that it does not read")
        return
    assert reason is None and len(table) == model.config.num_hidden_layers * 4
    assert table.copying_score.between(-1, 1).all() and table.positive_eigenvalue_share.between(0, 1).all()
