"""The copying score of each head, from its weights alone (no corpus): how far its OV circuit copies a token to the output
(Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits", section "Copying / Primitive In-Context Learning").

A head's full OV circuit maps a source token to the logits it adds: ``M = W_E W_V^h W_O^h W_U`` (rows: the vocabulary),
``[vocab, vocab]``, in the row-vector convention of transformers' weights (Elhage et al. write its transpose
``W_U W_O W_V W_E``: the same eigenvalues). A head that copies raises the logit of the token it attends to: ``M`` has
mostly positive eigenvalues. Two summaries of its eigenvalues ``lambda``:

- ``copying_score``: ``sum Re(lambda) / sum |lambda|``, in [-1, 1], the copying score of Elhage et al. 2021 (the summary
  they plot, and the project's definition, METHODS.md section 13): positive means the head raises the logits of the tokens
  it attends to; TransformerLens computes the same (``(W_E @ model.OV @ W_U).eigenvalues``, then
  ``eigenvalues.sum(-1).real / eigenvalues.abs().sum(-1)``);
- ``positive_eigenvalue_share``: the share of the eigenvalues whose real part is positive, in [0, 1] (a coarser count of
  Elhage et al.'s "positive eigenvalues", which ignores their sizes).

``M`` has rank at most ``d_head``, so both run over its ``d_head`` (generically nonzero) eigenvalues, which are those of
the small ``[d_head, d_head]`` matrix ``W_O^h W_U W_E W_V^h`` (the nonzero eigenvalues of ``AB`` and ``BA`` coincide, with
``A = W_E W_V^h``, ``B = W_O^h W_U``): no vocabulary-sized eigenproblem. Computed in float64.

Where the parts live: ``W_E`` the input embeddings, ``W_U`` the output embeddings (the language-model head), or ``W_E^T``
where the model has no head loaded and ties its embeddings (BERT's, GPT-2's); ``W_V^h`` the head's slice of the value
projection (GPT-2's ``c_attn`` Conv1D, its third third; Llama's, Mistral's and Qwen's ``v_proj``, where a query head reads its
group's value head; BERT's ``value``); ``W_O^h`` its rows of the output projection. As TransformerLens's ``fold_ln`` does, a
pre-norm model's norm gains are folded in: the layer's input norm's ``gamma`` into ``W_V`` (``diag(gamma) W_V``) and the
final norm's into ``W_U``; the norms' centring and scaling by the token's own size, and every bias, are left out, as in
Elhage et al.'s analysis. A model with no unembedding (none loaded and embeddings untied), or of an architecture listed in
no :data:`SUPPORTED` family, gets no table and a reason (:func:`copying_scores`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.model.layouts import layout_of

#: The ``config.model_type`` values whose value projection, norms and embeddings :func:`copying_scores` knows.
GPT2_TYPES = frozenset({"gpt2"})
LLAMA_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
BERT_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert"})
SUPPORTED = GPT2_TYPES | LLAMA_TYPES | BERT_TYPES
COPYING_COLUMNS = ["layer", "head", "copying_score", "positive_eigenvalue_share"]


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy()


def unembedding(model) -> tuple[np.ndarray | None, str | None]:
    """``W_U`` as ``[hidden, vocab]`` (the language-model head's weight, or the input embeddings where they are tied and no
    head is loaded), or ``(None, reason)``."""
    head = model.get_output_embeddings()
    if head is not None:
        return _array(head.weight).T, None
    if getattr(model.config, "tie_word_embeddings", False):
        return _array(model.get_input_embeddings().weight).T, None
    return None, "no copying score: the model has no unembedding (no language-model head is loaded and its input embeddings are not tied to one)"


def value_weights(attention, model_type: str, heads: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """``W_V`` per query head, ``[heads, hidden, head_dim]`` (``x W_V^h`` is head h's value): a grouped-query model's query head
    reads its group's value head (``h // (heads / kv_heads)``)."""
    if model_type in GPT2_TYPES:
        weight = _array(attention.c_attn.weight)  # Conv1D: [hidden, 3 * hidden], queries | keys | values
        hidden = weight.shape[0]
        values = weight[:, 2 * hidden :]
    else:  # nn.Linear: [kv_heads * head_dim, hidden]
        values = _array((attention.v_proj if model_type in LLAMA_TYPES else attention.value).weight).T
    group = heads // kv_heads
    return np.stack([values[:, (h // group) * head_dim : (h // group + 1) * head_dim] for h in range(heads)])


def _final_norm_gain(base, model_type: str) -> np.ndarray | None:
    """The gain of the norm before the unembedding (GPT-2's ``ln_f``, Llama's ``norm``); None for a post-norm encoder."""
    if model_type in GPT2_TYPES:
        return _array(base.ln_f.weight)
    if model_type in LLAMA_TYPES:
        return _array(base.norm.weight)
    return None


def ov_eigenvalues(w_e: np.ndarray, w_v: np.ndarray, w_o: np.ndarray, w_u: np.ndarray) -> np.ndarray:
    """The ``d_head`` eigenvalues of ``W_E W_V W_O W_U`` that can be nonzero, as those of ``W_O W_U W_E W_V`` ([d_head, d_head]).

    ``w_e [vocab, hidden]``, ``w_v [hidden, d_head]``, ``w_o [d_head, hidden]``, ``w_u [hidden, vocab]``."""
    return np.linalg.eigvals((w_o @ w_u) @ (w_e @ w_v))


def copying_summary(eigenvalues: np.ndarray) -> tuple[float, float]:
    """``(copying_score, positive_eigenvalue_share)`` of a head's OV eigenvalues: first ``sum Re(lambda) / sum |lambda|``
    (Elhage et al. 2021's copying score, the ``copying_score`` column), then the share of eigenvalues with a positive real
    part (the ``positive_eigenvalue_share`` column); NaN, NaN where all are 0."""
    total = float(np.abs(eigenvalues).sum())
    if total == 0.0:
        return float("nan"), float("nan")
    return float(eigenvalues.real.sum() / total), float((eigenvalues.real > 0).mean())


def copying_scores(loaded) -> tuple[pd.DataFrame | None, str | None]:
    """Each head's copying score from the weights of ``loaded`` (a :class:`~bertology.core.model.models.LoadedModel`):
    ``(table, None)`` with :data:`COPYING_COLUMNS`, or ``(None, reason)`` where it cannot be computed (the module's docstring says how and why).

    ``copying_score`` is Elhage et al. 2021's ``sum Re(lambda) / sum |lambda|`` over the eigenvalues of the head's OV circuit
    (in [-1, 1]; positive: it raises the logits of the tokens it attends to); ``positive_eigenvalue_share`` is the share of
    those eigenvalues with a positive real part (in [0, 1])."""
    model = loaded.model
    config = model.config
    model_type = config.model_type
    if model_type not in SUPPORTED:
        return None, f"no copying score for {model_type!r} models: bertology reads the OV weights of {', '.join(sorted(SUPPORTED))} models"
    w_u, reason = unembedding(model)
    if w_u is None:
        return None, reason
    base = model.base_model
    layout = layout_of(config)
    heads = loaded.num_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    w_e = _array(model.get_input_embeddings().weight)
    final_gain = _final_norm_gain(base, model_type)
    if final_gain is not None:
        w_u = final_gain[:, None] * w_u
    rows = []
    for layer_index, layer in enumerate(layout.layers(base)):
        block = layout.block(layer, config)
        w_o_all = _array(block.output_weight)  # [heads * head_dim, hidden]
        head_dim = w_o_all.shape[0] // heads
        w_v = value_weights(block.attention, model_type, heads, kv_heads, head_dim)
        if block.pre_norm:  # LN(x) = gamma * normalised(x) (+ beta): gamma folds into W_V
            w_v = _array(block.layer_norm.weight)[None, :, None] * w_v
        for head in range(heads):
            score, share = copying_summary(ov_eigenvalues(w_e, w_v[head], w_o_all[head * head_dim : (head + 1) * head_dim], w_u))
            rows.append({"layer": layer_index, "head": head, "copying_score": score, "positive_eigenvalue_share": share})
    return pd.DataFrame(rows, columns=COPYING_COLUMNS), None
