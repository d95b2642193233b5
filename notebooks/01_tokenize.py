# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python (stagewise)
#     language: python
#     name: stagewise
# ---

# %% [markdown]
# # 01 · Tokenize: text -> `[num_tokens]`
#
# A model never sees characters. Its first layer is a table with one row per
# *token id* (49,152 rows for SmolLM2), so the first stage of inference turns a
# string into a 1-D tensor of ids:
#
#     "What is the capital of France?"  ->  int64 [num_tokens]
#
# SmolLM2 and Llama 3, like GPT-2 before them, use **byte-level BPE** (byte pair
# encoding over the bytes of the UTF-8 text). Llama 1 and 2, Mistral and
# TinyLlama use a cousin, **SentencePiece BPE with byte fallback**; the last
# section shows what differs. BPE is worth understanding for three reasons:
#
# * **cost**: everything downstream scales with `num_tokens`, not with
#   characters. A tokenizer that needs fewer tokens for the same text makes
#   every later stage cheaper (and the KV cache smaller);
# * **correctness**: the ids must be *exactly* the ones the model was trained
#   on, or the model reads garbage. So the naive and the fast tokenizer must
#   agree bit for bit;
# * **no unknown token, if every byte has a token**: working on UTF-8 *bytes*
#   means any string — Chinese, emoji, code — *can* have an encoding, as long
#   as the vocabulary holds all 256 byte letters (section 3 counts SmolLM2's).
#
# This notebook follows the package's tokenize stage
# (`stagewise/stages/tokenize.py`): motivation -> training a small BPE ->
# naive (pure Python, step by step, with the real vocabulary) -> optimized
# (Rust `tokenizers`) -> check -> measure -> picture -> SentencePiece.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the
# timing uses fewer repeats. Nothing else changes.

# %%
import ast
import os
import pathlib

import matplotlib.pyplot as plt

import stagewise
from stagewise.bench.harness.timing import compare
from stagewise.models.chat_template import apply_chat_template
from stagewise.models.files import smollm2_gguf_path
from stagewise.models.tokenizer_files import tokenizer_from_gguf, tokenizer_from_hf_dir
from stagewise.stages import STAGES
from stagewise.stages.tokenize import bpe_merge, bytes_to_unicode, pre_tokenize, split_special_tokens
from stagewise.tokenizer.train import TINY_CORPUS, train_bpe
from stagewise.viz import stages as viz_stages

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
REPEATS = 3 if QUICK else 10

# %% [markdown]
# ## Training a BPE: where the merges come from
#
# A BPE vocabulary is *learned*. Training (`stagewise/tokenizer/train.py`,
# the textbook algorithm) cuts a corpus into pieces with the same regex the
# encoder will use, spells every piece in bytes, and then repeats one step:
# count every adjacent pair of symbols over the whole corpus, and fuse the
# most frequent pair everywhere into a new symbol. The list of fused pairs,
# in the order they were learned, *is* the tokenizer: its **merges**, ranked.
#
# Here it runs on the small built-in corpus the `tiny` test model uses (a few
# paragraphs of English), for a handful of merges:

# %%
print(f"corpus: {len(TINY_CORPUS):,} characters, {len(pre_tokenize(TINY_CORPUS, 'smollm')):,} pieces")
learned = train_bpe(TINY_CORPUS, 200)  # the first 200 merges, in rank order
for rank, (a, b) in enumerate(learned[:12]):
    print(f"rank {rank:2}: {a!r:7} + {b!r:7} -> {a + b!r}")

# %% [markdown]
# The first merges are the most frequent pairs of English: `Ġ` is a space (the
# byte alphabet below explains why), so `Ġ t` is "a word starting with t",
# then `h e`, then `Ġt he` and so on: after a few rounds " the" is one symbol.
#
# **Applying** the learned merges to new text replays training: start from
# bytes, and fuse the pair that was learned *earliest* wherever it occurs,
# until no learned pair is left (`bpe_merge`, step 4 below). With more merges
# the same text needs fewer symbols:

