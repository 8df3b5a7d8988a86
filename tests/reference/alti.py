"""ALTI (Ferrando, Gallego & Costa-jussa 2022, "Measuring the Mixing of Contextual Information in the Transformer"),
a numpy port of the authors' code, mt-upc/transformer-contributions (commit 4f89039):

- ``src/contributions.py``, ``ModelWrapper.get_contributions``: the per-layer decomposition of the attention block
  (multi-head attention, residual, layer norm ``ln1``) into one vector per source token, and the L1 "importance";
- ``src/utils_contributions.py``, ``normalize_contributions(..., scaling='min_sum', resultant_norm=||y||_1)``: the
  contributions, clipped at 0 and normalised per row;
- ``src/utils_contributions.py``, ``compute_joint_attention``: the rollout, with no residual added (the residual is
  already inside the contributions);
- ``attributions.py`` and ``Text_classification.ipynb`` chain them in that order ("Our method relevances").

The authors' arithmetic, one layer l with input ``x`` ``[n, d]`` (``hidden_states[l]``), ``A_h`` the attention
probabilities, ``v_j^h = x_j W_V^h + b_V^h`` (the output of the ``value`` Linear, bias included), ``W_O^h`` head h's slice
of the output projection ``dense``, ``L(z) = z (I - 11^T/d) diag(gamma)`` the layer norm's linear part (``l_transform``):

    T~_i(x_j) = sum_h A_h[i, j] v_j^h W_O^h  +  [i == j] x_i                    (residual_weighted_layer)
    s_i       = 1 / std(pre_ln_i + eps)         std biased; pre_ln = the input of ln1   (ln_std_coef)
    T_i(x_j)  = L(T~_i(x_j)) * s_i                                             (transformed_vectors_std)
    y_i       = (sum_j L(T~_i(x_j)) + L(b_O)) * s_i + beta                     (resultant == ln1's output)
    imp[i, j] = -|| T_i(x_j) - y_i + 1e-6 ||_1       torch.nn.functional.pairwise_distance(T, y, p=1), eps=1e-6
    c[i, j]   = max(0, imp[i, j] + ||y_i||_1),   then c[i, :] /= sum_j c[i, j]
    R_0 = c_0,  R_l = c_l @ R_{l-1}

So the value bias ``b_V`` travels with each source token j (weighted by ``A_h[i, j]``); the output bias ``b_O`` (through
L and s_i) and the layer norm's ``beta`` sit only in ``y_i``, in no ``T_i(x_j)``.

Two quirks of the authors' code are kept by default and can be switched off:

- ``ln_eps="authors"``: ``(pre_ln + eps).std(-1)`` adds eps to the *vector*, not the variance, so the scale is
  ``1 / std(pre_ln)`` and the layer norm's eps has no effect (``ln_eps="model"``: ``1 / sqrt(var + eps)``, what the
  layer norm really does, so that ``y_i`` equals ln1's output exactly);
- ``distance_eps=1e-6``: ``F.pairwise_distance`` adds its ``eps`` to every component of ``T - y`` before the norm
  (``distance_eps=0``: the plain ``||y_i - T_i(x_j)||_1`` of the paper and of METHODS.md section 11).

The authors' ``normalize_contributions`` also writes into ``torch.zeros(...)``, i.e. float32; this port stays float64.
Special tokens: the authors keep every token ([CLS], [SEP], <s>, </s>) as source and target, and normalise over all
of them; they run one sentence at a time (batch 1, no padding; ``ln_std_coef`` is ``view(1, -1, 1)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .encoder import LayerWeights, hidden_states, layer_forward, layer_weights, rollout


@dataclass
class AltiLayer:
    """One layer of :func:`alti_layer`; every array float64."""

    transformed: np.ndarray  # T_i(x_j), [i, j, d]  (transformed_vectors_std)
    resultant: np.ndarray  # y_i, [i, d]  (resultant)
    bias_term: np.ndarray  # L(b_O) * s_i + beta, [i, d]: the part of y_i that is in no T_i(x_j)
    importance: np.ndarray  # -||T_i(x_j) - y_i (+ eps)||_p, [i, j]  (importance_matrix)
    contributions: np.ndarray  # rows normalised, [i, j]  (normalize_contributions 'min_sum')
    real_output: np.ndarray  # ln1's output computed by the layer itself, [i, d]  (post_ln_states)


@dataclass
class AltiResult:
    contributions: np.ndarray  # [layer, i, j], rows sum to 1
    rollout: np.ndarray  # [layer, i, j]: R_l, the contributions of the input tokens (embeddings) to layer l's output
    layers: list[AltiLayer]
    hidden_states: np.ndarray  # [layer + 1, n, d], the layer inputs (and the last output) recomputed in numpy


def l_transform(x: np.ndarray, gamma: np.ndarray) -> np.ndarray:
    """The authors' ``l_transform`` (src/contributions.py, inside ``get_contributions``): ``x (I - 11^T / d) diag(gamma)``,
    the layer norm's centring and scaling by its weight, as a linear map."""
    d = gamma.shape[0]
    mean_transf = np.eye(d) - np.ones((d, d)) / d
    return np.einsum("...e,ef,fg->...g", x, mean_transf, np.diag(gamma))


