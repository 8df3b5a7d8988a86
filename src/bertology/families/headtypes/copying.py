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

Where the parts live: each is read through the model's layout (:mod:`bertology.core.model.layouts`), never by its
architecture's name. ``W_E`` the input embeddings; ``W_U`` the output embeddings (:func:`~bertology.core.model.unembedding.unembedding`:
the language-model head, loaded or read from the checkpoint where a bare model's head is its own, or ``W_E^T`` where the model
ties them); ``W_V^h`` the head's slice of the layer's value projection (:meth:`~bertology.core.model.layouts.base.Layout.value_projection`:
GPT-2's third third of ``c_attn``, Llama's ``v_proj``, GPT-NeoX's fused rows), where a grouped-query head reads its group's
value head; ``W_O^h`` its rows of the output projection. As TransformerLens's ``fold_ln`` does, a pre-norm model's norm gains
``g`` (:meth:`~bertology.core.model.layouts.base.Layout.norm_gain`, Gemma's ``1 + weight``) are folded in: the layer's input
norm's into ``W_V`` (``diag(g) W_V``) and the final norm's into ``W_U``; a norm on the attention output before the residual
(Gemma 2's, OLMo 2's) and a residual multiplier (Granite's) fold into ``W_O``. The norms' centring and scaling by the
token's own size, every bias, and positive scalars that change neither summary (Gemma's embedding scale) are left out, as in
Elhage et al.'s analysis. A model with no unembedding, whose layers no layout knows, or whose embeddings or unembedding are
not the layers' width (ALBERT's and ELECTRA-small's factorised embeddings, OPT-350m's projections: the circuit passes a
projection it does not read) gets no table and a reason (:func:`copying_scores`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from bertology.core.model.unembedding import unembedding

COPYING_COLUMNS = ["layer", "head", "copying_score", "positive_eigenvalue_share"]


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy()


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
    model, layout = loaded.model, loaded.layout
    if layout is None:
        return None, f"no copying score for {model.config.model_type!r} models: bertology does not know where they keep their layers"
    w_u, reason = unembedding(loaded)
    if w_u is None:
        return None, f"no copying score: {reason}"
    base = model.base_model
    blocks = layout.blocks(base, model.config)
    w_e = _array(model.get_input_embeddings().weight)  # [vocab, embedding]
    hidden = blocks[0].output_weight.shape[1]
    if w_e.shape[1] != hidden or w_u.shape[1] != hidden:
        return None, (f"no copying score: its embeddings are {w_e.shape[1]} wide, its unembedding reads {w_u.shape[1]} and its layers "
                      f"write {hidden}: the OV circuit would pass a projection between them that it does not read")
    w_u = _folded(layout, layout.final_norm(base), _array(w_u).T)  # [hidden, vocab]
    rows = []
    for layer_index, block in enumerate(blocks):
        w_o_all, w_v_all = head_projections(layout, block)
        head_dim = w_o_all.shape[0] // loaded.num_heads
        group = loaded.num_heads // (w_v_all.shape[1] // head_dim)  # query heads per key-value head
        for head in range(loaded.num_heads):
            value_head = head // group
            w_v = w_v_all[:, value_head * head_dim : (value_head + 1) * head_dim]
            score, share = copying_summary(ov_eigenvalues(w_e, w_v, w_o_all[head * head_dim : (head + 1) * head_dim], w_u))
            rows.append({"layer": layer_index, "head": head, "copying_score": score, "positive_eigenvalue_share": share})
    return pd.DataFrame(rows, columns=COPYING_COLUMNS), None


def _folded(layout, norm, matrix: np.ndarray) -> np.ndarray:
    """``diag(g) matrix`` with ``g`` the gain of ``norm`` (:meth:`~bertology.core.model.layouts.base.Layout.norm_gain`);
    ``matrix`` itself where there is no norm or it has no gain."""
    gain = layout.norm_gain(norm) if norm is not None else None
    return matrix if gain is None else _array(gain)[:, None] * matrix


def head_projections(layout, block) -> tuple[np.ndarray, np.ndarray]:
    """``(W_O [heads * head_dim, hidden], W_V [hidden, kv_heads * head_dim])`` of one layer in float64, with what acts linearly
    on the head's path folded in: a pre-norm layer's input norm gain into ``W_V``, the residual multiplier ``m`` and the gain
    of a norm on the attention output into ``W_O`` (``W_O m diag(g)``)."""
    w_v = _array(layout.value_projection(block.layer))
    if block.pre_norm:  # LN(x) = g * normalised(x) (+ beta): g folds into W_V
        w_v = _folded(layout, block.layer_norm, w_v)
    w_o = _array(block.output_weight) * block.output_multiplier
    if block.output_norm is not None:
        w_o = w_o * _array(block.output_norm_parts()[0])[None, :]
    return w_o, w_v