# %%
byte_map = bytes_to_unicode()
probe = " the baker's daughter"
merged_counts = {}
for num_merges in (0, 10, 50, 200):
    ranks = {pair: rank for rank, pair in enumerate(learned[:num_merges])}
    symbols = [bpe_merge(list("".join(byte_map[b] for b in p.encode())), ranks) for p in pre_tokenize(probe, "smollm")]
    merged_counts[num_merges] = sum(len(x) for x in symbols)
    print(f"{num_merges:3} merges: {merged_counts[num_merges]:2} symbols  {' | '.join(s for x in symbols for s in x)}")

# %% [markdown]
# ## The real tokenizer
#
# The SmolLM2 GGUF file carries the tokenizer next to the weights: the
# vocabulary (token strings), the merges in the order they were learned, the
# special tokens and the chat template. `tokenizer_from_gguf` reads only that
# metadata (no weights) into a `stagewise.tokenizer.Tokenizer`.

# %%
tok = tokenizer_from_gguf(smollm2_gguf_path())
print(tok)
print("first merges learned:", tok.merges[:5])
print("special tokens:", list(tok.special_tokens.items())[:4], "...")

# %% [markdown]
# ## Naive, step by step
#
# The naive path (`STAGES["tokenize"].naive`) does five things. We run each one
# on a real sentence with the stage's own helper functions.
#
# ### 1. Special tokens first
#
# The chat template wraps a message in control markers such as `<|im_start|>`.
# They are matched *literally* before BPE and become one id each; otherwise BPE
# would cut `<|im_start|>` into `<`, `|`, `im`, ... and the model would never
# recognise the turn boundaries it was trained on.

# %%
prompt = apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France?"}])
print(prompt)
for chunk, is_special in split_special_tokens(prompt, tok.special_tokens):
    print(f"{'SPECIAL' if is_special else 'text   '} {chunk!r}")

# %% [markdown]
# ### 2. Pre-tokenize
#
# A regex cuts the text into *pieces*; merges never cross a piece boundary.
# SmolLM2's pre-tokenizer (`"smollm"`) first isolates every digit, then applies
# GPT-2's pattern: a word keeps its leading space (`" capital"`), punctuation
# runs are their own piece, runs of spaces leave their last space to the next
# word. Isolating digits means `2024` is always the four tokens `2 0 2 4`: the
# model sees numbers digit by digit, with a consistent representation.

# %%
sentence = "Tokenization isn't magic: SmolLM2 reads 2024 bytes.\nThe  end. 大模型"
pieces = pre_tokenize(sentence, tok.pre)
print(pieces)
assert "".join(pieces) == sentence  # lossless: the pieces concatenate back to the text

# %% [markdown]
# ### 3. Bytes -> printable characters
#
# Each piece is encoded to UTF-8, and each *byte* is spelled as one printable
# character. Printable Latin-1 bytes stand for themselves; the others (space,
# newline, control bytes...) are shifted above U+0100. That is why BPE
# vocabularies are full of `Ġ` (a space) and `Ċ` (a newline). The vocabulary
# is written in this 256-letter alphabet; whether *every* input has an
# encoding depends on the vocabulary holding all 256 letters as tokens, which
# the cell after this one counts.

# %%
shifted = sum(1 for b, letter in byte_map.items() if ord(letter) != b)
print(f"{256 - shifted} bytes stand for themselves, {shifted} are shifted above U+0100")
for ch in [" ", "\n", "a", "é"]:
    utf8 = ch.encode()  # UTF-8 bytes
    print(f"{ch!r:6} UTF-8 {utf8.hex(' '):8} -> {''.join(byte_map[b] for b in utf8)!r}")
print("distinct byte letters:", len(set(byte_map.values())))

# A Chinese character is 3 UTF-8 bytes, so 3 letters of the byte alphabet:
spelled = "".join(byte_map[b] for b in " 大模型".encode())
print(repr(" 大模型"), "->", repr(spelled), f"({len(spelled)} byte letters)")

