"""``bertology label``: the queue, the file it writes, and the page in a real headless Chromium (keys, back, resume)."""

import http.client
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import TEXTS

from bertology.core.errors import BertologyError, CorpusError
from bertology.core.text.corpora import Corpus, Example
from bertology.studies.label.labelling import LabelServer, MapToLabel, choose_maps, saved_labels


@pytest.fixture
def queue(tiny_bert):
    return choose_maps(tiny_bert, [Example(t, source=f"t:{k}") for k, t in enumerate(TEXTS, start=1)], 6, seed=3)


def test_the_queue_is_stratified_over_layers_seeded_and_holds_the_maps(tiny_bert, queue):
    assert [item.layer for item in queue] == [0, 1, 0, 1, 0, 1]  # every layer in turn
    again = choose_maps(tiny_bert, [Example(t, source=f"t:{k}") for k, t in enumerate(TEXTS, start=1)], 6, seed=3)
    assert [item.key for item in again] == [item.key for item in queue]
    from bertology.core.engine import Engine, RunStats
    item = queue[0]
    engine = Engine(tiny_bert, progress=False)
    batch = engine.run_batch(list(engine.encode([(0, Example(item.text, item.text_pair))], RunStats())))
    expected = np.rint(batch.attentions[item.layer, 0, item.head].numpy() * 255)
    np.testing.assert_array_equal(item.weights, expected)


def test_inputs_of_one_piece_give_no_map_and_only_such_inputs_are_refused_naming_the_first(tiny_gpt2_dir):
    # issue 37, case 7: "cat" and "the" are one piece each for the tiny GPT-2
    from bertology.core.model.models import load_model

    gpt2 = load_model(tiny_gpt2_dir, device="cpu")
    assert [len(gpt2.tokenizer(text)["input_ids"]) for text in ("cat", "the")] == [1, 1]
    examples = [Example("cat", source="c:1"), Example("the cat sat on the mat.", source="c:2"), Example("the", source="c:3")]
    maps = choose_maps(gpt2, examples, 8, seed=0)
    assert maps and {item.text for item in maps} == {"the cat sat on the mat."}
    with pytest.raises(BertologyError) as refused:
        choose_maps(gpt2, [examples[0], examples[2]], 4, seed=0)
    assert str(refused.value) == "no sequence to analyse: every one was skipped, 2 of fewer than 2 pieces (the first: c:1)"


def test_an_uncertain_classifier_picks_the_maps_it_is_least_sure_of(tiny_bert):
    """A classifier whose certainty grows with the mass on the first column: the queue is the candidates (the same
    seeded draws, five times as many) with the highest entropy of its probabilities, computed here by hand."""
    class FirstColumn:
        def probabilities(self, attention, mask, special, segments):
            share = float(attention[0, 0, :, 0].mean())  # the map's mass on [CLS]
            p = np.array([share, 1 - share, 0, 0, 0]) * 0.999 + 0.0002
            return p[None, None]

    examples = [Example(t, source=f"t:{k}") for k, t in enumerate(TEXTS, start=1)]
    chosen = choose_maps(tiny_bert, examples, 3, seed=2, classifier=FirstColumn())
    candidates = choose_maps(tiny_bert, examples, 15, seed=2)  # the same draws, no classifier

    def entropy(item):
        share = (item.weights[:, 0] / 255).mean()
        p = np.array([share, 1 - share, 0, 0, 0]) * 0.999 + 0.0002
        return -(p * np.log(p)).sum()

    assert len(chosen) == 3 and {item.key for item in chosen} <= {item.key for item in candidates}
    others = [entropy(item) for item in candidates if item.key not in {c.key for c in chosen}]
    assert min(entropy(item) for item in chosen) >= max(others) - 1e-2  # up to the byte rounding of the weights kept here


