"""The attention viewer: its data, its escaping, and the page in a real headless Chromium."""

import base64
import json
import re
import time

import numpy as np
import pytest
from scipy.spatial.distance import jensenshannon

from bertology.studies.view import viewer
from bertology.studies.view.viewer import AttentionView, attention_view, distinctive_head, head_labels

INJECTION = '<script>alert(1)</script> "><img src=x onerror=alert(1)>'


def hand_made_maps(n=4) -> np.ndarray:
    attention = np.zeros((2, 3, n, n))
    attention[..., 0] = 0.6  # every row: 0.6 on the first token
    attention[..., 1:] = 0.4 / (n - 1)
    attention[1, 2] = np.eye(n)  # layer 1, head 2 attends to itself
    return attention


def hand_made_view(n=4, top_k=None) -> AttentionView:
    tokens = ["[CLS]", *[f"t{i}" for i in range(1, n - 1)], "[SEP]"]
    return AttentionView.from_maps(tokens, [-1, *[0] * (n - 2), -1], hand_made_maps(n), "hand", "text", top_k=top_k)


def test_dense_payload_is_the_attention_quantised_to_a_byte():
    view = hand_made_view()
    data = view.payload()
    weights_view = data["views"]["attention"]
    assert weights_view["format"] == "dense" and (data["layers"], data["heads"], data["n"], weights_view["heads"]) == (2, 3, 4, 3)
    weights = np.frombuffer(base64.b64decode(weights_view["weights"]), dtype=np.uint8).reshape(2, 3, 4, 4)
    np.testing.assert_array_equal(weights[0, 0, 0], [153, 34, 34, 34])  # round(255 * 0.6), round(255 * 0.4 / 3)
    np.testing.assert_array_equal(weights[1, 2], np.eye(4) * 255)


def test_top_k_payload_keeps_each_rows_largest_weights_with_their_positions():
    data = hand_made_view(top_k=2).payload()["views"]["attention"]
    assert data["format"] == "topk" and data["k"] == 2
    indices = np.frombuffer(base64.b64decode(data["indices"]), dtype="<u2").reshape(2, 3, 4, 2)
    weights = np.frombuffer(base64.b64decode(data["weights"]), dtype=np.uint8).reshape(2, 3, 4, 2)
    assert indices[0, 0, 0, 0] == 0 and weights[0, 0, 0, 0] == 153
    np.testing.assert_array_equal(indices[1, 2, :, 0], [0, 1, 2, 3])  # the diagonal
    np.testing.assert_array_equal(weights[1, 2, :, 0], [255] * 4)


def test_long_inputs_default_to_top_k():
    assert hand_made_view(n=200).payload()["views"]["attention"]["format"] == "topk"
    assert hand_made_view(n=200, top_k=0).payload()["views"]["attention"]["format"] == "dense"


def stored(data: dict, view: str, key: str, dtype=np.uint8) -> np.ndarray:
    """One array of a view on the page: ``weights``, ``indices``, ``rest`` or ``overview``, ``[layers, heads, ...]``."""
    values = np.frombuffer(base64.b64decode(data["views"][view][key]), dtype=dtype)
    shape = (len(data["stored_layers"]), data["views"][view]["heads"], data["n"] if key != "overview" else data["overview_size"])
    return values.reshape(shape) if key == "rest" else values.reshape(*shape, -1)


def quantised(maps) -> np.ndarray:
    return np.clip(np.rint(np.asarray(maps, dtype=np.float64) * 255), 0, 255)


def engine_maps(loaded, text):
    """The engine's maps of one text, all layers at once (not the viewer's layer-by-layer pass): weights, norm shares, rollout."""
    from bertology.core.engine import Engine, PassNeeds, RunStats
    from bertology.core.text.corpora import Example
    from bertology.families.rollout.analyzer import rollout

    engine = Engine(loaded, batch_size=1, progress=False)
    batch = engine.run_batch(list(engine.encode(enumerate([Example(text)]), RunStats())), PassNeeds(norms=True))
    return {"attention": batch.attentions[:, 0].numpy(), "norm": batch.weighted("norm").attentions[:, 0].numpy(), "rollout": rollout(batch.attentions).numpy()}


def test_the_page_carries_norm_shares_and_rollout_beside_the_weights(tiny_bert):
    data = attention_view("the cat sat on the mat.", model=tiny_bert).payload()
    assert list(data["views"]) == ["attention", "norm", "rollout"]
    assert data["kind"] == "encoder" and data["sees_later_keys"]  # an encoder's page hides no key
    assert data["views"]["rollout"]["heads"] == 1 and data["views"]["norm"]["heads"] == 4
    expected = engine_maps(tiny_bert, "the cat sat on the mat.")
    np.testing.assert_allclose(expected["norm"].sum(-1), 1, atol=1e-5)
    for name in ("attention", "norm", "rollout"):  # at most one step of 1/255 apart: a float rounding at a step's edge
        maps = expected[name] if name != "rollout" else expected[name][:, 0, None]
        assert np.abs(stored(data, name, "weights").astype(int) - quantised(maps)).max() <= 1, name


