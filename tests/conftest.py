"""Shared fixtures: tiny random models with tokenizers built here, and the shared data folder.

Nothing is downloaded: the hub is switched off for the whole test session.
"""

from __future__ import annotations

import json
import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    RobertaConfig,
    RobertaModel,
    RobertaTokenizerFast,
)

from bertology.core.model.models import load_model  # noqa: E402
from bertology.core.text.corpora import Example  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

WORDS = (
    "the a cat dog sat on mat is where it here under table ran fast slowly big small red house tree "
    "we you they saw what why how do does not can will and but or of to in at with from by this that "
    "un ##believ ##ably token ##ization split ##s word walk ##ed run ##ning"
).split()
TEXTS = [
    "the cat sat on the mat.",
    "where is the dog?",
    "the big red house is under the tree, and the cat ran fast.",
    "unbelievably, tokenization splits words!",
    "we saw it.",
    "they walked slowly to the house; the dog was running.",
    "why does the small cat not sit here?",
    "a dog, a cat and a tree.",
]
PAIRS = [("the cat sat.", "the dog ran."), ("where is it?", "it is under the table.")]


def gold_example(line: int, text: str, tags: str | None = None) -> Example:
    """An example with gold words (the text split at spaces), a flat tree (every word a dependent of the first) and
    UPOS tags (``tags``, space-separated; default X), as a CoNLL-U reader would give it."""
    words, spans, begin = text.split(), [], 0
    for word in words:
        begin = text.index(word, begin)
        spans.append((begin, begin + len(word)))
        begin += len(word)
    return Example(text=text, source=f"gold:{line}", words=tuple(words), word_spans=tuple(spans), heads=(0,) + (1,) * (len(words) - 1),
                   relations=("root",) + ("dep",) * (len(words) - 1), upos=tuple(tags.split()) if tags else ("X",) * len(words))


def tiny_examples() -> list[Example]:
    return [Example(text) for text in TEXTS] + [Example(a, b) for a, b in PAIRS]


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A 2-layer, 4-head random BERT with a small WordPiece vocabulary, saved as a model folder."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "?", "!", ";", "'"] + WORDS
    tokenizer = BertTokenizerFast(vocab={piece: i for i, piece in enumerate(vocab)}, do_lower_case=True)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64
    )
    BertModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_roberta_dir(tmp_path_factory) -> Path:
    """A 2-layer random RoBERTa with a byte-level BPE tokenizer trained here ("Ġ" pieces, <s>/</s>)."""
    folder = tmp_path_factory.mktemp("tiny-roberta")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TEXTS * 5, trainer)
    bpe.post_processor = processors.RobertaProcessing(("</s>", bpe.token_to_id("</s>")), ("<s>", bpe.token_to_id("<s>")), trim_offsets=True)
    tokenizer = RobertaTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", pad_token="<pad>",
                                     unk_token="<unk>", mask_token="<mask>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = RobertaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=66, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    RobertaModel(config).save_pretrained(folder)
    return folder


def byte_level_bpe(bos: str | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer trained here on the test texts ("Ġ" pieces); with ``bos``, it puts that token first (Llama's way)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TEXTS * 5, trainer)
    if bos is not None:
        bpe.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, bpe.token_to_id(bos))])
    else:
        bpe.post_processor = processors.ByteLevel(trim_offsets=True)
    return bpe


#: The tiny decoders of the tests: GPT-2 (no BOS added, learned positions, Conv1D projections), Llama (BOS added, rotary
#: positions, RMSNorm, grouped-query attention), Qwen2 (grouped-query, biased q/k/v) and GPT-NeoX (parallel residual).
DECODER_KINDS = ("gpt2", "llama", "qwen2", "gpt_neox")