def test_labels_are_appended_whole_and_the_last_one_for_a_map_wins(queue, tmp_path):
    path = tmp_path / "labels.jsonl"
    server = LabelServer(queue, path)
    server.add(0, "vertical")
    server.add(1, "diagonal")
    server.add(0, "block")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["label"] for line in lines] == ["vertical", "diagonal", "block"]
    assert saved_labels(path)[queue[0].key] == "block" and server.labelled == 2
    with pytest.raises(ValueError):
        server.add(99, "block")
    server.server.server_close()


def test_the_file_feeds_patterns_train(queue, tmp_path):
    path = tmp_path / "labels.jsonl"
    server = LabelServer(queue, path)
    for k, label in enumerate(["vertical", "diagonal", "block", "heterogeneous"]):
        server.add(k, label)
    server.server.server_close()
    examples = list(Corpus(path))
    assert [e.pattern_label for e in examples] == [(item.layer, item.head, label) for item, label in
                                                   zip(queue, ["vertical", "diagonal", "block", "heterogeneous"])]


def test_the_server_answers_only_its_own_host(queue, tmp_path):
    server = LabelServer(queue, tmp_path / "labels.jsonl").start()
    try:
        assert server.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.url + "queue") as response:
            assert len(json.load(response)["maps"]) == 6
        request = urllib.request.Request(server.url + "queue", headers={"Host": "evil.example:80"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request)
        assert refused.value.code == 403
    finally:
        server.stop()


def test_labelling_in_the_browser_with_keys_back_and_resume(browser, queue, tmp_path):
    path = tmp_path / "labels.jsonl"
    server = LabelServer(queue, path).start()
    try:
        page = browser.new_page()
        problems = []
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.goto(server.url)
        page.wait_for_selector("body[data-ready='1']")
        assert page.inner_text("#progress") == "0 of 6 labelled" and page.inner_text("#position") == "1 of 6"
        page.keyboard.press("1")
        page.wait_for_function("window.bertologyLabel.position === 1")
        page.keyboard.press("2")
        page.wait_for_function("window.bertologyLabel.position === 2")
        assert page.inner_text("#progress") == "2 of 6 labelled"
        assert [json.loads(line)["label"] for line in path.read_text().splitlines()] == ["vertical", "diagonal"]  # saved at once
        page.reload()  # a closed tab loses nothing: the page continues at the first map without a label
        page.wait_for_selector("body[data-ready='1']")
        assert page.inner_text("#position") == "3 of 6" and page.inner_text("#progress") == "2 of 6 labelled"
        page.keyboard.press("Backspace")  # back to map 2, labelled diagonal
        assert page.inner_text("#position") == "2 of 6"
        assert page.locator("#classes button.chosen").inner_text().endswith("diagonal")
        page.keyboard.press("5")
        page.wait_for_function("window.bertologyLabel.position === 2")
        page.keyboard.press("s")  # skip map 3
        assert page.inner_text("#position") == "4 of 6"
        assert saved_labels(path) == {queue[0].key: "vertical", queue[1].key: "heterogeneous"}
        assert problems == []
        page.close()
    finally:
        server.stop()


def test_a_labels_file_that_is_not_ours_is_refused(tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text("not json\n{}\n")
    with pytest.raises(BertologyError, match="labels.jsonl:1: not valid JSON"):
        saved_labels(path)


def test_a_label_that_is_not_json_is_refused(queue, tmp_path):
    """Another site's page can post text/plain without asking; the server takes labels only as JSON."""
    server = LabelServer(queue, tmp_path / "labels.jsonl").start()
    try:
        body = json.dumps({"position": 0, "label": "block"}).encode()
        request = urllib.request.Request(server.url + "label", data=body, headers={"Content-Type": "text/plain"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request)
        assert refused.value.code == 403 and not (tmp_path / "labels.jsonl").exists()
        request = urllib.request.Request(server.url + "label", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as response:
            assert json.load(response) == {"labelled": 1}
    finally:
        server.stop()


def hand_maps(count: int = 3) -> list[MapToLabel]:
    """Maps built here without a model (three tokens, uniform weights): enough for the labels file and the server."""
    return [MapToLabel(f"sentence {k}.", None, k % 2, k, ["[CLS]", f"sentence{k}", "[SEP]"], np.full((3, 3), 85, np.uint8))
            for k in range(count)]


def post_label(server: LabelServer, body: bytes = b"", length: str | None = "") -> tuple[int, bytes]:
    """POST ``body`` as JSON to the server's /label with Content-Length ``length`` (``""``: the body's size; None: no such
    header); the answer's status and body. A dropped connection or no answer in 5 s raises."""
    connection = http.client.HTTPConnection("127.0.0.1", server.server.server_address[1], timeout=5)
    try:
        connection.putrequest("POST", "/label")
        connection.putheader("Content-Type", "application/json")
        if length is not None:
            connection.putheader("Content-Length", length or str(len(body)))
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


VALID_LABEL = json.dumps({"position": 0, "label": "block"}).encode()


@pytest.fixture
def hand_server(tmp_path):
    server = LabelServer(hand_maps(), tmp_path / "labels.jsonl").start()
    yield server
    server.stop()


def test_a_label_after_a_last_line_without_its_line_end_is_kept(tmp_path):
    """The page answered {"labelled": 2} but glued the label onto the old line, and the restart saw none."""
    maps, path = hand_maps(), tmp_path / "labels.jsonl"
    path.write_text(json.dumps(maps[0].record("vertical")))  # no line end
    server = LabelServer(maps, path).start()
    try:
        status, body = post_label(server, json.dumps({"position": 1, "label": "diagonal"}).encode())
    finally:
        server.stop()
    assert (status, json.loads(body)) == (200, {"labelled": 2})
    assert saved_labels(path) == {maps[0].key: "vertical", maps[1].key: "diagonal"}
    assert [e.pattern_label for e in Corpus(path)] == [(0, 0, "vertical"), (1, 1, "diagonal")]  # as patterns --train reads it
    restarted = LabelServer(maps, path)
    assert restarted.labelled == 2
    restarted.server.server_close()


def test_a_last_line_cut_short_is_refused_naming_its_line(tmp_path):
    maps, path = hand_maps(), tmp_path / "labels.jsonl"
    content = json.dumps(maps[0].record("vertical")) + '\n{"text": "cut short by a cra'
    path.write_text(content)
    with pytest.raises(CorpusError, match=r"labels\.jsonl:2: not valid JSON"):
        saved_labels(path)
    with pytest.raises(CorpusError, match=r"labels\.jsonl:2: not valid JSON"):
        LabelServer(maps, path)
    assert path.read_text() == content  # nothing appended to a file that is refused


@pytest.mark.parametrize("position", ["1.0", "true", '"1"', "1e400"])
def test_a_position_that_is_not_a_json_integer_is_refused(hand_server, position):
    status, _ = post_label(hand_server, b'{"position": %s, "label": "block"}' % position.encode())
    assert status == 400 and not hand_server.path.exists()
    assert post_label(hand_server, VALID_LABEL) == (200, b'{"labelled": 1}')  # the server keeps serving


def test_json_nested_too_deep_is_refused_and_the_server_keeps_serving(hand_server):
    status, _ = post_label(hand_server, b"[" * 50_000)
    assert status == 400
    assert post_label(hand_server, VALID_LABEL) == (200, b'{"labelled": 1}')


@pytest.mark.parametrize("length, status", [("1000000000000", 413), ("65537", 413), ("-1", 400), ("1e12", 400), (None, 400)],
                         ids=["1e12-digits", "over-the-cap", "negative", "not-an-integer", "missing"])
def test_a_content_length_that_is_no_size_to_read_is_refused_unread(hand_server, length, status):
    assert post_label(hand_server, b"", length)[0] == status
    assert post_label(hand_server, VALID_LABEL) == (200, b'{"labelled": 1}')