def test_the_page_computes_whole_layers_from_the_first_within_its_budget():
    assert viewer.layers_within(32, 1_000, budget=10_000) == list(range(10))
    assert viewer.layers_within(6, 1_000, budget=10_000) == list(range(6))  # every layer fits
    assert viewer.layers_within(32, 20_000, budget=10_000) == [0]  # the first, always
    # the default budget (weights and norm shares per head, one rollout map a layer): a 32 x 32-head model keeps 3 layers at
    # 1,024 tokens and every one at 256; a 12 x 12-head one every layer at 512 tokens
    assert len(viewer.layers_within(32, 1024**2 * (32 * 2 + 1))) == 3
    assert len(viewer.layers_within(32, 256**2 * (32 * 2 + 1))) == 32
    assert len(viewer.layers_within(12, 512**2 * (12 * 2 + 1))) == 12


@pytest.mark.parametrize("block_bytes", [viewer.VIEW_BLOCK_BYTES, 1], ids=["whole-layers", "a-row-at-a-time"])
def test_a_layer_past_the_budget_is_left_off_and_the_layers_kept_hold_the_engines_maps(tiny_bert, block_bytes):
    from bertology.core.errors import BertologyError
    from bertology.studies.view.report import viewer_section

    text = "the cat sat on the mat."
    expected = engine_maps(tiny_bert, text)
    n = expected["attention"].shape[-1]
    # room for one layer's weights, norm shares and rollout
    view = attention_view(text, model=tiny_bert, budget=n * n * (4 * 2 + 1), block_bytes=block_bytes)
    data = view.payload()
    assert data["layers"] == 2 and data["stored_layers"] == [0]
    for name, layer in (("attention", 0), ("norm", 0), ("rollout", 0)):
        maps = expected[name][layer:layer + 1] if name != "rollout" else expected[name][layer:layer + 1, 0, None]
        assert np.abs(stored(data, name, "weights").astype(int) - quantised(maps)).max() <= 1, name
    assert "layers 0 to 0 of 2" in " ".join(viewer_section(view).notes)
    assert data["start_head"] == distinctive_head(expected["attention"][0])
    later = attention_view(text, model=tiny_bert, layers=[1], block_bytes=block_bytes).payload()  # layer 1 alone, its rollout through layer 0
    assert later["stored_layers"] == [1] and later["start_head"] == distinctive_head(expected["attention"][1])
    for name in ("attention", "norm", "rollout"):
        maps = expected[name][1:] if name != "rollout" else expected[name][1:, 0, None]
        assert np.abs(stored(later, name, "weights").astype(int) - quantised(maps)).max() <= 1, name
    assert attention_view(text, model=tiny_bert).payload()["stored_layers"] == [0, 1]  # the default budget: every layer here
    with pytest.raises(BertologyError, match="has layers 0 to 1"):
        attention_view(text, model=tiny_bert, layers=[2])


LONG_TEXT = " ".join(["the cat sat on the mat. where is the dog? the quick brown fox jumps over the lazy dog."] * 400)


