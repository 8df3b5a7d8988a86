"""The ports against the authors' own code, run as it is, where a snapshot of their repositories is on this machine
(``$BERTOLOGY_REFERENCE_MIRRORS``, default ``/work/.mirror``: ``mt-upc+transformer-contributions/repo`` and
``hmohebbi+ValueZeroing/repo``, bare git directories); skipped elsewhere.

ALTI: ``ModelWrapper.get_contributions`` (src/contributions.py, its pyaml_env and captum imports left out), then
``normalize_contributions(scaling='min_sum')`` and ``compute_joint_attention`` (src/utils_contributions.py), as
attributions.py chains them. Value zeroing: the customised ``BertLayer`` (modeling/customized_modeling_bert.py) with
``zero_value_index=t``, in the loop of scoring/value_zeroing.py (sklearn's ``cosine_distances``), loaded with the
weights of each tiny model (DistilBERT's renamed into BERT's layout). The authors' torch code runs with float64 as the
default dtype (their ``torch.eye`` / ``torch.zeros`` would otherwise be float32)."""

from __future__ import annotations

import ast
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from .alti import alti
from .test_reference_ports import IDS, KINDS, tiny
from .value_zeroing import value_zeroing

MIRRORS = Path(os.environ.get("BERTOLOGY_REFERENCE_MIRRORS", "/work/.mirror"))
ALTI_REPO = MIRRORS / "mt-upc+transformer-contributions" / "repo"
VZ_REPO = MIRRORS / "hmohebbi+ValueZeroing" / "repo"


def show(repo: Path, path: str) -> str:
    if shutil.which("git") is None or not repo.is_dir():
        pytest.skip(f"no snapshot of the authors' code at {repo}")
    return subprocess.run(["git", "--git-dir", str(repo), "show", f"HEAD:{path}"], capture_output=True, text=True, check=True).stdout


def definitions(source: str, names: set[str], namespace: dict, filename: str) -> dict:
    """Execute only the named top-level functions and classes of ``source`` in ``namespace``."""
    nodes = [node for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names]
    assert {node.name for node in nodes} == names
    exec(compile(ast.Module(nodes, []), filename, "exec"), namespace)
    return namespace


