"""The copying score (Elhage et al. 2021) against numpy's eigenvalues of the full [vocab, vocab] OV circuit, built here from
the weights indexed by hand (not through copying.py's helpers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaModel

from bertology.core.model.models import load_model
from bertology.families.headtypes.copying import copying_scores, ov_eigenvalues


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
    loaded = type("Loaded", (), {"model": bert, "num_heads": 2})()
    table, reason = copying_scores(loaded)
    assert reason is None
    # head h's circuit W_O^h W_U W_E W_V^h = (±gram^-1)[h rows] gram [:, h cols] = ±I
    assert table.copying_score.tolist() == pytest.approx([1.0, -1.0])
    assert table.positive_eigenvalue_share.tolist() == [1.0, 0.0]


def test_no_unembedding_or_unknown_architecture_gives_a_reason():
    llama = LlamaModel(LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                   tie_word_embeddings=False))
    table, reason = copying_scores(type("Loaded", (), {"model": llama, "num_heads": 2})())
    assert table is None and "no unembedding" in reason
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    table, reason = copying_scores(type("Loaded", (), {"model": neox, "num_heads": 2})())
    assert table is None and "gpt_neox" in reason