def eager_maps(model_dir, text: str, max_length: int):
    """transformers' own eager attention on ``text`` (cut to ``max_length`` pieces): its tokens and maps ``[layers, heads, n, n]``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.inference_mode():
        attentions = model(ids, output_attentions=True).attentions
    return tokenizer.convert_ids_to_tokens(ids[0]), torch.stack(attentions)[:, 0].double().numpy()


def max_pooled(maps: np.ndarray, size: int) -> np.ndarray:
    """``maps [..., n, n]`` max-pooled into ``size`` x ``size`` cells, token i in cell ``floor(i / (n / size))``."""
    n = maps.shape[-1]
    cells = np.floor(np.arange(n) / (n / size)).astype(int)
    by_key = np.stack([maps[..., cells == c].max(-1) for c in range(size)], -1)
    return np.stack([by_key[..., cells == r, :].max(-2) for r in range(size)], -2)


def assert_page_holds(data: dict, view: str, maps: np.ndarray) -> None:
    """The page's maps of ``view`` are ``maps [layers, heads, n, n]`` quantised to a byte (one step apart at most, a float
    rounding at a step's edge): every weight where dense; else each row's k largest, at their keys, and the mass left
    out; the thumbnails, every weight max-pooled."""
    stored_weights = stored(data, view, "weights").astype(int)
    if data["views"][view]["format"] == "dense":
        assert np.abs(stored_weights - quantised(maps)).max() <= 1
    else:
        k = data["views"][view]["k"]
        indices = stored(data, view, "indices", "<u2").astype(int)
        kept = np.take_along_axis(maps, indices, -1)
        assert np.abs(stored_weights - quantised(kept)).max() <= 1
        assert (kept.min(-1) >= np.sort(maps, -1)[..., -k] - 1e-6).all()  # each row's k largest
        assert np.abs(stored(data, view, "rest").astype(int) - quantised(maps.sum(-1) - kept.sum(-1))).max() <= 1
        if not data["sees_later_keys"]:  # a decoder's: never a weight on a key after the query
            assert (stored_weights[indices > np.arange(data["n"])[:, None]] == 0).all()
    assert np.abs(stored(data, view, "overview").astype(int) - quantised(max_pooled(maps, data["overview_size"]))).max() <= 1


@pytest.mark.parametrize("block_bytes", [viewer.VIEW_BLOCK_BYTES, 1], ids=["whole-layers", "a-row-at-a-time"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("length", [40, 300])
def test_a_decoders_page_holds_transformers_eager_maps(tiny_decoder_dirs, kind, length, block_bytes):
    """At 40 tokens every weight, at 300 each row's 20 largest: equal to transformers' eager attention (Llama: grouped-query
    heads, BOS first), and the rollout to Abnar & Zuidema's of those maps; computed whole, or a query row at a time (each
    thumbnail cell then pooled over several blocks)."""
    import torch

    from bertology.core.model.models import load_model
    from bertology.families.rollout.analyzer import rollout

    data = attention_view(LONG_TEXT, model=load_model(tiny_decoder_dirs[kind], device="cpu"), max_length=length, block_bytes=block_bytes).payload()
    tokens, eager = eager_maps(tiny_decoder_dirs[kind], LONG_TEXT, length)
    assert data["start_head"] == distinctive_head(eager[0])
    assert data["tokens"] == tokens and data["n"] == length and data["kind"] == "decoder" and not data["sees_later_keys"]
    assert data["views"]["attention"]["format"] == ("dense" if length <= 128 else "topk") and list(data["views"]) == ["attention", "norm", "rollout"]
    assert (tokens[0] == "<s>") == (kind == "llama")
    assert_page_holds(data, "attention", eager)
    assert_page_holds(data, "rollout", rollout(torch.from_numpy(eager)[:, None]).numpy())


def test_kept_keys_keep_the_maps_within_the_budget():
    size = viewer.OVERVIEW_SIZE ** 2
    assert viewer.kept_keys(100, 18) == 0 and viewer.kept_keys(2048, 18) == 20  # a tiny model: every key, or the top 20
    for n, maps in [(2048, 12 * 12 * 2 + 12), (2048, 24 * 16 * 2 + 24), (512, 32 * 32 * 2 + 32), (4096, 300), (128, 32 * 32 * 2 + 32)]:
        k = viewer.kept_keys(n, maps)  # GPT-2 and GPT-2 medium at 2,048 tokens, a 32 x 32-head model at 512 and at 128: fewer keys
        assert 1 <= k <= 20 and maps * (n * (3 * k + 1) + size) <= viewer.MAP_BYTES, (n, maps)
    assert viewer.kept_keys(2048, 18, top_k=0) == 0 and viewer.kept_keys(2048, 18, top_k=50) == 50  # as asked


def test_a_smaller_budget_keeps_fewer_keys_and_the_page_within_it(monkeypatch, tiny_gpt2_dir, tmp_path):
    """The page's maps stay within 4/3 MAP_BYTES (base64); the rest of a 2,048-token page (tokens, text, code) is small."""
    from bertology.core.model.models import load_model

    monkeypatch.setattr(viewer, "MAP_BYTES", 2**20)
    loaded = load_model(tiny_gpt2_dir, device="cpu")
    view = attention_view(LONG_TEXT, model=loaded, max_length=2048)
    assert view.truncated and LONG_TEXT.startswith(view.text) and len(view.text) < len(LONG_TEXT) / 10  # the page holds the text its tokens cover
    assert loaded.tokenizer.convert_ids_to_tokens(loaded.tokenizer(view.text)["input_ids"]) == view.tokens
    maps = 2 * (4 + 4 + 1)  # layers x (heads of the weights and of the norm shares, one rollout map)
    assert view.kept == ((2**20 - maps * 72 * 72) // (maps * 2048) - 1) // 3 == 8
    page = view.save(tmp_path / "2048.html").read_text()
    map_chars = sum(len(stored_view[key]) for stored_view in view.payload()["views"].values() for key in ("weights", "indices", "rest", "overview"))
    assert map_chars <= 4 / 3 * 2**20 + 16 and len(page) - map_chars < 128 * 1024


def test_the_norm_view_only_where_the_models_layout_is_known(monkeypatch, tiny_gpt2_dir):
    from bertology.core.model.layouts import LAYOUTS
    from bertology.core.model.models import load_model

    monkeypatch.delitem(LAYOUTS, "gpt2")
    assert list(attention_view("the cat sat.", model=load_model(tiny_gpt2_dir, device="cpu")).payload()["views"]) == ["attention", "rollout"]


def test_markup_in_text_and_tokens_never_reaches_the_page_raw():
    view = hand_made_view()
    view.text = INJECTION
    view.tokens[1] = "</script><script>alert(2)</script>"
    page = view.html()
    assert "<script>alert" not in page and "<img" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the header shows it as text
    data = json.loads(re.search(r'<script type="application/json" id="bertology-data">(.*?)</script>', page, re.S).group(1))
    assert data["tokens"][1] == "</script><script>alert(2)</script>" and data["text"] == INJECTION


def test_head_labels_come_from_roles_and_patterns(tmp_path):
    (tmp_path / "roles.csv").write_text("layer,head,role,has_role\n0,1,local,True\n0,1,cls,False\n1,0,cls,True\n")
    (tmp_path / "patterns.csv").write_text("layer,head,pattern,share,n,majority\n0,1,vertical,0.2,9,diagonal\n0,1,diagonal,0.7,9,diagonal\n")
    assert head_labels(tmp_path) == {"0-1": ["local", "diagonal"], "1-0": ["cls"]}


def test_the_page_opens_on_the_head_furthest_from_its_layers_mean_map():
    """The start head: the mean over query rows of the Jensen-Shannon divergence (scipy's distance, squared) between the
    head's row and the layer's mean row, largest; here a planted diagonal head among near-uniform ones."""
    rng = np.random.default_rng(0)
    maps = rng.dirichlet(np.full(7, 20.0), size=(12, 7))
    maps[5] = 0.9 * np.eye(7) + 0.1 / 7
    mean = maps.mean(axis=0)
    by_scipy = [np.mean([jensenshannon(maps[h, i], mean[i]) ** 2 for i in range(7)]) for h in range(12)]
    assert distinctive_head(maps) == int(np.argmax(by_scipy)) == 5
    for seed in range(5):  # and on maps with zeros, where no head is planted
        maps = rng.dirichlet(np.full(6, 0.2), size=(4, 6)) * (rng.random((4, 6, 6)) > 0.3)
        maps /= np.maximum(maps.sum(-1, keepdims=True), 1e-12)
        mean = maps.mean(axis=0)
        by_scipy = [np.mean([jensenshannon(maps[h, i], mean[i]) ** 2 if maps[h, i].any() else 0 for i in range(6)]) for h in range(4)]
        assert distinctive_head(maps) == int(np.argmax(by_scipy))
    assert hand_made_view().payload()["start_head"] == distinctive_head(hand_made_maps()[0])


def test_labels_have_short_readable_forms_and_a_legend():
    view = hand_made_view()
    view.labels = {"0-1": ["delimiter", "syntactic:nsubj", "vertical+diagonal"], "1-0": ["cls", "syntactic", "syntactic:nsubj", "syntactic:obj", "mine"]}
    data = view.payload()
    assert data["label_chips"] == {
        "0-1": [("delim", "delimiter"), ("syn:nsubj", "syntactic:nsubj"), ("vert+diag", "vertical+diagonal")],
        "1-0": [("cls", "cls"), ("syn", "syntactic"), ("syn: 2 relations", "syntactic: nsubj, obj"), ("mine", "mine")],  # the relations as one
    }
    assert data["label_legend"] == {"delim": "delimiter", "syn": "syntactic", "vert+diag": "vertical+diagonal"}


def test_notebook_display_is_the_page_in_an_iframe():
    frame = hand_made_view()._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and "&lt;canvas" in frame and "<canvas" not in frame


# ---- the page in a real browser ----

def open_page(browser, path, viewer=True):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    problems = []
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.on("dialog", lambda dialog: (problems.append(f"dialog: {dialog.message}"), dialog.dismiss()))
    started = time.perf_counter()
    page.goto(path.as_uri())
    if viewer:
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    return page, problems, time.perf_counter() - started


@pytest.fixture(scope="module")
def pair_page(tiny_bert, tmp_path_factory):
    path = tmp_path_factory.mktemp("viewer") / "view.html"
    attention_view("the cat sat on the mat.", "where is the dog?", model=tiny_bert).save(path)
    return path


def test_page_loads_without_console_errors_and_draws(browser, pair_page):
    page, problems, _ = open_page(browser, pair_page)
    assert problems == []
    assert page.evaluate("window.bertologyViewer.linesDrawn") > 0
    assert page.locator(".thumb").count() == 2 * 4
    page.close()


def test_the_page_opens_on_one_head_the_most_distinctive_of_layer_0(browser, pair_page):
    page, problems, _ = open_page(browser, pair_page)
    data = json.loads(page.inner_text("#bertology-data"))
    start = data["start_head"]
    weights = np.frombuffer(base64.b64decode(data["views"]["attention"]["weights"]), dtype=np.uint8).reshape(2, 4, data["n"], data["n"])
    assert start == distinctive_head(weights[0] / weights[0].sum(-1, keepdims=True))  # the same head from what the page holds
    assert page.inner_text("#head-title") == f"Head view: layer 0, head {start}"
    assert page.evaluate("Array.from(window.bertologyViewer.state.heads)") == [start]
    assert page.eval_on_selector_all("#head-boxes input", "inputs => inputs.filter(i => i.checked).map(i => Number(i.dataset.head))") == [start]
    assert f"Opened on head {start} of layer 0" in page.inner_text("#start-hint")
    page.click(f"#head-boxes input[data-head='{(start + 1) % 4}']")  # another head is a click away
    assert page.inner_text("#head-title") == "Head view: layer 0 (2 heads)" and problems == []
    page.close()


def test_switching_to_norm_shares_and_rollout_redraws(browser, pair_page):
    page, problems, _ = open_page(browser, pair_page)
    assert page.eval_on_selector_all("#view option", "options => options.map(o => o.value)") == ["attention", "norm", "rollout"]
    thumb = page.locator(".thumb[data-layer='1'][data-head='0'] canvas")
    page.evaluate("document.querySelectorAll('#head-boxes input').forEach(i => { if (!i.checked) i.click(); })")  # every head of the layer
    weights_lines, weights_pixels = page.evaluate("window.bertologyViewer.linesDrawn"), thumb.screenshot()
    page.select_option("#view", "norm")
    assert page.evaluate("window.bertologyViewer.state.view") == "norm" and thumb.screenshot() != weights_pixels
    page.select_option("#view", "rollout")
    rollout_lines = page.evaluate("window.bertologyViewer.linesDrawn")
    assert 0 < rollout_lines < weights_lines  # one rolled-out map per layer, not one per head
    assert page.locator(".thumb.shared").count() == 2 * 3  # heads 1-3 of each layer have no map of their own
    page.select_option("#view", "attention")
    assert page.evaluate("window.bertologyViewer.linesDrawn") == weights_lines and page.locator(".thumb.shared").count() == 0
    assert problems == []
    page.close()


def test_a_layer_past_the_budget_names_the_command_that_draws_it(browser, tiny_bert, tmp_path):
    path = tmp_path / "view.html"
    attention_view("the cat sat on the mat.", model=tiny_bert, budget=1).save(path)  # the first layer only
    page, problems, _ = open_page(browser, path)
    assert page.locator(".thumb").count() == 4 and page.locator(".thumb[data-layer='1']").count() == 0
    assert page.evaluate("window.bertologyViewer.linesDrawn") > 0 and page.is_hidden("#missing-layer")
    assert "Layers 0 of 2 are on this page" in page.inner_text("#missing-layers")
    page.select_option("#layer", "1")
    assert page.evaluate("window.bertologyViewer.linesDrawn") == 0
    assert page.is_visible("#missing-layer") and "--layers 1" in page.inner_text("#missing-layer")
    page.select_option("#layer", "0")
    assert page.evaluate("window.bertologyViewer.linesDrawn") > 0 and page.is_hidden("#missing-layer") and problems == []
    page.close()


def test_clicking_a_thumbnail_opens_that_head(browser, pair_page):
    page, problems, _ = open_page(browser, pair_page)
    page.click(".thumb[data-layer='1'][data-head='2']")
    assert page.inner_text("#head-title") == "Head view: layer 1, head 2"
    assert page.evaluate("[window.bertologyViewer.state.layer, Array.from(window.bertologyViewer.state.heads)]") == [1, [2]]
    assert page.input_value("#layer") == "1"
    assert page.evaluate("location.hash") == "#layer=1&head=2"
    assert page.locator(".thumb.selected").count() == 1 and problems == []
    page.close()


def test_a_link_to_a_head_opens_it(browser, pair_page):
    page = browser.new_page()
    page.goto(pair_page.as_uri() + "#layer=0&head=3")
    page.wait_for_selector("body[data-ready='1']")
    assert page.inner_text("#head-title") == "Head view: layer 0, head 3"
    page.close()


def test_hovering_a_token_changes_what_is_drawn(browser, pair_page):
    page, problems, _ = open_page(browser, pair_page)
    canvas = page.locator("#head-canvas")
    before_lines, before_pixels = page.evaluate("window.bertologyViewer.linesDrawn"), canvas.screenshot()
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + 100, box["y"] + 8 + 2 * 16 + 8)  # the third token on the left
    assert page.evaluate("window.bertologyViewer.state.hover") == {"side": "query", "index": 2}
    hovered_lines = page.evaluate("window.bertologyViewer.linesDrawn")
    assert 0 < hovered_lines < before_lines
    assert canvas.screenshot() != before_pixels
    page.mouse.move(box["x"] + box["width"] - 60, box["y"] + 8 + 16 + 8)  # the second token on the right
    assert page.evaluate("window.bertologyViewer.state.hover") == {"side": "key", "index": 1}
    page.select_option("#query-filter", "1")  # only sentence B attends
    assert page.evaluate("window.bertologyViewer.linesDrawn") < hovered_lines + before_lines
    assert problems == []
    page.close()


