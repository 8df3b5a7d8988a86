"""Copies to the host per batch, counted on the CPU (issue 28: a GPU-friendliness check we can run without a GPU).

Every call that would copy a tensor from the device to the host, or wait for it (``cpu``, ``item``, ``tolist``,
``bool``/``int``/``float`` of a tensor, ``to("cpu")``, ``nonzero`` and indexing with a boolean mask), is counted
inside each analyzer's ``update_layer`` and ``finish_batch``. Per batch, each default family's analyzers make a small
fixed number of them, the same on sequences ten times longer and on batches twice as large; on sentences with trees,
the syntax family and the roles' syntactic scores too (the probe's data, kept on the host by design, once per sentence).
"""

from __future__ import annotations

import torch
from conftest import gold_example
from torch.overrides import TorchFunctionMode

from bertology.core.engine import Engine
from bertology.core.text.corpora import Example
from bertology.families.mixing.analyzer import ContextMixing
from bertology.families.patterns.analyzer import HeadPatterns
from bertology.families.profile.analyzer import GeneralProfile, HeadDistance
from bertology.families.roles.analyzer import HeadRoles
from bertology.families.rollout.analyzer import AttentionRollout
from bertology.families.syntax.analyzer import RelationHeads
from bertology.families.syntax.probes import ProbeData

# ``numpy()`` and ``__array__`` are not counted: on a GPU they refuse a device tensor, so every real copy goes through these
SYNCING = {"cpu", "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
WORDS = "the cat sat on a mat while two dogs ran far away from home and then came back again".split()


class CountHostTransfers(TorchFunctionMode):
    """Counts the calls that copy to the host or wait for the device (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(arg) == "cpu" for arg in [*args[1:], kwargs.get("device")])
        boolean_index = name in ("__getitem__", "__setitem__") and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        self.count += name in SYNCING or to_host or boolean_index
        return func(*args, **kwargs)


class Counted:
    """An analyzer whose layer and batch calls are counted, batch by batch."""

    def __init__(self, analyzer):
        self.analyzer, self.needs, self.per_batch, self._count = analyzer, analyzer.needs, [], 0

    def update_layer(self, batch, maps):
        with CountHostTransfers() as counter:
            self.analyzer.update_layer(batch, maps)
        self._count += counter.count

    def finish_batch(self, batch):
        with CountHostTransfers() as counter:
            self.analyzer.finish_batch(batch)
        self.per_batch.append(self._count + counter.count)
        self._count = 0


def texts(words: int, count: int) -> list[str]:
    return [" ".join(WORDS[(k + i) % len(WORDS)] for i in range(words)) for k in range(count)]


def transfers(model, words: int, batch_size: int, trees: bool = False) -> dict[str, list[int]]:
    kind = model.kind
    if trees:  # gold words and a flat tree: the syntax family and the roles' syntactic scores run
        examples = [gold_example(k, text) for k, text in enumerate(texts(words, 2 * batch_size))]
        analyzers = {"roles": HeadRoles(kind), "syntax": RelationHeads(kind, bootstrap=10), "probe_data": ProbeData()}
    else:
        examples = [Example(text + ".") for text in texts(words, 2 * batch_size)]
        analyzers = {"heads": GeneralProfile(kind), "head_distance": HeadDistance(sample=1.0), "roles": HeadRoles(kind), "rollout": AttentionRollout(kind),
                     "patterns": HeadPatterns(max_example_length=1000), "mixing": ContextMixing(kind)}
    counted = {name: Counted(analyzer) for name, analyzer in analyzers.items()}
    Engine(model, batch_size=batch_size, progress=False).run(examples, list(counted.values()))
    return {name: analyzer.per_batch for name, analyzer in counted.items()}


def test_host_transfers_per_batch_are_few_and_do_not_grow_with_length_or_batch_size(tiny_bert):
    short = transfers(tiny_bert, words=6, batch_size=2)
    long = transfers(tiny_bert, words=60, batch_size=2)
    wide = transfers(tiny_bert, words=60, batch_size=4)
    for name in short:
        assert len(short[name]) == 2 and len(set(short[name])) == 1, (name, short[name])
        assert short[name] == long[name] == wide[name], (name, short[name], long[name], wide[name])
    # one copy of the results per batch; patterns' thumbnails add three (their maps, the [CLS] and [SEP] masks)
    assert {name: counts[0] for name, counts in short.items()} == {"heads": 1, "head_distance": 1, "roles": 1, "rollout": 1, "patterns": 4, "mixing": 1}


def test_with_trees_the_copies_per_batch_do_not_grow_with_length(tiny_bert):
    short = transfers(tiny_bert, words=6, batch_size=2, trees=True)
    long = transfers(tiny_bert, words=40, batch_size=2, trees=True)  # within the tiny model's 64 positions, every word kept
    assert short == long, (short, long)
    # roles: the base and the syntactic scores, one copy each; syntax: every sentence's predicted parents in one copy; the
    # probe keeps each sentence's features on the host, so it copies per sentence (two arrays each), never per layer
    assert {name: set(counts) for name, counts in short.items()} == {"roles": {2}, "syntax": {1}, "probe_data": {4}}
    assert transfers(tiny_bert, words=6, batch_size=4, trees=True)["syntax"] == [1, 1]


def test_the_counter_sees_a_copy_per_sequence():
    # the check can fail: an analyzer that copies every sequence's value on its own is counted once per sequence
    with CountHostTransfers() as counter:
        values = torch.arange(4.0)
        [float(value) for value in values]
        values.cpu()
        values[values > 1]
    assert counter.count == 6
