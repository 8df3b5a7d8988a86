"""Maps by blocks of queries (issue 40) within an attention budget, by default ``auto`` (issue 49): the attention function
computes a layer's maps a block of query rows at a time, the analyzers that fold blocks give what whole maps give, and those
that need whole maps are left out of the run in one line naming the budget. References: transformers' own eager attention
(``attn_implementation="eager"``) and the engine's whole-map pass."""

import json
from functools import partial

import numpy as np
import pytest
import torch
from conftest import TEXTS, eager_reference, tiny_examples

from bertology.core.engine import Engine, RunStats
from bertology.core.errors import BertologyError
from bertology.core.model import memory
from bertology.core.model.hooks import Hooks
from bertology.core.model.models import load_model
from bertology.core.text.corpora import Example
from bertology.families.profile.analyzer import GeneralProfile
from bertology.families.roles.analyzer import HeadRoles
from bertology.families.rollout.analyzer import AttentionRollout
from bertology.families.sinks.analyzer import AttentionSinks
from bertology.families.syntax.analyzer import RelationHeads
from bertology.testing.analyzers import AnalyzerContract, assert_same_result


@pytest.mark.parametrize("name", ["llama64", "bert64"])
def test_blocked_attention_is_transformers_eager_attention(name, request):
    """Every block of rows the ``pattern`` hook point sees, put together, is transformers' eager map, and the output the
    blocks build is the eager model's (one sequence each, no padding, float64; Llama's eager softmax runs in float32, so to
    1e-6); and the same as bertology's whole maps and output to float64 rounding."""
    loaded = request.getfixturevalue(name)
    examples = tiny_examples()[:3]
    references = eager_reference(loaded, examples)

    def run(ids, query_rows):
        blocks = {}
        hooks = Hooks()
        hooks.query_rows = query_rows
        hooks.add("pattern", lambda layer, pattern: blocks.setdefault(layer, []).append((hooks.rows, pattern[0].clone())))
        with torch.inference_mode(), hooks.attach(loaded.model):
            out = loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        return blocks, torch.stack(out.hidden_states)[:, 0].numpy()

    for example, reference in zip(examples, references):
        ids = torch.tensor([reference["ids"]])
        n = ids.shape[1]
        assert n > 4, "the example must span several blocks"
        (blocks, hidden), (whole, whole_hidden) = run(ids, 4), run(ids, None)
        for layer, parts in blocks.items():
            assert [rows.start for rows, _ in parts] == list(range(0, n, 4)) and parts[-1][0].stop == n
            maps = torch.cat([block for _, block in parts], dim=1).numpy()
            np.testing.assert_allclose(maps, reference["attentions"][layer], rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose(maps, whole[layer][0][1].numpy(), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(hidden, reference["hidden"], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(hidden, whole_hidden, rtol=1e-12, atol=1e-13)


def test_the_budget_sizes_the_blocks(tiny_bert):
    items = list(Engine(tiny_bert, progress=False).encode(enumerate(tiny_examples()[:2]), RunStats()))
    width, heads = max(len(item) for item in items), tiny_bert.num_heads
    whole = len(items) * heads * width * width * 4  # float32 maps of one layer
    engine = partial(Engine, tiny_bert, progress=False)
    assert engine().query_rows(items) is None and engine(attention_budget=whole).query_rows(items) is None
    assert engine(attention_budget=whole - 1).layer_bytes(items) == whole
    assert engine(attention_budget=whole // 2).query_rows(items) == width // 2  # as many rows as fit
    assert engine(attention_budget=1).query_rows(items) == 1  # at least one row
    assert engine(query_block=3).query_rows(items) == 3 and engine(query_block=width).query_rows(items) is None
    with pytest.raises(BertologyError, match="at least 1"):
        engine(attention_budget=0)


def test_past_the_budget_an_analyzer_of_whole_maps_is_left_out_in_one_line_naming_it(bert64):
    """With ``isolate`` (as ``analyze`` runs), the profile folds the blocks and equals its whole-map run; the syntax relation heads,
    which read whole maps, and the rollout, whose running products exceed the budget, are left out with one line that names
    them and the budget."""
    examples = tiny_examples()
    whole = GeneralProfile(bert64.kind)
    Engine(bert64, batch_size=4, progress=False).run(examples, [whole])
    profile, probes, rollout = GeneralProfile(bert64.kind), RelationHeads(bert64.kind, bootstrap=20), AttentionRollout(bert64.kind)
    stats = Engine(bert64, batch_size=4, progress=False, attention_budget=1000).run(examples, [profile, probes, rollout], isolate=True)
    assert sorted(stats.left_out) == [1, 2] and not stats.failed  # left out by the budget, a setting: no failure
    for position, analyzer in ((1, probes), (2, rollout)):
        message = stats.left_out[position]
        assert "\n" not in message and f"{analyzer.name} left out" in message and "attention budget of 1,000 bytes" in message
    assert "reads whole maps" in stats.left_out[1] and "holds" in stats.left_out[2]  # rollout's two n x n products are past the budget
    assert_same_result(whole.result(), profile.result(), "blocked profile", rtol=1e-9, atol=1e-12)
    with pytest.raises(BertologyError, match="attention budget"):  # without isolate: refused
        Engine(bert64, batch_size=4, progress=False, attention_budget=1000).run(examples, [RelationHeads(bert64.kind, bootstrap=20)])


@pytest.mark.parametrize("make", [GeneralProfile, HeadRoles, AttentionRollout])
def test_blocked_equals_whole_under_the_norm_view(make, bert64):
    """Kobayashi's norm shares are made row by row, so the norm view folds blocks too (its uniform head's included)."""
    AnalyzerContract(partial(make, bert64.kind), bert64, tiny_examples(), weighting="norm").check_blocked_equals_whole()


def test_blocked_equals_whole_under_the_uniform_null(gpt2_64):
    """The null model's ``pattern`` handler reads the block's own rows of the model's mask."""
    results = []
    for block in (None, 3):
        sinks = AttentionSinks(gpt2_64.kind)
        Engine(gpt2_64, batch_size=4, progress=False, null="uniform", query_block=block).run(tiny_examples(), [sinks])
        results.append(sinks.result())
    assert_same_result(*results, "blocked null", rtol=1e-9, atol=1e-12)


def test_the_contract_catches_an_analyzer_that_drops_blocks(bert64):
    class FirstBlockOnly(GeneralProfile):
        """A deliberately broken analyzer: it folds each layer's first block of query rows and drops the others."""

        name = "broken_for_test"

        def update_layer(self, batch, maps):
            if maps.starts_layer:
                super().update_layer(batch, maps)

    contract = AnalyzerContract(partial(FirstBlockOnly, bert64.kind), bert64, tiny_examples())
    contract.check_layer_by_layer()  # whole maps come as one block: nothing is dropped
    with pytest.raises(AssertionError, match="maps by blocks of query rows differ"):
        contract.check_blocked_equals_whole()


def test_an_analyzer_that_does_not_say_it_folds_is_refused_blocks(bert64):
    class Unsaid(GeneralProfile):
        name = "unsaid"
        folds_row_blocks = False

    AnalyzerContract(partial(Unsaid, bert64.kind), bert64, tiny_examples()).check_blocked_equals_whole()  # the refusal rule
    with pytest.raises(BertologyError, match="unsaid left out: the pass computes maps by blocks of 3 query rows"):
        Engine(bert64, progress=False, query_block=3).run(tiny_examples(), [Unsaid(bert64.kind)])


def test_headtypes_by_blocks_under_a_budget_equal_the_whole_run(gpt2_64):
    """Decoder head types past an attention budget: the pass computes each layer's maps by blocks of query rows (the budget
    holds about a fifth of a layer's maps), and the previous-token, duplicate-token and induction scores, the uniform head's
    and the paired tests equal those of whole maps."""
    from bertology.families.headtypes.analyzer import HEAD_TYPES, HeadTypes

    class Recording(HeadTypes):
        """Head types that note the query rows of every block they fold."""

        def update_layer(self, batch, maps):
            self.blocks = [*getattr(self, "blocks", []), maps.rows]
            super().update_layer(batch, maps)

    examples = tiny_examples()
    items = list(Engine(gpt2_64, progress=False).encode(enumerate(examples), RunStats()))
    budget = Engine(gpt2_64, progress=False).layer_bytes(items[:1]) // 5
    whole, blocked = HeadTypes(gpt2_64.kind), Recording(gpt2_64.kind)
    Engine(gpt2_64, batch_size=4, progress=False).run(examples, [whole])
    Engine(gpt2_64, batch_size=4, progress=False, attention_budget=budget).run(examples, [blocked])
    assert sum(rows is not None and rows.start > 0 for rows in blocked.blocks) >= gpt2_64.num_layers, "the budget must force blocks"
    table = whole.result()
    assert set(table.role) == set(HEAD_TYPES) and table.value.notna().all()
    assert_same_result(table, blocked.result(), "blocked head types", rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_model_budgets_float32_maps(tiny_llama_dir, dtype):
    """Every analysis reads float32 maps whatever the weights (docs/methods.md#statistics-conventions), so the budget counts 4
    bytes a weight: a half-precision model's blocks hold as many query rows as a float32 model's, by a hand count."""
    full, half = (load_model(tiny_llama_dir, device="cpu", dtype=name) for name in ("float32", dtype))
    assert half.model.dtype == getattr(torch, dtype)
    items = list(Engine(full, progress=False).encode(enumerate(tiny_examples()[:2]), RunStats()))
    width = max(len(item) for item in items)
    row_bytes = len(items) * full.num_heads * width * 4  # one query row of every head of the batch, float32
    budget = 3 * row_bytes + 5
    engines = [Engine(loaded, progress=False, attention_budget=budget) for loaded in (full, half)]
    assert [engine.layer_bytes(items) for engine in engines] == [row_bytes * width] * 2
    assert [engine.query_rows(items) for engine in engines] == [3, 3]


def test_auto_is_the_default_budget_a_sixteenth_of_free_memory_within_64_mib(tiny_bert, monkeypatch):
    """``auto``, every engine's default: a sixteenth of the free memory of the devices that hold the layers (the machine's
    available RAM; a CUDA device's own free memory), at most 64 MiB; ``none`` and None, whole maps; a number of bytes as
    given, from the command line's text too; anything else refused in one line naming the flag."""
    engine = partial(Engine, tiny_bert, progress=False)
    for free, budget in ((64 * 2**30, 2**26), (512 * 2**20, 32 * 2**20), (None, 2**26)):  # 4 GiB capped; 32 MiB; nothing says
        monkeypatch.setattr(memory, "available_ram", lambda free=free: free)
        assert engine().settings.attention_budget == budget and engine(attention_budget="auto").settings.attention_budget == budget
    monkeypatch.setattr(memory, "parameter_devices", lambda model: [torch.device("cpu"), torch.device("cuda", 1)])  # a device map
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: ((256 * 2**20, 80 * 2**30) if torch.device(device) == torch.device("cuda", 1)
                                                                     else pytest.fail(f"asked {device}")))
    assert engine().settings.attention_budget == 16 * 2**20  # the GPU's 256 MiB free: the least of the devices'
    assert engine(attention_budget="none").settings.attention_budget is None and engine(attention_budget=None).settings.attention_budget is None
    assert engine(attention_budget="4096").settings.attention_budget == 4096 and engine(attention_budget=np.int64(4096)).settings.attention_budget == 4096
    with pytest.raises(BertologyError, match=r"^--attention-budget 'lots': give a number of bytes, auto or none$"):
        engine(attention_budget="lots")
    with pytest.raises(BertologyError, match="at least 1 byte"):
        engine(attention_budget="0")


def test_by_default_a_batch_past_the_free_memory_share_goes_by_blocks(bert64, monkeypatch):
    """With no budget given, a machine whose free memory's sixteenth is less than a batch's layer maps computes them by
    blocks of query rows, and the profile equals its whole-map run."""
    examples = tiny_examples()
    whole = GeneralProfile(bert64.kind)
    Engine(bert64, batch_size=4, progress=False, attention_budget=None).run(examples, [whole])
    monkeypatch.setattr(memory, "available_ram", lambda: 16 * 3000)
    engine = Engine(bert64, batch_size=4, progress=False)
    assert engine.settings.attention_budget == 3000
    batches = list(engine.batches(engine.encode(enumerate(examples), RunStats())))
    rows = [engine.query_rows(items) for items in batches]
    assert all(engine.layer_bytes(items) > 3000 for items in batches) and all(r is not None and r < len(b[0]) for r, b in zip(rows, batches))
    blocked = GeneralProfile(bert64.kind)
    assert not engine.run(examples, [blocked]).left_out
    assert_same_result(whole.result(), blocked.result(), "profile by blocks under auto", rtol=1e-9, atol=1e-12)


def test_the_default_budget_leaves_minilm_whole(minilm, monkeypatch):
    """all-MiniLM-L6-v2's largest batch, three sequences of 512 pieces (the cap on a batch's attention), holds 3 x 12 x 512^2 x 4
    bytes a layer, 36 MiB: under auto's 64 MiB, so the default run computes whole maps, as it did before the budget."""
    monkeypatch.setattr(memory, "available_ram", lambda: 8 * 2**30)
    engine = Engine(minilm, progress=False)
    batches = list(engine.batches(engine.encode(enumerate([Example(" ".join(["word"] * 600))] * 8), RunStats())))
    assert [(len(items), len(items[0])) for items in batches] == [(3, 512), (3, 512), (2, 512)]
    assert engine.layer_bytes(batches[0]) == 3 * 12 * 512 * 512 * 4 <= engine.settings.attention_budget == 2**26
    assert all(engine.query_rows(items) is None for items in batches)


def test_a_family_left_out_past_the_budget_leaves_the_run_complete(tiny_bert_dir, tmp_path):
    """Through the command line: past --attention-budget the profile, roles and patterns fold the blocks, and the mixing
    ratios (whole maps) and the rollout (its two n x n products past the budget) are left out of the run, each in one line
    naming the budget: the run is complete (exit 0), not partial. Without the flag the manifest records auto's bytes, and
    nothing is left out."""
    from test_cli import bertology

    corpus = tmp_path / "tiny.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    common = ("analyze", "-m", tiny_bert_dir, "-c", corpus, "--batch-size", 3, "--device", "cpu", "-q")
    result = bertology(*common, "-o", tmp_path / "budget", "--attention-budget", 2000)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "budget" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["failures"] == {} and manifest["settings"]["attention_budget"] == 2000
    assert sorted(manifest["left_out"]) == ["mixing", "rollout"]
    for family, line in manifest["left_out"].items():
        assert line.startswith(f"{family} left out: ") and "attention budget of 2,000 bytes" in line and line in result.stdout.splitlines()
        assert not (tmp_path / "budget" / f"{family}.csv").exists()
    assert (tmp_path / "budget" / "heads.csv").is_file() and (tmp_path / "budget" / "roles.csv").is_file()
    result = bertology(*common, "-o", tmp_path / "auto")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "auto" / "manifest.json").read_text())
    free = memory.available_ram()
    budget = manifest["settings"]["attention_budget"]
    assert budget == 2**26 if free is None or free > 2 * 16 * 2**26 else 0 < budget <= 2**26
    assert manifest["status"] == "complete" and manifest["left_out"] == {} and (tmp_path / "auto" / "rollout.csv").is_file()