def test_injected_markup_stays_text_in_the_browser(browser, tiny_bert, tmp_path):
    path = attention_view(INJECTION, INJECTION, model=tiny_bert).save(tmp_path / "evil.html")
    page, problems, _ = open_page(browser, path)
    assert problems == []  # no alert dialog, no error
    assert page.locator("img").count() == 0
    assert page.locator("script").count() == 2  # the data and the viewer's own
    assert page.inner_text("#text") == INJECTION and page.inner_text("#text-pair") == INJECTION
    page.close()


def test_a_512_token_page_renders(browser, minilm, tmp_path):
    text = " ".join(["the quick brown fox jumps over the lazy dog ."] * 60)
    path = attention_view(text, model=minilm).save(tmp_path / "long.html")
    page, problems, seconds = open_page(browser, path)
    n = page.evaluate("window.bertologyViewer.state && JSON.parse(document.getElementById('bertology-data').textContent).n")
    assert n == 512 and problems == []
    page.click(".thumb[data-layer='3'][data-head='7']")
    page.wait_for_function("!window.bertologyViewer.drawing")
    draw_ms = page.evaluate("window.bertologyViewer.renderMs")
    page.evaluate("document.querySelectorAll('#head-boxes input').forEach(i => { if (!i.checked) i.click(); })")
    switches = []
    for layer in ("4", "5", "1", "2"):  # every head of the layer drawn
        page.evaluate("window.bertologyViewer.switchMs = undefined")
        page.select_option("#layer", layer)
        page.wait_for_function("window.bertologyViewer.switchMs !== undefined && !window.bertologyViewer.drawing")
        switches.append((page.evaluate("window.bertologyViewer.switchMs"), page.evaluate("window.bertologyViewer.renderMs"),
                         page.evaluate("window.bertologyViewer.linesDrawn")))
        assert switches[-1][2] > 1000  # a full layer of 12 heads, not a thinned one
    print(f"\n512-token page: {path.stat().st_size / 1e6:.2f} MB, loaded and drawn in {seconds:.2f} s, head redraw {draw_ms:.0f} ms; "
          f"layer switch with 12 heads: next frame after {np.median([s[0] for s in switches]):.0f} ms (median of 4; worst "
          f"{max(s[0] for s in switches):.0f} ms), every line drawn after {np.median([s[1] for s in switches]):.0f} ms")
    page.evaluate("document.getElementById('head-scroll').scrollTop = 4000")  # the list scrolls; what is drawn follows
    page.wait_for_function("!window.bertologyViewer.drawing")
    assert page.evaluate("window.bertologyViewer.linesDrawn") > 0 and problems == []
    page.close()