def save_tiny_decoder(kind: str, folder: Path, layers: int = 2, heads: int = 4, hidden: int = 32) -> Path:
    """A random ``kind`` causal LM (:data:`DECODER_KINDS`) with a byte-level BPE tokenizer, saved as a model folder."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    bos = "<s>" if kind == "llama" else None
    bpe = byte_level_bpe(bos)
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    if kind != "llama":
        special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **special)
    tokenizer.save_pretrained(folder)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "vocab_size": len(tokenizer)}
    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_head=heads, n_embd=hidden, n_positions=4096, **ids))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2, hidden_size=hidden,
                                             intermediate_size=2 * hidden, max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id, **ids))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2, hidden_size=hidden,
                                             intermediate_size=2 * hidden, max_position_embeddings=4096, **ids))
    else:
        model = GPTNeoXForCausalLM(GPTNeoXConfig(num_hidden_layers=layers, num_attention_heads=heads, hidden_size=hidden, intermediate_size=2 * hidden,
                                                 max_position_embeddings=4096, **ids))
    model.save_pretrained(folder)
    return folder


def tiny_decoder_configs() -> dict:
    """Tiny configurations (2 layers, 4 heads, hidden 32, 100 pieces) of every decoder layout bertology serves, as
    ``AutoModelForCausalLM.from_config`` takes them: grouped-query attention, sliding windows, soft caps, parallel residuals
    (GPT-NeoX, Phi, StableLM), norms after each branch (Gemma 2, OLMo 2), Granite's multipliers, OPT's post-norm variant (OPT-350m),
    StableLM's partial rotary embeddings and per-head query and key norms."""
    import transformers as T

    small = dict(vocab_size=100)
    llama_like = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, intermediate_size=64, **small)
    opt = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64, **small)
    return {
        "gpt2": T.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, **small),
        "llama": T.LlamaConfig(**llama_like),
        "qwen2": T.Qwen2Config(**llama_like),
        "gpt_neox": T.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64, **small),
        "gpt_neox_sequential": T.GPTNeoXConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
                                               use_parallel_residual=False, **small),
        "opt": T.OPTConfig(**opt),
        "opt_post_norm": T.OPTConfig(do_layer_norm_before=False, **opt),
        "mistral": T.MistralConfig(sliding_window=4, **llama_like),
        "qwen3": T.Qwen3Config(head_dim=8, **llama_like),
        "gemma": T.GemmaConfig(**{**llama_like, "num_key_value_heads": 1}, head_dim=8),
        "gemma2": T.Gemma2Config(head_dim=8, sliding_window=4, **llama_like),
        "olmo": T.OlmoConfig(**llama_like),
        "olmo2": T.Olmo2Config(**llama_like),
        "granite": T.GraniteConfig(residual_multiplier=0.5, attention_multiplier=0.3, **llama_like),
        "phi": T.PhiConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64, **small),
        "phi3": T.Phi3Config(pad_token_id=0, **llama_like),
        "stablelm": T.StableLmConfig(**llama_like),
        "stablelm_parallel": T.StableLmConfig(use_parallel_residual=True, qk_layernorm=True, use_qkv_bias=True, **llama_like),
    }


def tiny_encoder_configs(vocab_size: int = 100) -> dict:
    """Tiny configurations (hidden 32, 4 heads, 64 positions) of every encoder layout bertology serves, as ``AutoModel.from_config``
    takes them: BERT, RoBERTa (two positions reserved), DistilBERT, ALBERT (one shared layer run three times) and ELECTRA
    (embeddings narrower than the layers)."""
    import transformers as T

    size = dict(vocab_size=vocab_size, max_position_embeddings=64)
    layers = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return {
        "bert": T.BertConfig(**layers, **size),
        "roberta": T.RobertaConfig(**layers, **{**size, "max_position_embeddings": 66}),
        "distilbert": T.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, **size),
        "albert": T.AlbertConfig(embedding_size=16, **{**layers, "num_hidden_layers": 3}, **size),
        "electra": T.ElectraConfig(embedding_size=16, **layers, **size),
    }