# %% [markdown]
# Does the vocabulary hold all 256 byte letters as tokens? Count the ones it
# lacks, and encode a control byte among them:

# %%
lacking = [b for b, letter in byte_map.items() if letter not in tok.token_to_id]  # bytes with no token
print(f"SmolLM2's vocabulary lacks {len(lacking)} of the 256 byte letters:", " ".join(f"{b:02x}" for b in lacking))
never_utf8 = [b for b in lacking if b in (0xC0, 0xC1) or b >= 0xF5]  # bytes no valid UTF-8 text contains
print(f"{len(never_utf8)} of them never occur in valid UTF-8; the others are control bytes or rare lead bytes")
for text in ["\x06", "a\x06b"]:
    print(f"{text!r} encodes to {tok.encode(text, add_special_tokens=False)}")

# %% [markdown]
# So "no unknown token" holds for SmolLM2 only up to those bytes: a text
# holding one of them (a stray control character, say) loses it silently, and
# `decode(encode(text))` no longer gives the text back. Text made of ordinary
# characters is unaffected: every byte of every printable character has its
# token. (If the count above reads 0, this vocabulary has them all.)

# %% [markdown]
# ### 4. Merge by rank
#
# Start from single byte letters. Repeatedly find the adjacent pair whose merge
# was learned *earliest* (lowest rank in `tok.merges`) and fuse it everywhere in
# the piece; stop when no adjacent pair is a known merge. `bpe_merge` does the
# whole loop. To watch it, we pick the best pair ourselves (a lookup in
# `tok.merge_ranks`) and let `bpe_merge` apply just that one merge, then check
# that the step-by-step result equals the stage's full `bpe_merge`.


# %%
def merge_steps(piece: str) -> list[tuple[list[str], tuple[str, str] | None, int | None]]:
    """(symbols, pair merged next, its rank) after every merge step, for display."""
    symbols = list("".join(byte_map[b] for b in piece.encode()))  # one byte letter per symbol
    steps = []
    while True:
        ranked = [(tok.merge_ranks[p], p) for p in zip(symbols, symbols[1:]) if p in tok.merge_ranks]
        if not ranked:
            steps.append((symbols, None, None))
            return steps
        rank, best = min(ranked)
        steps.append((symbols, best, rank))
        symbols = bpe_merge(symbols, {best: 0})  # apply exactly this one merge


word = " tokenization"
steps = merge_steps(word)
for i, (symbols, best, rank) in enumerate(steps):
    nxt = f"next: merge {best[0]!r} + {best[1]!r} (rank {rank})" if best else "no known pair left: done"
    print(f"step {i:2}: {' | '.join(symbols):55} {nxt}")

start = list("".join(byte_map[b] for b in word.encode()))
assert steps[-1][0] == bpe_merge(start, tok.merge_ranks)  # identical to the stage's own loop

# %% [markdown]
# Note the ranks climb: `Ġ t` (a space before `t`, learned very early),
# `i z`, ... then the whole suffix `ization`. Frequent fragments were learned
# first. A word the training data saw often ends as one token; a rare word
# ends as a few.
#
# ### 5. Look up the ids
#
# The final symbols are vocabulary entries; their positions are the ids. Here
# the whole naive stage, special tokens included, on the chat prompt:

# %%
ids_naive = STAGES["tokenize"].naive(text=prompt, tokenizer=tok)  # text -> [num_tokens]
print("shape:", tuple(ids_naive.shape), ids_naive.dtype)
print([tok.tokens[i] for i in ids_naive.tolist()])