def test_long_labels_are_never_cut_with_the_whole_text_on_hover_and_the_axes_are_named(browser, tmp_path):
    view = hand_made_view(n=6)
    view.tokens[2] = "averyveryveryverylongtokenthatwouldoverflowitscolumn"
    view.labels = {"0-1": ["delimiter", "syntactic:nsubj", "syntactic:obj", "vertical+diagonal"], "1-0": ["syntactic:compound:prt", "local"]}
    page, problems, _ = open_page(browser, view.save(tmp_path / "long-labels.html"))
    assert page.inner_text("#query-axis").startswith("query") and page.inner_text("#key-axis").endswith("key: the token attended to")
    canvas = page.locator("#head-canvas")
    box = canvas.bounding_box()
    page.mouse.move(box["x"] + 100, box["y"] + 8 + 2 * 16 + 8)  # the long token, on the left
    assert page.evaluate("document.getElementById('head-canvas').title") == view.tokens[2]
    cell = page.locator(".thumb[data-layer='0'][data-head='1'] .labels")
    assert cell.get_attribute("title") == "delimiter, syntactic:nsubj, syntactic:obj, vertical+diagonal"
    chips = cell.locator("span")
    assert [text.replace("\u200b", "") for text in chips.all_inner_texts()] == ["delim", "syn: 2 relations", "vert+diag"]
    assert [chips.nth(k).get_attribute("title") for k in range(3)] == ["delimiter", "syntactic: nsubj, obj", "vertical+diagonal"]
    for labels in page.locator(".thumb .labels span").all():  # each short form whole, inside its cell (wrapped, never cut)
        assert labels.evaluate("e => e.scrollWidth <= e.clientWidth + 0.5 && getComputedStyle(e.parentElement).textOverflow !== 'ellipsis'")
        assert labels.bounding_box()["width"] <= 80.5
    assert cell.bounding_box()["width"] <= 80.5
    assert page.inner_text("#label-legend") == ("Labels (hover a cell for them in full): loc = local, delim = delimiter, syn = syntactic, "
                                                 "vert+diag = vertical+diagonal.")
    assert problems == []
    page.close()


