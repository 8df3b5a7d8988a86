"""A post-norm encoder layer in numpy, for the reference ports of ALTI and value zeroing (tests/reference/alti.py,
tests/reference/value_zeroing.py).

Weights are read once out of a Hugging Face BERT, RoBERTa or DistilBERT model (any head on top: the base model is
used) and turned into float64 numpy arrays, oriented for ``x @ W + b``. The embedding output is the one thing taken from
torch (``model.base_model.embeddings(input_ids)``); every layer after it is recomputed here, so the ports see the layer
inputs ``x`` the authors' code reads from ``output_hidden_states``.

One unpadded sequence at a time, as in both authors' code (batch size 1, no padding): a padded batch is expected to
give, on each sequence's real tokens, what the port gives on that sequence alone.

Nothing here imports bertology.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Architectures the ports know: BERT's layout (``encoder.layer[l].attention.self`` ...) and DistilBERT's.
BERT_LIKE = ("bert", "roberta")
DISTILBERT = ("distilbert",)

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _activation(name: str, x: np.ndarray) -> np.ndarray:
    """The feed-forward activation by its transformers name (``gelu`` is the exact, erf-based one)."""
    if name == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "relu":
        return np.maximum(x, 0.0)
    raise NotImplementedError(f"activation {name!r}")


def _np(tensor) -> np.ndarray:
    return tensor.detach().cpu().double().numpy()


@dataclass
class LayerWeights:
    """One encoder layer's parameters, float64, every matrix as ``x @ W`` (``[in, out]``)."""

    wq: np.ndarray
    bq: np.ndarray
    wk: np.ndarray
    bk: np.ndarray
    wv: np.ndarray
    bv: np.ndarray
    wo: np.ndarray  # [heads * head_dim, hidden]: rows h*dh:(h+1)*dh are head h's W_O^h
    bo: np.ndarray
    ln1_gamma: np.ndarray
    ln1_beta: np.ndarray
    ln1_eps: float
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray
    ln2_gamma: np.ndarray
    ln2_beta: np.ndarray
    ln2_eps: float
    num_heads: int
    activation: str

    @property
    def head_dim(self) -> int:
        return self.wv.shape[1] // self.num_heads


def _linear(module) -> tuple[np.ndarray, np.ndarray]:
    return _np(module.weight).T.copy(), _np(module.bias)


def layer_weights(model) -> list[LayerWeights]:
    """The encoder layers of a BERT / RoBERTa / DistilBERT model (or of the base model under a task head)."""
    config = model.config
    base = model.base_model
    layers = []
    if config.model_type in BERT_LIKE:
        for layer in base.encoder.layer:
            att = layer.attention
            layers.append(LayerWeights(
                *_linear(att.self.query), *_linear(att.self.key), *_linear(att.self.value), *_linear(att.output.dense),
                _np(att.output.LayerNorm.weight), _np(att.output.LayerNorm.bias), float(att.output.LayerNorm.eps),
                *_linear(layer.intermediate.dense), *_linear(layer.output.dense),
                _np(layer.output.LayerNorm.weight), _np(layer.output.LayerNorm.bias), float(layer.output.LayerNorm.eps),
                num_heads=config.num_attention_heads, activation=config.hidden_act))
    elif config.model_type in DISTILBERT:
        for layer in base.transformer.layer:
            att = layer.attention
            layers.append(LayerWeights(
                *_linear(att.q_lin), *_linear(att.k_lin), *_linear(att.v_lin), *_linear(att.out_lin),
                _np(layer.sa_layer_norm.weight), _np(layer.sa_layer_norm.bias), float(layer.sa_layer_norm.eps),
                *_linear(layer.ffn.lin1), *_linear(layer.ffn.lin2),
                _np(layer.output_layer_norm.weight), _np(layer.output_layer_norm.bias), float(layer.output_layer_norm.eps),
                num_heads=config.n_heads, activation=config.activation))
    else:
        raise NotImplementedError(f"model type {config.model_type!r}: the ports know {BERT_LIKE + DISTILBERT}")
    return layers