# %% [markdown]
# ## Optimized: the Rust `tokenizers` library
#
# `STAGES["tokenize"].triton` builds a Rust `tokenizers.Tokenizer` from the
# *same* vocabulary, merges, pre-tokenizer regexes and special tokens, once
# (cached on `tok.rust`). Nothing about the algorithm changes; what changes is
# the machinery: compiled regexes, a priority-queue merge loop, no Python
# object per character.
#
# ## Check: identical ids
#
# Exactly equal, not "close": a single different id is a different input to
# the model. We compare on the chat prompt, the mixed sentence above, and on a
# larger corpus: the docstrings of every stagewise module (English prose,
# code, formulas, arrows and other Unicode symbols).

# %%
root = pathlib.Path(stagewise.__file__).parent
docstrings = [ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) for p in sorted(root.rglob("*.py"))]
corpus = "\n\n".join(d for d in docstrings if d)
print(f"corpus: {len(corpus):,} characters from {len(docstrings)} modules")

for text in [prompt, sentence, corpus]:
    a = STAGES["tokenize"].naive(text=text, tokenizer=tok)
    b = STAGES["tokenize"].triton(text=text, tokenizer=tok)
    assert a.tolist() == b.tolist(), "naive and Rust tokenizers disagree"
    ratio = len(text) / a.numel()
    print(f"identical ids: {a.numel():>6} tokens for {len(text):>6} characters ({ratio:.2f} chars/token)")

# %% [markdown]
# ## Measure
#
# Times are medians of alternating runs (`stagewise.bench.harness.timing.compare`),
# on two texts: the chat prompt (what an inference server tokenizes per
# request) and the whole docstring corpus. The naive path keeps a per-piece
# cache (`tok.bpe_cache`): a piece merged once is a dictionary hit afterwards.
# So we time it **cold** (cache cleared before every call: every piece goes
# through the Python merge loop) and **warm** (every piece is already cached).


# %% tags=["timing"]
def timed_paths(text: str) -> dict:
    def naive_cold():
        tok.bpe_cache.clear()
        return tok.encode(text, backend="naive")

    return {
        "naive, cold cache": naive_cold,
        "naive, warm cache": lambda: tok.encode(text, backend="naive"),
        "Rust tokenizers": lambda: tok.encode(text, backend="fast"),
    }


for label, text in [("chat prompt", prompt), ("docstring corpus", corpus)]:
    n = len(tok.encode(text, backend="fast"))
    timings = compare(timed_paths(text), repeats=REPEATS, warmup=1)
    print(f"{label}: {n:,} tokens")
    for name, t in timings.items():
        print(f"  {name:18} {t.median_ms:8.2f} ms   {n / t.median_ms / 1e3:5.2f} M tokens/s")
    cold, rust = timings["naive, cold cache"].median_ms, timings["Rust tokenizers"].median_ms
    print(f"  Rust vs naive doing the same work (cold): {cold / rust:.1f}x faster")

# %% [markdown]
# What to read from this:
#
# * doing the same work (cold cache), the Rust library is faster: the Python
#   merge loop, with one Python object per symbol, is the slow part;
# * with a warm cache the naive path skips that loop and only runs the regex
#   (Python's `regex` module is compiled C) and dictionary lookups, so it can
#   match the Rust library on repetitive text. Caching by piece is the single
#   most effective trick in a BPE tokenizer — real text reuses the same few
#   thousand pieces (" the", " of", ...) over and over, and the Rust library
#   caches too;
# * either way, tokenizing a prompt costs well under a millisecond to a few
#   milliseconds. Next to a forward pass through 30 layers it is never the
#   bottleneck of inference; it runs on the CPU while the GPU is busy.
#
# ## Picture
#
# Left: the merges that build `" tokenization"`, in the order they fire, with
# the rank of each (log scale). Ranks climb from single digits (`Ġ t`, `o n`:
# fragments that are everywhere in English) to thousands (`Ġto ken`): BPE
# learned frequent fragments first, and applies them first.
#
# Middle: tokens per pre-tokenized piece over the docstring corpus. Most pieces
# (a word with its space, a punctuation mark) are a single token; the tail is
# rare words and identifiers.
#
# Right: characters per token for different kinds of text. The cost of a
# prompt is its *token* count: English prose packs several characters into a
# token, code fewer, digits exactly one (SmolLM2 splits them), and Chinese, a
# small part of SmolLM2's training data, often less than one character per
# token: a token can end in the middle of a character's 3 UTF-8 bytes. (That
# is also why streaming detokenization must hold back incomplete UTF-8 bytes,
# see `IncrementalDecoder` in `stagewise/tokenizer/decode.py`.)

