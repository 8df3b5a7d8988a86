"""Issue 39's done-when: the claims that null models make, and the calibration of the bundled model.

Builds three null models, 3 layers x 4 heads with every query projection zeroed (so every head attends uniformly over the
keys it may see, and nothing about any head is special): a BERT with the bundled model's WordPiece tokenizer, and a GPT-2
and a grouped-query Llama (2 key-value heads) with a byte-level BPE trained here on the corpora. Runs ``analyze`` with the
families that make claims of heads (profile, roles, patterns, syntax on trees, classes, sinks on decoders, head types) over the first
``--sentences`` held-out EWT test trees and the RTE dev pairs, and prints each run's claims by family; then runs
``bertology analyze --calibrate`` on the bundled model and corpus and prints the run's claims line and the null model's.

    .venv/bin/python bench/null_claims.py [--sentences 300] [--pairs 300]

Every count must be 0 (the real run of the bundled model is the one exception: it is what the calibration is for).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from bertology import analyze
from bertology.core.model.models import default_model_path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_no_claim_under_the_null import CLAIMING, ewt_trees, rte_pairs  # noqa: E402  (the corpora and families of the test)

LAYERS, HEADS, HIDDEN = 3, 4, 32


def byte_level_tokenizer(texts: list[str], bos: str | None) -> PreTrainedTokenizerFast:
    """A byte-level BPE of 2,000 pieces trained on ``texts``; with ``bos``, put first (Llama's way)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>", "<s>", "</s>", "<pad>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos is None:
        bpe.post_processor = processors.ByteLevel(trim_offsets=True)
        return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    bpe.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, bpe.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token="</s>", pad_token="<pad>")


def null_models(texts: list[str], folder: Path) -> dict[str, Path]:
    """The three null models, saved as model folders: random weights, every query projection (weight and bias) zero."""
    torch.manual_seed(0)
    saved = {}
    bert_tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    bert = BertModel(BertConfig(vocab_size=bert_tokenizer.vocab_size, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                intermediate_size=2 * HIDDEN, max_position_embeddings=512))
    gpt2_tokenizer = byte_level_tokenizer(texts, None)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_head=HEADS, n_embd=HIDDEN, n_positions=1024, vocab_size=len(gpt2_tokenizer),
                                      bos_token_id=gpt2_tokenizer.bos_token_id, eos_token_id=gpt2_tokenizer.eos_token_id))
    llama_tokenizer = byte_level_tokenizer(texts, "<s>")
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, hidden_size=HIDDEN,
                                         intermediate_size=2 * HIDDEN, max_position_embeddings=1024, vocab_size=len(llama_tokenizer),
                                         bos_token_id=llama_tokenizer.bos_token_id, eos_token_id=llama_tokenizer.eos_token_id,
                                         pad_token_id=llama_tokenizer.pad_token_id))
    with torch.no_grad():
        for layer in bert.encoder.layer:
            layer.attention.self.query.weight.zero_()
            layer.attention.self.query.bias.zero_()
        for block in gpt2.transformer.h:  # c_attn's first HIDDEN output columns are the queries (Conv1D: [in, out])
            block.attn.c_attn.weight[:, :HIDDEN].zero_()
            block.attn.c_attn.bias[:HIDDEN].zero_()
        for layer in llama.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    for name, model, tokenizer in (("bert", bert, bert_tokenizer), ("gpt2", gpt2, gpt2_tokenizer), ("llama", llama, llama_tokenizer)):
        saved[name] = folder / name
        model.save_pretrained(saved[name])
        tokenizer.save_pretrained(saved[name])
    return saved


def calibration() -> list[str]:
    """The claims lines of ``bertology analyze --calibrate`` on the bundled model and corpus: the run's, and the null model's."""
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run([sys.executable, "-m", "bertology.cli", "analyze", "--out", str(Path(scratch) / "run"), "--device", "cpu", "--quiet",
                               "--calibrate"], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bertology analyze --calibrate failed: {done.stderr.strip().splitlines()[-1]}")
    return [line for line in done.stdout.splitlines() if line.startswith(("claims: ", "calibration, "))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=300)
    arguments = parser.parse_args()
    if not SHARED.is_dir():
        sys.exit(f"{SHARED} is not there: this benchmark reads the EWT trees and the RTE pairs from it")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        corpora = {"EWT trees": ewt_trees(SHARED, folder, arguments.sentences), "RTE pairs": rte_pairs(SHARED, folder, arguments.pairs)}
        sequences = {"EWT trees": arguments.sentences, "RTE pairs": len(corpora["RTE pairs"].read_text(encoding="utf-8").splitlines())}
        texts = [line for path in corpora.values() for line in path.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]
        saved = null_models(texts, folder)
        print(f"| null model | corpus | sequences | {' | '.join(CLAIMING)} | claims | seconds |")
        print("|---|---|---|" + "---|" * len(CLAIMING) + "---|---|")
        for name, path in saved.items():
            for corpus_name, corpus in corpora.items():
                families = [f for f in CLAIMING if (f != "syntax" or "trees" in corpus_name) and (f != "sinks" or name != "bert")]
                started = time.perf_counter()
                result = analyze(path, corpus, analyses=families, view=False, progress=False, device="cpu")
                claims = result.claims()
                counts = [str(len(claims.get(f, []))) if f in families else "-" for f in CLAIMING]
                total = sum(len(lines) for lines in claims.values())
                seconds = time.perf_counter() - started
                print(f"| {name} | {corpus_name} | {sequences[corpus_name]} | {' | '.join(counts)} | {total} | {seconds:.0f} |", flush=True)
    print("\nbertology analyze --calibrate, the bundled model and corpus:", *calibration(), sep="\n")


if __name__ == "__main__":
    main()