def embeddings(model, input_ids) -> np.ndarray:
    """The embedding output ``[n, hidden]`` (the first layer's input), from the model's own embeddings module."""
    import torch

    ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long).reshape(1, -1)
    with torch.no_grad():
        return _np(model.base_model.embeddings(input_ids=ids)[0])


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """``gamma * (x - mean) / sqrt(var + eps) + beta`` over the last axis (biased variance), as torch's LayerNorm."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return gamma * (x - mean) / np.sqrt(var + eps) + beta


def split_heads(z: np.ndarray, num_heads: int) -> np.ndarray:
    """``[n, heads * head_dim] -> [heads, n, head_dim]`` (the authors' ``transpose_for_scores``)."""
    n, width = z.shape
    return z.reshape(n, num_heads, width // num_heads).transpose(1, 0, 2)


def attention_probs(x: np.ndarray, w: LayerWeights) -> np.ndarray:
    """``softmax(q k^T / sqrt(head_dim))`` of every head, ``[heads, query, key]`` (no mask: one unpadded sequence)."""
    q = split_heads(x @ w.wq + w.bq, w.num_heads)
    k = split_heads(x @ w.wk + w.bk, w.num_heads)
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(w.head_dim)
    scores = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    return e / e.sum(axis=-1, keepdims=True)


def values(x: np.ndarray, w: LayerWeights) -> np.ndarray:
    """The value vectors ``x W_V + b_V`` of every head, ``[heads, key, head_dim]``."""
    return split_heads(x @ w.wv + w.bv, w.num_heads)


def layer_forward(x: np.ndarray, w: LayerWeights, value: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One post-norm layer on input ``x`` ``[n, hidden]``; ``value`` ``[heads, n, head_dim]`` replaces the value vectors
    (after the softmax, which it does not touch: value zeroing). Returns every intermediate:

    ``probs`` [heads, n, n], ``value`` [heads, n, head_dim], ``context`` [n, heads * head_dim] (heads concatenated),
    ``pre_ln1`` (``context W_O + b_O + x``, what the attention block's layer norm sees), ``attention`` (its output),
    ``pre_ln2`` (``FFN(attention) + attention``) and ``output`` (the layer's output).
    """
    probs = attention_probs(x, w)
    v = values(x, w) if value is None else value
    context = (probs @ v).transpose(1, 0, 2).reshape(x.shape[0], -1)
    pre_ln1 = context @ w.wo + w.bo + x
    attention = layer_norm(pre_ln1, w.ln1_gamma, w.ln1_beta, w.ln1_eps)
    pre_ln2 = _activation(w.activation, attention @ w.w1 + w.b1) @ w.w2 + w.b2 + attention
    output = layer_norm(pre_ln2, w.ln2_gamma, w.ln2_beta, w.ln2_eps)
    return {"probs": probs, "value": v, "context": context, "pre_ln1": pre_ln1, "attention": attention,
            "pre_ln2": pre_ln2, "output": output}


def hidden_states(model, input_ids, weights: list[LayerWeights] | None = None) -> np.ndarray:
    """``[layers + 1, n, hidden]``: the embedding output, then every layer's output, recomputed in numpy."""
    weights = layer_weights(model) if weights is None else weights
    states = [embeddings(model, input_ids)]
    for w in weights:
        states.append(layer_forward(states[-1], w)["output"])
    return np.stack(states)


def rollout(maps: np.ndarray) -> np.ndarray:
    """Both authors' ``compute_joint_attention`` with no residual added (ALTI: src/utils_contributions.py;
    value zeroing: scoring/value_zeroing.py with ``res=False``): ``R_0 = C_0``, ``R_l = C_l @ R_{l-1}``; ``[layers, n, n]``."""
    joint = [maps[0]]
    for layer in range(1, maps.shape[0]):
        joint.append(maps[layer] @ joint[-1])
    return np.stack(joint)