@pytest.fixture(scope="session")
def tiny_decoder_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every kind of :data:`DECODER_KINDS`, saved (2 layers, 4 heads; Llama and Qwen2 with 2 key-value heads)."""
    return {kind: save_tiny_decoder(kind, tmp_path_factory.mktemp(f"tiny-{kind}")) for kind in DECODER_KINDS}


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tiny_decoder_dirs) -> Path:
    return tiny_decoder_dirs["gpt2"]


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_decoder_dirs) -> Path:
    return tiny_decoder_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_bert(tiny_bert_dir):
    return load_model(tiny_bert_dir, device="cpu")


@pytest.fixture(scope="session")
def tiny_roberta(tiny_roberta_dir):
    return load_model(tiny_roberta_dir, device="cpu")


@pytest.fixture(scope="session")
def minilm():
    """The bundled default model (all-MiniLM-L6-v2 from the installed package)."""
    return load_model(None, device="cpu")


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not beside this checkout")
    return SHARED_DATA


CLASSIFIER_SENTENCES = ["the cat sat.", "the dog ran.", "a cat and a dog.", "where is the dog?", "we saw the cat.", "the big red house.",
                        "the small tree.", "they ran fast.", "you saw a cat here.", "the dog is under the table.", "it is here.", "we ran slowly."]


@pytest.fixture(scope="session")
def tiny_classifier_dir(tiny_bert_dir, tmp_path_factory) -> Path:
    """A 3-layer, 4-head random BERT sequence classifier (labels "0", "1") with the tiny tokenizer."""
    from transformers import BertForSequenceClassification, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-classifier")
    tokenizer = BertTokenizerFast.from_pretrained(tiny_bert_dir)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(1)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64, num_labels=2, id2label={0: "0", 1: "1"}, label2id={"0": 0, "1": 1})
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture
def cat_task(tmp_path) -> Path:
    """An SST-2-shaped task folder: label 1 when the sentence mentions a cat."""
    folder = tmp_path / "SST-2"
    folder.mkdir()
    rows = [f"{s}\t{int('cat' in s)}" for s in CLASSIFIER_SENTENCES]
    (folder / "train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    (folder / "dev.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    return folder


def randomise_biases_and_norms(model):
    """Every bias and every norm's weight drawn from N(0, 0.3) (the torch seed set by the caller), so that every term of a
    formula counts: a freshly built model has zero biases and unit norm weights, which hide a bias or a norm that is wrong."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            module = name.rsplit(".", 2)[-2] if "." in name else ""
            if name.endswith("bias") or (name.endswith("weight") and ("norm" in module.lower() or module.startswith("ln_"))):
                parameter.normal_(0, 0.3)
    return model


@pytest.fixture(scope="session")
def tiny_encoder_dirs(tiny_bert_dir, tmp_path_factory) -> dict[str, Path]:
    """A tiny random model folder of every attention-block layout bertology knows (BERT, RoBERTa, DistilBERT, ALBERT with a
    shared layer, ELECTRA), each with the tiny WordPiece tokenizer (RoBERTa's own BPE one); float64 for exact comparisons."""
    from transformers import AlbertModel, DistilBertModel, ElectraModel

    tokenizer = BertTokenizerFast.from_pretrained(tiny_bert_dir)
    configs = tiny_encoder_configs(vocab_size=len(tokenizer))
    folders = {"bert": tiny_bert_dir}
    for name, model_class in {"distilbert": DistilBertModel, "albert": AlbertModel, "electra": ElectraModel}.items():
        folder = tmp_path_factory.mktemp(f"tiny-{name}")
        tokenizer.save_pretrained(folder)
        torch.manual_seed(2)
        model = randomise_biases_and_norms(model_class(configs[name]))
        model.save_pretrained(folder)
        folders[name] = folder
    return folders


# ---- a real headless browser for the pages' tests ----

def _chromium() -> str | None:
    return os.environ.get("BERTOLOGY_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium driven by Playwright (no browser download). CI installs both; elsewhere a missing one skips."""
    binary = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        binary = None
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs chromium and playwright for the browser tests (make test installs them)")
        pytest.skip("no chromium or playwright here")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=binary, args=["--no-sandbox", "--disable-gpu"])
        yield launched
        launched.close()


SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the rabbit"]


VERBS = ["sat on", "looked at", "ran to", "thought about", "walked past"]


OBJECTS = ["the mat", "the house", "a tree", "the river", "her book"]


