"""Value zeroing (Mohebbi, Zuidema, Chrupala & Alishahi 2023, "Quantifying Context Mixing in Transformers"), a numpy
port of the authors' code, hmohebbi/ValueZeroing (commit 57d448d):

- ``modeling/customized_modeling_bert.py``, ``BertSelfAttention.forward(..., zero_value_index=t)``: after the softmax
  (the attention probabilities are left as they are), ``value_layer[:, :, t] = 0``: token t's value vector
  ``x_t W_V + b_V`` (bias included) is set to zero in *every* head; the layer then runs on as usual
  (``BertLayer.forward``: output projection, residual, layer norm, feed-forward, residual, layer norm);
- ``scoring/value_zeroing.py`` (and ``demo.py``, the same loop): for each layer l and token t, the layer alone is run
  again on the original input ``hidden_states[l]`` with ``zero_value_index=t``; the score of query i on t is
  ``sklearn.metrics.pairwise.cosine_distances(zeroed, original).diagonal()[i]``, i.e. ``1 - cos`` between token i's
  layer output with and without t's values, the original being ``hidden_states[l + 1]`` of the unmodified forward;
  ``score_matrix[l, :, t] = distances``; then ``score_matrix / score_matrix.sum(-1)`` (rows sum to 1, over all tokens,
  the diagonal included); the rollout is ``compute_joint_attention(score_matrix, res=False)``: ``R_0 = C_0``,
  ``R_l = C_l @ R_{l-1}``.

The authors' code has a customised BERT only (``MODEL_PATH`` names roberta and electra, but only
``customized_modeling_bert`` exists); RoBERTa has BERT's layer, and for DistilBERT the same zeroing is applied to the
output of ``attention.v_lin``. Special tokens: [CLS] and [SEP] are kept as queries and as zeroed tokens, and normalised
over like any other; one sentence at a time (``batch_size=1``, ``max_length=None``: no padding, the attention mask all
ones). The authors' code has no per-head variant: :func:`value_zeroing` adds one (METHODS.md section 11, "zeroing one
head's value of j gives a per-head score") by zeroing ``value_layer[:, h, t]`` only, scored and normalised the same way,
each head's rows on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .encoder import LayerWeights, hidden_states, layer_forward, layer_weights, rollout


@dataclass
class ValueZeroingResult:
    layers: np.ndarray  # [layer, i, t], rows normalised to sum 1 (score_matrix after the division)
    rollout: np.ndarray  # [layer, i, t], compute_joint_attention(layers, res=False)
    heads: np.ndarray  # [layer, head, i, t], each head's rows normalised to sum 1
    layers_raw: np.ndarray  # the cosine distances before normalisation
    heads_raw: np.ndarray
    hidden_states: np.ndarray  # [layer + 1, n, d], recomputed in numpy


def cosine_distances_diagonal(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``sklearn.metrics.pairwise.cosine_distances(x, y).diagonal()``: ``clip(1 - <x_i/|x_i|, y_i/|y_i|>, 0, 2)``
    (sklearn's ``normalize`` leaves a zero row at zero)."""

    def normalize(z: np.ndarray) -> np.ndarray:
        norms = np.sqrt(np.einsum("ij,ij->i", z, z))
        norms[norms == 0.0] = 1.0
        return z / norms[:, None]

    return np.clip(1.0 - np.einsum("ij,ij->i", normalize(x), normalize(y)), 0.0, 2.0)


def zeroed_output(x: np.ndarray, w: LayerWeights, token: int, head: int | None = None) -> np.ndarray:
    """Layer output on input ``x`` with token ``token``'s value vector zeroed in every head (``head=None``,
    ``value_layer[:, :, t] = 0``) or in head ``head`` only."""
    value = layer_forward(x, w)["value"].copy()  # [h, n, dh]
    if head is None:
        value[:, token] = 0.0
    else:
        value[head, token] = 0.0
    return layer_forward(x, w, value=value)["output"]


def value_zeroing_layer(x: np.ndarray, w: LayerWeights, original: np.ndarray | None = None, head: int | None = None) -> np.ndarray:
    """The raw cosine distances ``[i, t]`` of one layer (``score_matrix[l]`` before the division). ``original``: the
    layer's unmodified output (``hidden_states[l + 1]``); recomputed from ``x`` when not given."""
    original = layer_forward(x, w)["output"] if original is None else original
    n = x.shape[0]
    scores = np.zeros((n, n))
    for token in range(n):
        scores[:, token] = cosine_distances_diagonal(zeroed_output(x, w, token, head), original)
    return scores


def _rows(scores: np.ndarray) -> np.ndarray:
    return scores / np.sum(scores, axis=-1, keepdims=True)


def value_zeroing(model, input_ids, *, per_head: bool = True) -> ValueZeroingResult:
    """Value zeroing of one unpadded sequence on a Hugging Face BERT / RoBERTa / DistilBERT ``model`` (use float64):
    per-layer maps ``[layer, n, n]`` (row i: the token whose output moves, column t: the token whose values are zeroed),
    their rollout, and per-head maps ``[layer, head, n, n]`` (``per_head=False`` leaves them empty)."""
    weights = layer_weights(model)
    states = hidden_states(model, input_ids, weights)
    raw = np.stack([value_zeroing_layer(states[index], w, states[index + 1]) for index, w in enumerate(weights)])
    if per_head:
        heads_raw = np.stack([np.stack([value_zeroing_layer(states[index], w, states[index + 1], head) for head in range(w.num_heads)])
                              for index, w in enumerate(weights)])
    else:
        heads_raw = np.zeros((len(weights), 0) + raw.shape[1:])
    layers = _rows(raw)
    return ValueZeroingResult(layers=layers, rollout=rollout(layers), heads=_rows(heads_raw), layers_raw=raw,
                              heads_raw=heads_raw, hidden_states=states)