# %%
merges = [(best, rank) for _, best, rank in merge_steps(" tokenization") if best is not None]  # ((a, b), rank)
per_piece = [len(tok.encode(p, backend="fast")) for p in pre_tokenize(corpus, tok.pre)]  # tokens per piece
samples = {
    "English prose": "The capital of France is Paris. It is known for its museums, its cafes and the river Seine.",
    "Python code": (root / "stages" / "ffn.py").read_text(encoding="utf-8").split('"""')[2],
    "digits": "3.14159265358979323846264338327950288419716939937510",
    "Chinese": "大模型是如何高效推理的：分词、嵌入、注意力、前馈网络、采样。",
}
ratios = {name: len(text) / len(tok.encode(text, backend="fast")) for name, text in samples.items()}
viz_stages.tokenizer_pictures(merges, per_piece, ratios)
plt.show()

# %% [markdown]
# ## The other BPE: SentencePiece with byte fallback (Llama 1 and 2)
#
# Llama 1 and 2, Mistral and TinyLlama ship a SentencePiece `tokenizer.model`.
# It is BPE too, with four differences (`stagewise/stages/tokenize_sentencepiece.py`):
#
# 1. no regex pre-tokenizer: a space becomes the visible letter `▁` (U+2581)
#    and the text gets a "dummy prefix" `▁`, so every word looks like `▁word`;
# 2. it works on **characters**, not bytes; merges are ranked by a *score* per
#    vocabulary piece (the best-scoring adjacent pair that forms a piece merges
#    first), not by a merge list;
# 3. a character the vocabulary lacks falls back to its UTF-8 **bytes**, one
#    `<0xNN>` token each — so nothing is unknown, provided all 256 byte tokens
#    are in the vocabulary;
# 4. decoding turns `▁` back into spaces and drops the dummy prefix. An LLM
#    output that continues a prompt keeps that space, as the gap between the
#    prompt's last word and the output's first (`tok.decode(ids,
#    continuation=True)`; this is what `LLM` does for outputs, as vLLM does).
#
# We train a small SentencePiece BPE on the same corpus with the `sentencepiece`
# package (a development dependency of stagewise, installed by `make install`;
# stagewise itself reads the file without it), load it with stagewise's own
# reader, and encode a sentence with a character the corpus never saw.

# %%
import io  # noqa: E402
import tempfile  # noqa: E402

try:
    import sentencepiece as spm
except ImportError:  # stagewise runs without it; only this demo needs it
    spm = None
    print("sentencepiece is not installed (pip install sentencepiece): skipping the SentencePiece demo")

if spm is not None:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TINY_CORPUS.splitlines()), model_writer=model, model_type="bpe", vocab_size=400,
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, minloglevel=2,
    )
    with tempfile.TemporaryDirectory() as folder:
        (pathlib.Path(folder) / "tokenizer.model").write_bytes(model.getvalue())
        sp_tok = tokenizer_from_hf_dir(folder)  # stagewise reads the model proto itself
    print(sp_tok)
    text = "The baker's daughter ate a Žemlička"  # Ž and č never occur in the training corpus
    sp_ids = STAGES["tokenize"].naive(text=text, tokenizer=sp_tok).tolist()
    print([sp_tok.tokens[i] for i in sp_ids])
    reference = [sp_tok.bos_id] + spm.SentencePieceProcessor(model_proto=model.getvalue()).encode(text)
    assert sp_ids == STAGES["tokenize"].triton(text=text, tokenizer=sp_tok).tolist() == reference
    decoded = sp_tok.decode(sp_ids, skip_special_tokens=True)
    print("naive == Rust == sentencepiece's own encoder; decoded:", repr(decoded))
    output = sp_tok.encode("ate a", add_special_tokens=False)  # as if the model generated " ate a"
    print("an output on its own:", repr(sp_tok.decode(output)), " continuing a prompt:",
          repr(sp_tok.decode(output, continuation=True)))