def write_books(folder, books: int = 2, paragraphs: int = 30, seed: int = 0):
    """Plain-text 'books' of generated sentences, wrapped like Gutenberg text (CRLF, blank lines between paragraphs)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for book in range(books):
        lines = []
        for _ in range(paragraphs):
            sentences = [f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(['.', '!', ', and it rained.'])}"
                         for _ in range(rng.integers(2, 6))]
            text = " ".join(sentences)
            lines += [text[i : i + 60] for i in range(0, len(text), 60)] + [""]
        (folder / f"book{book}.txt").write_bytes("\r\n".join(lines).encode())
    return folder


@pytest.fixture(scope="session")
def tiny_mlm_dir(tiny_bert_dir, tmp_path_factory):
    """A 2-layer, 4-head random BERT with its masked-LM head, and the tiny tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-mlm")
    tokenizer = BertTokenizerFast.from_pretrained(tiny_bert_dir)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(3)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64)
    BertForMaskedLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def treebank(tmp_path_factory):
    """A small CoNLL-U file (trees from spaCy over the test sentences, written as UD would)."""
    from bertology.core.text.corpora import Example
    from bertology.core.text.parsing import spacy_trees

    blocks = []
    for number, example in enumerate(spacy_trees([Example(t) for t in TEXTS * 2]), start=1):
        lines = [f"# sent_id = {number}", f"# text = {example.text}"]
        for i, (word, (a, b), head, relation) in enumerate(zip(example.words, example.word_spans, example.heads, example.relations), start=1):
            space = "_" if b < len(example.text) and example.text[b] == " " or b == len(example.text) else "SpaceAfter=No"
            lines.append(f"{i}\t{word}\t_\t_\t_\t_\t{head}\t{relation}\t_\t{space}")
        blocks.append("\n".join(lines))
    path = tmp_path_factory.mktemp("treebank") / "tiny.conllu"
    path.write_text("\n\n".join(blocks) + "\n\n")
    return path


@pytest.fixture(scope="session")
def tuned_dir(tiny_bert_dir, tmp_path_factory):
    """A classifier whose encoder started from the tiny BERT and then moved (noise on every weight), as fine-tuning does;
    its metrics.json names the tiny BERT as its pre-trained model, as `bertology finetune` writes it."""
    folder = tmp_path_factory.mktemp("tuned")
    torch.manual_seed(5)
    model = BertForSequenceClassification.from_pretrained(tiny_bert_dir, num_labels=2, id2label={0: "0", 1: "1"}, label2id={"0": 0, "1": 1})
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.save_pretrained(folder)
    BertTokenizerFast.from_pretrained(tiny_bert_dir).save_pretrained(folder)
    (folder / "metrics.json").write_text(json.dumps({"model": str(tiny_bert_dir)}))
    return folder


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example(section: str, block: int = 0) -> str:
    """The Python block number ``block`` (the first: 0) of the README's section titled ``section`` (``## Your own analysis``)."""
    import re

    text = README.read_text()
    start = text.index(f"## {section}")
    return re.findall(r"```python\n(.*?)```", text[start:text.find("\n## ", start)], re.S)[block]


def run_offline(code: str, cwd: Path):
    """Run ``code`` in a fresh interpreter in ``cwd``, the hub switched off and no PATH: as a user would paste it."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": ""})


def eager_reference(loaded, examples) -> list[dict]:
    """Each example run alone through transformers' own eager attention (no bertology hook, no padding): its ``ids``, its
    maps ``attentions[layer, head, n, n]`` and ``hidden[layer + 1, n, dim]`` as numpy float64, the independent reference of
    the decoder tests."""
    model = loaded.model
    references = []
    model.config._attn_implementation = "eager"
    try:
        for example in examples:
            ids = loaded.tokenizer(example.text, example.text_pair)["input_ids"]
            with torch.no_grad():
                out = model(input_ids=torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
            references.append({"ids": ids, "attentions": torch.stack(out.attentions)[:, 0].double().numpy(),
                               "hidden": torch.stack(out.hidden_states)[:, 0].double().numpy()})
    finally:
        model.config._attn_implementation = "bertology"
    return references


def float64_model(folder):
    """A saved model loaded in float64: padding then changes results by ~1e-16, not float32's ~1e-7, which ill-conditioned
    statistics (a t statistic near 0, a tiny spread) would amplify past any fair tolerance."""
    loaded = load_model(folder, device="cpu")
    loaded.model.double()
    return loaded


@pytest.fixture(scope="module")
def bert64(tiny_bert_dir):
    return float64_model(tiny_bert_dir)


@pytest.fixture(scope="module")
def roberta64(tiny_roberta_dir):
    return float64_model(tiny_roberta_dir)


@pytest.fixture(scope="module")
def gpt2_64(tiny_gpt2_dir):
    return float64_model(tiny_gpt2_dir)


@pytest.fixture(scope="module")
def llama64(tiny_llama_dir):
    return float64_model(tiny_llama_dir)