def relative_luminance(rgb):
    channels = [c / 255 for c in rgb]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def test_head_chips_have_text_contrast_of_at_least_4_5(browser, minilm, tmp_path):
    """WCAG AA: (L_light + 0.05) / (L_dark + 0.05) >= 4.5 between each chip's text and its background, as the browser computes them."""
    page, problems, _ = open_page(browser, attention_view("the cat sat.", model=minilm).save(tmp_path / "chips.html"))
    colours = page.eval_on_selector_all("#head-boxes label.head", "labels => labels.map(l => [getComputedStyle(l).color, getComputedStyle(l).backgroundColor])")
    assert len(colours) == 12
    for text, background in colours:
        rgb = [[int(v) for v in re.findall(r"\d+", colour)[:3]] for colour in (text, background)]
        light, dark = sorted((relative_luminance(c) for c in rgb), reverse=True)
        assert (light + 0.05) / (dark + 0.05) >= 4.5, (text, background)
    assert problems == []
    page.close()


def test_the_report_links_each_head_to_the_viewer(browser, tiny_bert, tmp_path):
    from bertology.api import analyze

    analyze(tiny_bert, ["the cat sat on the mat.", "where is the dog?"], out=tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "viewer.html").is_file()
    page, problems, _ = open_page(browser, tmp_path / "run" / "report.html", viewer=False)
    page.click("a[href='viewer.html#layer=1&head=2']")
    page.wait_for_selector("body[data-ready='1']")
    assert page.inner_text("#head-title") == "Head view: layer 1, head 2"
    assert page.locator(".thumb .labels").first.inner_text() != "" or page.locator("#label-filter option").count() > 1
    assert problems == []
    page.close()