# %% [markdown]
# `<s>` is the beginning-of-sequence token SentencePiece models add; words
# start with `▁`; and `Ž` and `č`, outside the training alphabet, became their
# UTF-8 bytes, two `<0xNN>` tokens each. Byte-level BPE starts from bytes
# instead, and gives the same guarantee only when its vocabulary holds every
# byte letter: section 3 showed the bytes SmolLM2's lacks, and that text made of
# them encodes to nothing.
#
# ## In vLLM (v0.11.0)
#
# vLLM does not implement BPE: `get_tokenizer` in
# `vllm/transformers_utils/tokenizer.py` loads the Hugging Face (Rust) tokenizer,
# the "optimized" path here. Outputs are detokenized as they stream by
# `IncrementalDetokenizer` / `FastIncrementalDetokenizer` in
# `vllm/v1/engine/detokenizer.py`, and chat templates are applied by
# `apply_hf_chat_template` in `vllm/entrypoints/chat_utils.py`.
#
# ## Takeaways
#
# * a BPE tokenizer is a ranked list of merges *learned* from a corpus (most
#   frequent pair first); encoding replays them on new text;
# * text -> special tokens -> regex pieces -> byte letters -> merges by rank ->
#   ids `[num_tokens]`; the naive and Rust paths give the same ids, always;
# * SentencePiece BPE (Llama 1/2) merges characters by score and falls back to
#   bytes; byte-level BPE (GPT-2, SmolLM2, Llama 3) starts from bytes;
# * `num_tokens`, not characters, is what every later stage pays for.
#
# Next: `02_embedding_rmsnorm` turns `[num_tokens]` into `[num_tokens, hidden]`.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's reference on fresh inputs (the `tiny` model's
# vocabulary, `Tokenizer.tiny()`) and prints **PASS**, **FAIL** with the first
# mismatch, or **not yet**. Solutions: `notebooks/solutions/nb01.py`.
#
# **1. The merge loop.** Write BPE's apply loop: given a list of symbols and
# `merge_ranks` (pair -> rank), repeatedly find the adjacent pair with the
# lowest rank and fuse *every* occurrence of it, left to right; stop when no
# adjacent pair has a rank.

# %%
from stagewise.exercises import check  # noqa: E402


def my_bpe_merge(symbols: list[str], merge_ranks: dict) -> list[str]:
    raise NotImplementedError


# %%
check("01.bpe_merge", my_bpe_merge)

# %% [markdown]
# **2. One piece to ids.** Spell a pre-tokenized piece in the byte alphabet
# (`bytes_to_unicode`), drop byte letters the vocabulary lacks, merge with
# your `my_bpe_merge` and `tokenizer.merge_ranks`, and look the symbols up in
# `tokenizer.token_to_id`.


# %%
def my_piece_to_ids(piece: str, tokenizer) -> list[int]:
    raise NotImplementedError


# %%
check("01.piece_to_ids", my_piece_to_ids)

# %% [markdown]
# **3. One step of training.** Return the first merge BPE training learns on a
# corpus: pre-tokenize with `pre_tokenize(corpus, "smollm")`, spell each piece
# in bytes, count adjacent pairs over all pieces (a piece that occurs 5 times
# counts 5 times), and return the most frequent pair; on a tie, the pair that
# sorts first.


# %%
def my_first_merge(corpus: str) -> tuple[str, str]:
    raise NotImplementedError


# %%
check("01.first_merge", my_first_merge)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/tokenizer
#     .venv/bin/python -m pytest -q tests/exercises -k 01
