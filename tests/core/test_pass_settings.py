"""One frozen settings object for a pass (issue 50): the engine is made from it and keeps it fixed on its model, a Ray
actor's engine receives it whole and batches as the driver's, and fitting the families to a model returns its choice
without changing the settings it was given."""

import copy
import dataclasses

import pandas as pd
import pytest
import torch
from conftest import TEXTS

from bertology.core.backends import PassPlan, PassWorker
from bertology.core.engine import Engine, PassSettings, RunStats
from bertology.core.errors import BertologyError
from bertology.core.model.models import load_model
from bertology.core.text.corpora import Example
from bertology.families import get_family
from bertology.families.profile.analyzer import GeneralProfile
from bertology.studies.analyze.choosing import fit_model, run_settings


def test_the_engine_is_made_from_the_settings_and_keeps_them_fixed_on_its_model(tiny_bert):
    given = PassSettings(batch_size=2, max_length=10**6, attention_budget="1000", punct="clark")
    engine = Engine(tiny_bert, given, progress=False)
    assert engine.settings == dataclasses.replace(given, max_length=tiny_bert.max_length, attention_budget=1000)
    assert (given.max_length, given.attention_budget) == (10**6, "1000")  # the given object is never changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.batch_size = 3
    by_name = Engine(tiny_bert, batch_size=2, max_length=10**6, attention_budget="1000", punct="clark", progress=False)
    assert by_name.settings == engine.settings
    assert Engine(tiny_bert, given, batch_size=5, progress=False).settings == dataclasses.replace(engine.settings, batch_size=5)
    items = list(engine.encode(enumerate(Example(text) for text in TEXTS), RunStats()))
    assert [len(batch) for batch in engine.batches(items)] == [2] * (len(TEXTS) // 2) + [1] * (len(TEXTS) % 2)
    assert engine.with_null("uniform").settings == dataclasses.replace(engine.settings, null="uniform")


@pytest.mark.parametrize("options, message", [
    ({"punct": "commas"}, "unknown punctuation set 'commas': use upos or clark"),
    ({"null": "random"}, "unknown null model 'random'"),
    ({"query_block": 0}, "a block of queries must hold at least 1 row"),
])
def test_bad_settings_are_refused_in_one_line_when_made(options, message):
    with pytest.raises(BertologyError, match=message):
        PassSettings(**options)


def test_the_settings_among_a_commands_options_are_its_fields_and_skip_long():
    options = {"batch_size": 4, "skip_long": True, "tau": 3.0, "attention_budget": "none", "seed": 7, "quiet": True}
    assert PassSettings.of(options) == PassSettings(batch_size=4, overflow="skip", attention_budget="none", seed=7)
    assert PassSettings.of({"skip_long": False}).overflow == "truncate"


def test_a_ray_actor_receives_the_settings_whole_and_batches_as_the_driver(tiny_bert):
    driver = Engine(tiny_bert, PassSettings(batch_size=3, max_length=9, attention_budget=10**6, punct="clark", device="cpu"), progress=False)
    threads = torch.get_num_threads()
    try:
        worker = PassWorker(copy.deepcopy(tiny_bert), driver.settings, threads=1)  # as Ray builds the actor, here in this process
    finally:
        torch.set_num_threads(threads)
    assert worker.engine.settings == driver.settings and not worker.engine.progress
    examples = [Example(text) for text in TEXTS]
    longer = sum(len(tiny_bert.tokenizer(text)["input_ids"]) > 9 for text in TEXTS)  # max_length 9 cuts these, alike on both sides
    _, (shard,), shard_stats = worker.run(0, 0, examples, PassPlan(lambda: [GeneralProfile(tiny_bert.kind)], ["attention"]))
    local = GeneralProfile(tiny_bert.kind)
    local_stats = driver.run(examples, [local])
    assert (shard_stats.batches, shard_stats.truncated) == (local_stats.batches, local_stats.truncated) == (-(-len(TEXTS) // 3), longer)
    pd.testing.assert_frame_equal(shard.result(), local.result())  # the same cuts, batches and punctuation: the same numbers


def test_fitting_the_families_to_a_model_returns_its_choice_and_changes_no_setting(tiny_gpt2_dir):
    decoder = load_model(tiny_gpt2_dir, device="cpu")
    chosen = [get_family(name) for name in ("profile", "mixing")]  # Kobayashi's mixing ratios have no meaning on a decoder
    settings = run_settings(chosen, {}, PassSettings(), with_trees=False, parser=None, views=["attention"], limit=None, correction="fdr_bh",
                            min_sample=10)
    before = copy.deepcopy(settings)
    fitted = fit_model(chosen, decoder, settings, set(), {})
    assert settings == before
    assert [family.name for family in fitted.families] == ["profile"]
    mixing_options = {option.name for option in get_family("mixing").options}
    assert fitted.settings == {**{name: value for name, value in before.items() if name not in mixing_options}, "analyses": ["profile"],
                               "kind": "decoder"}
    assert fitted.warnings == [f"mixing left out on a decoder: {get_family('mixing').unfit}"]