THUMBNAIL_PIXELS = "(selector) => Array.from(document.querySelector(selector).getContext('2d').getImageData(0, 0, 72, 72).data)"


def test_a_decoders_page_greys_what_its_queries_cannot_see_and_has_no_sentence_filters(browser, tiny_gpt2_dir, tmp_path):
    """100 tokens: each thumbnail pixel is the largest weight of its 72 x 72 block, drawn as before (255 - round(255 sqrt w), on
    blue), except the blocks after the diagonal, grey: not visible to their queries, not zero attention. No [SEP], no
    sentence A/B filter (one text)."""
    from bertology.core.model.models import load_model

    path = attention_view(LONG_TEXT, model=load_model(tiny_gpt2_dir, device="cpu"), max_length=100).save(tmp_path / "decoder.html")
    page, problems, _ = open_page(browser, path)
    data = json.loads(page.inner_text("#bertology-data"))
    pixels = np.array(page.evaluate(THUMBNAIL_PIXELS, ".thumb[data-layer='1'][data-head='2'] canvas")).reshape(72, 72, 4)
    level = 255 - np.round(255 * np.sqrt(max_pooled(stored(data, "attention", "weights")[1, 2], 72) / 255))
    expected = np.stack([level, level, np.full_like(level, 255), np.full_like(level, 255)], -1)
    expected[np.triu_indices(72, 1)] = [222, 222, 222, 255]
    np.testing.assert_array_equal(pixels, expected)
    assert page.locator("#query-filter, #key-filter").count() == 0 and "[SEP]" not in path.read_text() and "sentence B" not in path.read_text()
    assert "attends only to itself and the tokens before it" in page.inner_text("#causal-note") and page.locator("#hidden-legend").count() == 1
    assert problems == []
    page.close()