@pytest.fixture
def float64_default():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("kind", KINDS)
def test_alti_port_equals_the_authors_code(kind, float64_default):
    yaml = pytest.importorskip("yaml")
    from transformers import BertForSequenceClassification, DistilBertForSequenceClassification, RobertaForSequenceClassification

    config = yaml.safe_load(show(ALTI_REPO, "src/config.yaml"))
    code = definitions(show(ALTI_REPO, "src/contributions.py"), {"get_module", "ModelWrapper"},
                       {"torch": torch, "nn": torch.nn, "F": torch.nn.functional, "collections": __import__("collections"),
                        "partial": __import__("functools").partial, "config": config}, "src/contributions.py")
    definitions(show(ALTI_REPO, "src/utils_contributions.py"), {"normalize_contributions", "compute_joint_attention"}, code,
                "src/utils_contributions.py")

    base = tiny(kind, seed=3)
    head = {"bert": BertForSequenceClassification, "roberta": RobertaForSequenceClassification,
            "distilbert": DistilBertForSequenceClassification}[kind]
    model = head(base.config)
    model.base_model.load_state_dict(base.state_dict(), strict=False)  # no pooler in the tiny base
    model = model.double().eval()
    model.set_attn_implementation("eager")  # output_attentions
    ids = torch.as_tensor(IDS).reshape(1, -1)
    _, _, _, data = code["ModelWrapper"](model)({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    resultant_norm = torch.norm(torch.squeeze(data["resultants"]), p=1, dim=-1)
    theirs = code["normalize_contributions"](data["contributions"], scaling="min_sum", resultant_norm=resultant_norm)
    theirs_rollout = code["compute_joint_attention"](theirs)

    ours = alti(model, IDS)
    np.testing.assert_allclose(ours.contributions, theirs.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours.rollout, theirs_rollout.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.stack([layer.transformed for layer in ours.layers]), data["transformed_vectors"].numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.stack([layer.resultant for layer in ours.layers]), data["resultants"].numpy(), rtol=0, atol=1e-12)
    # the quirk that matters at 1e-8: without pairwise_distance's eps the maps move by about 1e-6
    plain = alti(model, IDS, distance_eps=0.0)
    assert np.abs(plain.contributions - theirs.numpy()).max() > 1e-8


@pytest.mark.parametrize("kind", KINDS)
def test_value_zeroing_port_equals_the_authors_code(kind, float64_default):
    pairwise = pytest.importorskip("sklearn.metrics.pairwise")
    from transformers import BertConfig
    from transformers.activations import ACT2FN
    from transformers.pytorch_utils import apply_chunking_to_forward

    code = definitions(show(VZ_REPO, "modeling/customized_modeling_bert.py"),
                       {"BertSelfAttention", "BertSelfOutput", "BertAttention", "BertIntermediate", "BertOutput", "BertLayer"},
                       {"torch": torch, "nn": torch.nn, "math": math, "ACT2FN": ACT2FN, "apply_chunking_to_forward": apply_chunking_to_forward,
                        "find_pruneable_heads_and_indices": None, "prune_linear_layer": None}, "modeling/customized_modeling_bert.py")
    code["np"] = np
    definitions(show(VZ_REPO, "scoring/value_zeroing.py"), {"compute_joint_attention"}, code, "scoring/value_zeroing.py")

    model = tiny(kind, seed=4)
    config = model.config
    layers = []
    if kind == "distilbert":
        bert_config = BertConfig(hidden_size=config.dim, num_attention_heads=config.n_heads, intermediate_size=config.hidden_dim,
                                 hidden_act=config.activation, layer_norm_eps=1e-12)
        names = {"attention.self.query": "attention.q_lin", "attention.self.key": "attention.k_lin", "attention.self.value": "attention.v_lin",
                 "attention.output.dense": "attention.out_lin", "attention.output.LayerNorm": "sa_layer_norm",
                 "intermediate.dense": "ffn.lin1", "output.dense": "ffn.lin2", "output.LayerNorm": "output_layer_norm"}
        for layer in model.transformer.layer:
            state = layer.state_dict()
            theirs = code["BertLayer"](bert_config)
            theirs.load_state_dict({f"{a}.{p}": state[f"{b}.{p}"] for a, b in names.items() for p in ("weight", "bias")})
            layers.append(theirs.double().eval())
    else:
        for layer in model.encoder.layer:
            theirs = code["BertLayer"](config)
            theirs.load_state_dict(layer.state_dict())
            layers.append(theirs.double().eval())

    with torch.no_grad():
        outputs = model(input_ids=torch.as_tensor(IDS).reshape(1, -1), output_hidden_states=True)
    org_hidden_states = torch.stack(outputs["hidden_states"]).squeeze(1)
    seq_length = len(IDS)
    mask = torch.zeros(1, 1, 1, seq_length)  # get_extended_attention_mask of an all-ones attention mask
    score_matrix = np.zeros((len(layers), seq_length, seq_length))
    for index, layer_module in enumerate(layers):  # scoring/value_zeroing.py's loop
        for t in range(seq_length):
            with torch.no_grad():
                layer_outputs = layer_module(org_hidden_states[index].unsqueeze(0), attention_mask=mask, output_attentions=False, zero_value_index=t)
            hidden = layer_outputs[0].squeeze().detach().cpu().numpy()
            score_matrix[index, :, t] = pairwise.cosine_distances(hidden, org_hidden_states[index + 1].numpy()).diagonal()
    raw = score_matrix.copy()
    score_matrix = score_matrix / np.sum(score_matrix, axis=-1, keepdims=True)

    ours = value_zeroing(model, IDS, per_head=False)
    np.testing.assert_allclose(ours.layers_raw, raw, rtol=0, atol=1e-14)
    np.testing.assert_allclose(ours.layers, score_matrix, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours.rollout, code["compute_joint_attention"](score_matrix, res=False), rtol=0, atol=1e-12)