def pairwise_distance(x1: np.ndarray, x2: np.ndarray, p: float = 1.0, eps: float = 1e-6) -> np.ndarray:
    """``torch.nn.functional.pairwise_distance(x1, x2, p, eps)``: ``||x1 - x2 + eps||_p`` over the last axis."""
    diff = np.abs(x1 - x2 + eps)
    return diff.sum(axis=-1) if p == 1 else (diff**p).sum(axis=-1) ** (1.0 / p)


def alti_layer(x: np.ndarray, w: LayerWeights, *, ln_eps: str = "authors", distance_eps: float = 1e-6, p: float = 1.0) -> AltiLayer:
    """``ModelWrapper.get_contributions`` (src/contributions.py) for one post-norm layer (``pre_layer_norm: 'False'`` in
    src/config.yaml, as for bert, roberta and distilbert), followed by ``normalize_contributions(scaling='min_sum',
    resultant_norm=||y||_p)`` (src/utils_contributions.py). ``p=2`` gives the authors' ``contributions_l2`` variant."""
    if ln_eps not in ("authors", "model"):
        raise ValueError("ln_eps: 'authors' or 'model'")
    forward = layer_forward(x, w)
    probs, value = forward["probs"], forward["value"]  # [h, n, n], [h, n, dh]
    n, d = x.shape
    heads, dh = w.num_heads, w.head_dim

    # VW_O: einsum('bhsv,dhv->bhsd', value_layer, dense.weight.view(all_head_size, H, dh))
    dense = w.wo.T.reshape(d, heads, dh)  # dense.weight ([out, in]) viewed [out, head, head_dim]
    transformed_layer = np.einsum("hsv,dhv->hsd", value, dense)  # [h, j, d]
    # AVW_O, then summed over heads: [i, j, d]
    weighted_layer = np.einsum("hks,hsd->hksd", probs, transformed_layer)
    summed_weighted_layer = weighted_layer.sum(axis=0)
    # residual: einsum('sk,bsd->bskd', eye(n), hidden_states): x_i on the diagonal (i == j)
    residual = np.einsum("sk,sd->skd", np.eye(n), x)
    residual_weighted_layer = summed_weighted_layer + residual

    transformed_vectors = l_transform(residual_weighted_layer, w.ln1_gamma)
    attn_output = transformed_vectors.sum(axis=1)  # sum over source tokens j
    dense_bias_term = l_transform(w.bo, w.ln1_gamma)
    pre_ln_states = forward["pre_ln1"]
    if ln_eps == "authors":
        ln_std_coef = 1.0 / np.std(pre_ln_states + w.ln1_eps, axis=-1)  # (pre_ln_states + ln1_eps).std(-1, unbiased=False)
    else:
        ln_std_coef = 1.0 / np.sqrt(np.var(pre_ln_states, axis=-1) + w.ln1_eps)
    resultant = (attn_output + dense_bias_term) * ln_std_coef[:, None] + w.ln1_beta
    transformed_vectors_std = transformed_vectors * ln_std_coef[:, None, None]

    # importance_matrix = -F.pairwise_distance(transformed_vectors_std, resultant.unsqueeze(2), p=1)
    importance = -pairwise_distance(transformed_vectors_std, resultant[:, None, :], p=p, eps=distance_eps)

    # normalize_contributions(..., scaling='min_sum', resultant_norm=torch.norm(resultants, p=1, dim=-1))
    resultant_norm = np.abs(resultant).sum(axis=-1) if p == 1 else np.linalg.norm(resultant, ord=p, axis=-1)
    contributions = np.clip(importance + np.abs(resultant_norm)[:, None], 0.0, None)
    contributions = contributions / contributions.sum(axis=-1, keepdims=True)

    return AltiLayer(transformed=transformed_vectors_std, resultant=resultant,
                     bias_term=dense_bias_term * ln_std_coef[:, None] + w.ln1_beta, importance=importance,
                     contributions=contributions, real_output=forward["attention"])


def alti(model, input_ids, *, ln_eps: str = "authors", distance_eps: float = 1e-6, p: float = 1.0) -> AltiResult:
    """ALTI of one unpadded sequence on a Hugging Face BERT / RoBERTa / DistilBERT ``model`` (use float64):
    per-layer contributions ``[layer, n, n]`` (row i: query/output token, column j: source token; rows sum to 1) and
    their rollout ``R_l = c_l @ R_{l-1}`` (``compute_joint_attention``). ``input_ids``: 1-D, special tokens included as
    the tokenizer adds them; every token is kept, as in the authors' code."""
    weights = layer_weights(model)
    states = hidden_states(model, input_ids, weights)
    layers = [alti_layer(states[index], w, ln_eps=ln_eps, distance_eps=distance_eps, p=p) for index, w in enumerate(weights)]
    contributions = np.stack([layer.contributions for layer in layers])
    return AltiResult(contributions=contributions, rollout=rollout(contributions), layers=layers, hidden_states=states)