def test_a_2048_token_decoder_page_opens_and_responds(browser, tiny_gpt2_dir, tmp_path):
    from bertology.core.model.models import load_model

    loaded = load_model(tiny_gpt2_dir, device="cpu")
    started = time.perf_counter()
    path = attention_view(LONG_TEXT, model=loaded, max_length=2048).save(tmp_path / "2048.html")
    built = time.perf_counter() - started
    page, problems, seconds = open_page(browser, path)
    data = json.loads(page.inner_text("#bertology-data"))
    assert data["n"] == 2048 and data["views"]["attention"]["k"] == 20 and problems == []
    assert path.stat().st_size <= 4 / 3 * 2 * 9 * (2048 * (3 * 20 + 1) + 72 * 72) + 128 * 1024  # linear in n: 18 maps of 2,048 rows of 20 keys
    page.click(".thumb[data-layer='1'][data-head='2']")
    page.wait_for_function("!window.bertologyViewer.drawing")
    page.evaluate("window.bertologyViewer.switchMs = undefined")
    page.select_option("#layer", "0")
    page.wait_for_function("window.bertologyViewer.switchMs !== undefined && !window.bertologyViewer.drawing")
    switch_ms = page.evaluate("window.bertologyViewer.switchMs")
    assert page.evaluate("window.bertologyViewer.linesDrawn") > 0
    page.evaluate("window.bertologyViewer.linesDrawn = -1; document.getElementById('head-scroll').scrollTop = 16 * 1500")  # far down the list
    page.wait_for_function("window.bertologyViewer.linesDrawn >= 0 && !window.bertologyViewer.drawing")  # redrawn for the rows in sight
    box = page.locator("#head-canvas").bounding_box()
    page.mouse.move(box["x"] + 100, box["y"] + 8 + 3 * 16 + 8)
    hover = page.evaluate("window.bertologyViewer.state.hover")
    assert hover["side"] == "query" and hover["index"] > 1500
    row = hover["index"]
    keys, weights = stored(data, "attention", "indices", "<u2")[0, 2, row, :3], stored(data, "attention", "weights")[0, 2, row, :3]
    strongest = ", ".join(f'{key} {json.dumps(data["tokens"][key])} {100 * weight / 255:.1f}%' for key, weight in zip(keys, weights) if weight)
    left_out = round(100 * int(stored(data, "attention", "rest")[0, 2, row]) / 255)
    assert page.inner_text("#row-note").splitlines() == [
        f'Token {row} {json.dumps(data["tokens"][row])}: its strongest keys; the share of its row beyond its 20 largest weights',
        f"head 2: {strongest or 'every weight under 0.2%'}; left out {left_out}%"]
    assert problems == []
    print(f"\n2,048-token tiny GPT-2 page: {path.stat().st_size / 1e6:.2f} MB, built in {built:.2f} s, opened in {seconds:.2f} s, "
          f"layer switch: next frame after {switch_ms:.0f} ms")
    page.close()


def test_the_view_menu_has_the_contribution_views_when_asked(tiny_bert_dir):
    # ALTI and value zeroing per head join the menu (analyze adds them when its run has those views); each stored map is the
    # engine's per-head map to the page's byte
    from conftest import float64_model

    from bertology.core.engine import Engine, PassNeeds, RunStats
    from bertology.core.text.corpora import Example
    from bertology.studies.view.viewer import attention_view

    loaded = float64_model(tiny_bert_dir)
    text = "the cat sat on the mat."
    view = attention_view(text, model=loaded, contributions=("alti", "value-zeroing"))
    assert list(view.maps) == ["attention", "norm", "alti", "value-zeroing", "rollout"]
    engine = Engine(loaded, batch_size=1, progress=False)
    batch = engine.run_batch(list(engine.encode(enumerate([Example(text)]), RunStats())), PassNeeds(views=("alti", "value-zeroing")))
    for name in ("alti", "value-zeroing"):
        for layer in range(loaded.num_layers):
            expected = np.round(batch.view_maps[name][layer, 0].numpy() * 255)
            assert np.abs(view.maps[name].weights[layer].astype(float) - expected).max() <= 1
    assert "value zeroing per head (Mohebbi et al. 2023)" in view.html()


def test_view_puts_the_contribution_views_of_a_decoder_in_its_menu_from_the_command_line(tiny_gpt2_dir, tmp_path):
    from test_cli import bertology

    page = tmp_path / "view.html"
    result = bertology("view", "the cat sat on the mat.", "--model", tiny_gpt2_dir, "--contributions", "alti,value-zeroing", "--out", page, "--device", "cpu")
    assert result.returncode == 0, result.stderr
    html = page.read_text()
    assert "ALTI per head (Ferrando et al. 2022)" in html and "value zeroing per head (Mohebbi et al. 2023)" in html
    refused = bertology("view", "the cat.", "--model", tiny_gpt2_dir, "--contributions", "norm", "--out", tmp_path / "other.html", "--device", "cpu")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == ["error: unknown contribution measure 'norm': use alti, value-zeroing or both"]
    assert not (tmp_path / "other.html").exists()


def test_view_refuses_a_sentence_pair_on_a_decoder_in_one_line_naming_the_option_and_the_kind(tiny_gpt2_dir, tmp_path):
    from typer.testing import CliRunner

    from bertology.cli import app
    from bertology.core.errors import BertologyError

    page = tmp_path / "view.html"
    result = CliRunner().invoke(app, ["view", "the cat sat.", "--pair", "it was tired.", "--model", str(tiny_gpt2_dir), "--out", str(page),
                                      "--device", "cpu"])
    assert isinstance(result.exception, BertologyError)
    message = str(result.exception)
    assert "\n" not in message and message.startswith("--pair does not apply to ") and ", a decoder: it has no sentence-pair structure" in message
    assert not page.exists()
