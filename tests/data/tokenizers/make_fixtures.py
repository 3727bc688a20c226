#!/usr/bin/env python3
"""Makes the tokenizer fixtures in this directory (provenance; run by hand, never by the build).

    python3 -m venv /tmp/tokvenv && /tmp/tokvenv/bin/pip install tokenizers==0.22.2
    /tmp/tokvenv/bin/python tests/data/tokenizers/make_fixtures.py            # rewrite everything
    /tmp/tokvenv/bin/python tests/data/tokenizers/make_fixtures.py --bench    # also time HF encoding

It trains small tokenizers with HF's `tokenizers` library on a corpus this script
contains, shapes their tokenizer.json like the real model families' files, and writes,
for each <name>/:
  tokenizer.json          the tokenizer, as HF loads it
  tokenizer_config.json   a transformers-style config (bos/eos, add_bos_token, ...)
  expected.jsonl          one JSON object per test string: text, ids (add_special_tokens
                          =True), ids_no_special (=False), tokens, decoded (decode(ids,
                          skip_special_tokens=False)), decoded_skip_special
  corpus_summary.json     for corpus_mixed.txt encoded whole, add_special_tokens=False:
                          the count of ids, FNV-1a 64 of the ids (each a little-endian
                          uint32), and the first 200 ids
and corpus_mixed.txt (~200 KB, generated deterministically from a fixed seed).

Every expected value is produced by Tokenizer.from_file() on the file as shipped, so the
fixtures stay consistent even where training itself is not bit-reproducible across
library versions. No network access is needed (the corpus is in this file).
"""

import argparse
import hashlib
import json
import os
import statistics
import struct
import sys
import time

# One thread, no batch parallelism: must be set before tokenizers is imported.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import tokenizers  # noqa: E402
from tokenizers import (  # noqa: E402
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

HERE = os.path.dirname(os.path.abspath(__file__))

# --------------------------------------------------------------------------------------
# Training corpus (original text written for this file).
# --------------------------------------------------------------------------------------

ENGLISH = """\
The river ran slowly past the old mill, and the miller's daughter watched the water from the bridge.
She had counted the boats that morning: three from the north, two from the south, and one that did not belong to anyone.
It's not that she didn't trust strangers; she'd simply learned that they're rarely what they seem.
"We'll see," her father said, when she told him about the boat. "We've seen stranger things than an empty boat."
The boat was painted blue and green, with a small white flag tied to the mast.
Nobody in the village could remember a flag like that, and the oldest fisherman said he had never seen one.
By the afternoon the whole village was standing on the bank, talking, pointing, and arguing about what to do.
A tokenizer splits text into pieces; a model reads the pieces and predicts the next one.
Training a language model takes a great deal of text, a great deal of compute, and a great deal of patience.
The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.
In 1969, people walked on the moon; in 2024, a model with 70 billion parameters was trained on 15 trillion tokens.
The price went from $3.50 to $4.25, an increase of 21.4 percent, and nobody was happy about it.
Please send the report to the team by Friday, or call 555-0123 if you have any questions.
Visit https://example.com/docs/index.html or http://www.example.org/path?id=42&lang=en for more information.
Email alice@example.com and bob.smith@example.org with the subject "Quarterly results (Q3)".
The function returns None when the list is empty, and raises ValueError when the input isn't a list.
Memory bandwidth, not arithmetic, is usually what limits the speed of decoding one token at a time.
Tensor parallelism splits each matrix across devices; pipeline parallelism splits the layers.
I'm sure you'll agree that it's better to measure twice and cut once, isn't it?
They'd already left when we arrived, so we waited until the rain stopped and then walked home.
"""

FRENCH = """\
L'été dernier, nous sommes allés à la mer avec nos amis de Marseille.
Le garçon a mangé une crème brûlée au café, puis il a lu un roman très intéressant.
Où est la bibliothèque ? Elle se trouve à côté de l'hôpital, près de la gare.
C'est une expérience à la fois étrange et très agréable, n'est-ce pas ?
Les élèves français étudient l'histoire, la géographie et les mathématiques.
"""

GERMAN = """\
Die Straße war nass, und die Kinder spielten trotzdem draußen im Garten.
Über den Brücken der Stadt fahren jeden Tag tausende Fahrräder und Straßenbahnen.
Grüße aus München! Das Wetter ist schön, aber die Äpfel sind noch nicht reif.
Der Fußgänger überquerte die Straße, während der Bäcker frische Brötchen verkaufte.
Größere Modelle brauchen mehr Speicher, schnellere Verbindungen und längere Geduld.
"""

SPANISH = """\
El niño comió una manzana en la mañana; después, su mamá le preguntó: ¿qué más quieres?
La canción de la señora fue muy bonita, y todos aplaudieron con entusiasmo.
A nação brasileira celebra a independência com música, dança e muita alegria.
"""

CJK = """\
今天天气很好，我们去公园散步吧。
机器学习模型需要大量的数据和计算资源。
中文的分词和英文不一样，因为中文没有空格。
東京は日本の首都です。私は毎朝コーヒーを飲みます。
ひらがなとカタカナと漢字を使って日本語を書きます。
"""

EMOJI = """\
Great job! 👍 Thanks 🙏 so much 😀😀 see you soon 🎉
I love pizza 🍕 and coffee ☕ in the morning ☀️ and tea 🍵 at night 🌙.
"""

PYTHON = """\
import os
import sys


def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        if self.value > 1000:
            raise OverflowError("counter too large")
        return self.value


if __name__ == "__main__":
    for i, x in enumerate(fibonacci(10)):
        print(f"{i}: {x}")
    sys.exit(0)
"""

C_CODE = """\
#include <stdio.h>
#include <stdlib.h>

static int square(int x) {
\treturn x * x;
}

int main(int argc, char **argv) {
\tint total = 0;
\tfor (int i = 0; i < argc; ++i) {
\t\ttotal += square(atoi(argv[i]));
\t}
\tprintf("total = %d\\n", total);
\treturn total > 255 ? 1 : 0;
}
"""

NUMBERS = """\
1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 2048 4096 65536 1000000 1234567
3.14 2.718 0.5 1e-5 6.022e23 -17 +42 1,000 10,000 1,234,567 99.9% 12:30 2024-05-17
"""

WHITESPACE = "a  b   c    d\t\te\n\n\nf\r\ng      h\t \t i\n    j\n        k\n"

TRAIN_SECTIONS = [ENGLISH, FRENCH, GERMAN, SPANISH, CJK, EMOJI, PYTHON, C_CODE, NUMBERS, WHITESPACE]
TRAIN_TEXT = "\n".join(TRAIN_SECTIONS)


def train_chunks():
    """Whole sections (newlines and indentation kept): for the byte-level tokenizers."""
    return list(TRAIN_SECTIONS)


def train_lines():
    """Non-empty lines (no newline chars, like SentencePiece training): for the SPM-style ones."""
    return [line for line in TRAIN_TEXT.split("\n") if line.strip()]


# --------------------------------------------------------------------------------------
# corpus_mixed.txt: deterministic (own PRNG, no dependence on Python's random module).
# --------------------------------------------------------------------------------------


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def below(self, n):
        return self.next() % n

    def choice(self, seq):
        return seq[self.below(len(seq))]


SYLLABLES = ["ka", "lo", "mi", "ter", "zan", "qu", "ix", "bro", "ste", "vel", "yon", "ph", "ght", "str",
             "é", "ü", "ø", "ñ", "ß", "ça", "æ", "ło", "ř", "ő", "ş", "ă"]
RARE_CHARS = ["한", "국", "어", "사", "랑", "Ж", "д", "λ", "Ω", "ش", "ע", "ह", "ก", "∑", "∞", "≈", "→", "★",
              "🚀", "🦀", "👨\u200d💻", "🇫🇷", "🏳️\u200d🌈", "👍🏽", "𝔘", "𝕏", "\u00a0", "\u3000", "½", "Ⅻ",
              "١٢٣", "１２３", "e\u0301", "ﬁ"]
SPECIAL_STRINGS = ["<|endoftext|>", "<s>", "</s>", "<|begin_of_text|>", "<|end_of_text|>", "<bos>", "<eos>",
                   "<tool_call>", "[CLS]", "[SEP]"]
IDENTS = ["x", "y", "value", "total", "buffer", "idx", "result", "node", "count", "weights", "grad", "shape"]


def make_corpus(target_bytes=200_000):
    rng = SplitMix64(0x5EED_70CE)
    sentences = [s for sec in (ENGLISH, FRENCH, GERMAN, SPANISH, CJK, EMOJI) for s in sec.split("\n") if s]
    code_lines = [s for s in (PYTHON + C_CODE).split("\n")]
    out = []
    size = 0

    def emit(s):
        nonlocal size
        out.append(s)
        size += len(s.encode("utf-8"))

    while size < target_bytes:
        kind = rng.below(10)
        if kind <= 3:  # prose: a few sentences, shuffled
            emit(" ".join(rng.choice(sentences) for _ in range(1 + rng.below(6))))
        elif kind == 4:  # code, re-indented
            start = rng.below(len(code_lines))
            block = code_lines[start:start + 2 + rng.below(10)]
            indent = rng.choice(["", "    ", "\t", "  "])
            emit("\n".join(indent + line.replace("value", rng.choice(IDENTS)) for line in block))
        elif kind == 5:  # numbers
            parts = []
            for _ in range(5 + rng.below(20)):
                f = rng.below(6)
                if f == 0:
                    parts.append(str(rng.below(10 ** (1 + rng.below(12)))))
                elif f == 1:
                    parts.append("%d.%0*d" % (rng.below(1000), 1 + rng.below(6), rng.below(10 ** 6) % 10 ** 5))
                elif f == 2:
                    parts.append("{:,}".format(rng.below(10 ** 9)))
                elif f == 3:
                    parts.append("-%d" % rng.below(100000))
                elif f == 4:
                    parts.append("%d%%" % rng.below(101))
                else:
                    parts.append("0x%X" % rng.below(1 << 32))
            emit(" ".join(parts))
        elif kind == 6:  # URLs and paths
            emit(" ".join("https://%s.example.%s/%s?id=%d&q=%s" % (
                rng.choice(IDENTS), rng.choice(["com", "org", "de", "fr"]), rng.choice(IDENTS),
                rng.below(100000), rng.choice(IDENTS)) for _ in range(1 + rng.below(4))))
        elif kind == 7:  # pseudo-words: unseen in training (byte fallback, unk, long merges)
            words = []
            for _ in range(5 + rng.below(25)):
                w = "".join(rng.choice(SYLLABLES) for _ in range(1 + rng.below(4)))
                r = rng.below(10)
                if r == 0:
                    w = w.upper()
                elif r == 1:
                    w = w.capitalize()
                elif r == 2:
                    w += rng.choice(RARE_CHARS)
                elif r == 3:
                    w = rng.choice(RARE_CHARS) * (1 + rng.below(3))
                words.append(w)
            emit(" ".join(words))
        elif kind == 8:  # whitespace stress
            emit("".join(rng.choice([" ", "  ", "\t", "\n", "\r\n", "\n\n\n", "    ", "word", "x", "."])
                         for _ in range(10 + rng.below(30))))
        else:  # document separators / special-token strings inside text
            emit(rng.choice(SPECIAL_STRINGS) + rng.choice(["", " ", "\n"]) + rng.choice(sentences))
        emit(rng.choice(["\n", "\n\n", " ", "\n\n", "\n"]))
    return "".join(out)


# --------------------------------------------------------------------------------------
# Test strings (the same list for every tokenizer).
# --------------------------------------------------------------------------------------

LONG_PARAGRAPH = (
    "In the spring of 2023, the team trained a 7B-parameter model on 2.1 trillion tokens. "
    "They didn't expect the loss curve to look like this: 3.41 → 2.87 → 2.19, then a spike to 5.02 at step 12,345! "
    "\"It's the data,\" said Zoë, pointing at shard #0042 (file: /data/shards/part-0042.jsonl). "
    "Die Größe der Datei betrug 1.5 GB; le modèle a été réentraîné à partir du point de contrôle précédent. "
    "数据清洗之后，损失恢复正常。 日本語のテキストも含まれていました。 한국어 문서도 있었습니다. "
    "Emoji counts: 👍×17, 🚀×3, 👨\u200d👩\u200d👧×1. "
    "Code sample:\n\n    for step in range(1000):\n        loss = model(batch)\n        loss.backward()\n\n"
    "See https://example.com/report?run=42&ok=true for details, or e-mail ml-team@example.org.\t\tThanks!\r\n"
    "Ça coûte 12,50 € — naïve résumé, façade, Øresund, ångström, żółć, İstanbul.\n"
    "P.S. WE'RE NOT DONE YET — there're 12345678 more steps to go, and I'll keep you posted.   "
)
assert 900 <= len(LONG_PARAGRAPH.encode("utf-8")) <= 1400, len(LONG_PARAGRAPH.encode("utf-8"))

TEST_STRINGS = [
    "",
    " ",
    "x",
    "  leading and trailing  ",
    "multiple     spaces   here",
    "    indented",
    "trailing spaces    ",
    "\t",
    "tab\tseparated\tvalues",
    "\n",
    "line1\nline2",
    "windows\r\nline endings\r\n",
    "paragraph\n\n\nbreak",
    "\r",
    "\r\r\n",
    "   \n   \n",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "ALL CAPS SHOUTING AND MiXeD cAsE",
    "don't I'll WE'RE they've she'd it's",
    "IT'S l'homme '' 's",
    "1 12 123 1234 12345678",
    "3.14159 and 1,000 and -42 and 0.5e-10",
    "١٢٣ ١٢٣٤ and １２３４ and ½ Ⅻ",
    "naïve café résumé",
    "e\u0301 decomposed, \u0301 combining alone",
    "Straße Grüße Äpfel Öl über ẞ",
    "中文测试",
    "日本語のテキスト",
    "한국어",
    "👍",
    "👨\u200d👩\u200d👧 family 🏳️\u200d🌈 flag 👍🏽",
    "Ω ∑ ∞ ≠ ⟨⟩ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x**2\n",
    "int main() {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}",
    "https://example.com/path?query=1&x=y#frag",
    "user@example.org",
    "Pneumonoultramicroscopicsilicovolcanoconiosis zxqvj qwxz",
    "hello<|endoftext|>world",
    "<|endoftext|><|endoftext|>",
    " <|endoftext|> ",
    "<|ENDOFTEXT|> <|endoftext",
    "<s>hi</s>",
    "hello <s> world </s>",
    "<|begin_of_text|>Hello<|end_of_text|>",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<bos>text<eos><pad>",
    "[CLS] a [SEP] [MASK]",
    "<0x41> literal byte-token text",
    "▁ literal metaspace ▁▁x",
    "Ġ and Ċ literal",
    "a\u00a0b\u2009c\u3000d\u2028e",
    "\u0000",
    "\u00ff\u0100",
    "tokenizer tokenizers",
    "say hello and hellos, Hello",
    LONG_PARAGRAPH,
]

# --------------------------------------------------------------------------------------
# Helpers.
# --------------------------------------------------------------------------------------

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def out_dir(name):
    d = os.path.join(HERE, name)
    os.makedirs(d, exist_ok=True)
    return d


def write_json(path, obj, indent=2):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        json.dump(obj, f, ensure_ascii=False, indent=indent)
        f.write("\n")


def save_tokenizer_json(tok_or_dict, name):
    """Writes <name>/tokenizer.json. A dict is written as is (after a load check)."""
    path = os.path.join(out_dir(name), "tokenizer.json")
    obj = json.loads(tok_or_dict.to_str()) if isinstance(tok_or_dict, Tokenizer) else tok_or_dict
    Tokenizer.from_str(json.dumps(obj))  # must load
    write_json(path, obj)
    return path


def added_token(id_, content, special=True, normalized=False, lstrip=False, rstrip=False):
    return {"id": id_, "content": content, "single_word": False, "lstrip": lstrip, "rstrip": rstrip,
            "normalized": normalized, "special": special}


def template(single, pair, specials):
    """TemplateProcessing JSON the way tokenizers serializes it."""
    def piece(p):
        if p.startswith("$"):
            seq, _, tid = p[1:].partition(":")
            return {"Sequence": {"id": seq, "type_id": int(tid or 0)}}
        tok, _, tid = p.partition(":")
        return {"SpecialToken": {"id": tok, "type_id": int(tid or 0)}}
    return {"type": "TemplateProcessing",
            "single": [piece(p) for p in single.split()],
            "pair": [piece(p) for p in pair.split()],
            "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for t, i in specials.items()}}


def merges_as_strings(model):
    model["merges"] = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


def tokenizer_config(name, cfg, tok_json):
    cfg = dict(cfg)
    cfg["added_tokens_decoder"] = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in tok_json["added_tokens"]}
    write_json(os.path.join(out_dir(name), "tokenizer_config.json"), cfg)


def fnv1a64_ids(ids):
    h = 0xCBF29CE484222325
    for b in struct.pack("<%dI" % len(ids), *ids):
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def expected_files(name, corpus):
    """{file name: text} of the expected values for <name>, from its tokenizer.json as shipped."""
    path = os.path.join(HERE, name, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    lines = []
    for text in TEST_STRINGS:
        enc = tok.encode(text, add_special_tokens=True)
        enc_ns = tok.encode(text, add_special_tokens=False)
        rec = {"text": text, "ids": enc.ids, "ids_no_special": enc_ns.ids, "tokens": enc.tokens,
               "decoded": tok.decode(enc.ids, skip_special_tokens=False),
               "decoded_skip_special": tok.decode(enc.ids, skip_special_tokens=True)}
        # ASCII-only JSON: one object per '\n'-terminated line, whatever the text holds.
        lines.append(json.dumps(rec, ensure_ascii=True) + "\n")
    ids = Tokenizer.from_file(path).encode(corpus, add_special_tokens=False).ids
    corpus_bytes = corpus.encode("utf-8")
    summary = {
        "corpus": "corpus_mixed.txt",
        "corpus_bytes": len(corpus_bytes),
        "corpus_sha256": hashlib.sha256(corpus_bytes).hexdigest(),
        "encode": "the whole file as one string, add_special_tokens=False",
        "count": len(ids),
        "fnv1a64": "%016x" % fnv1a64_ids(ids),
        "fnv1a64_of": "the ids as consecutive little-endian uint32, FNV-1a 64 (offset 0xcbf29ce484222325, "
                      "prime 0x100000001b3)",
        "first_ids": ids[:200],
    }
    return {"expected.jsonl": "".join(lines),
            "corpus_summary.json": json.dumps(summary, ensure_ascii=False) + "\n"}


def write_expected(name, corpus):
    for fname, text in expected_files(name, corpus).items():
        with open(os.path.join(HERE, name, fname), "w", encoding="utf-8", newline="\n") as f:
            f.write(text)


def check_expected(name, corpus):
    """True when the shipped expected files equal what this library version gives."""
    ok = True
    for fname, text in expected_files(name, corpus).items():
        with open(os.path.join(HERE, name, fname), encoding="utf-8", newline="") as f:
            shipped = f.read()
        if shipped != text:
            ok = False
            got, want = text.splitlines(), shipped.splitlines()
            bad = [i for i in range(max(len(got), len(want)))
                   if i >= len(got) or i >= len(want) or got[i] != want[i]]
            print("MISMATCH %s/%s: %d line(s) differ, first: line %d" % (name, fname, len(bad), bad[0] + 1))
    return ok


# --------------------------------------------------------------------------------------
# The tokenizers.
# --------------------------------------------------------------------------------------


def make_gpt2_bpe():
    """GPT-2: byte-level BPE, the GPT-2 regex inside ByteLevel, <|endoftext|> after the vocab."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=800, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_chunks(), trainer)
    tok.add_special_tokens(["<|endoftext|>"])  # id == vocab size - 1, as in GPT-2 (50256)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    j = json.loads(tok.to_str())
    j["post_processor"]["add_prefix_space"] = True  # as in gpt2's tokenizer.json (offsets only)
    j["model"].update({"continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                       "byte_fallback": False, "ignore_merges": False})
    merges_as_strings(j["model"])  # "a b" strings, as in gpt2's file
    save_tokenizer_json(j, "gpt2_bpe")
    tokenizer_config("gpt2_bpe", {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
        "model_max_length": 1024, "tokenizer_class": "GPT2Tokenizer"}, j)


# Tokens put into the llama3 vocab by hand, with no merge that makes them, so that
# ignore_merges is visible (Llama-3's own vocab has such tokens): with ignore_merges a
# pre-token equal to one of these is that token, without it BPE splits it.
LLAMA3_UNREACHABLE = ["Ġtokenizer", "Ġtokenizers", "Ġliteral", "Ġhello"]


def make_llama3_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=990, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_chunks(), trainer)
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    for t in LLAMA3_UNREACHABLE:
        assert t not in vocab, t
        vocab[t] = len(vocab)
    n = len(vocab)
    j["added_tokens"] = [
        added_token(n, "<|begin_of_text|>"),
        added_token(n + 1, "<|end_of_text|>"),
        added_token(n + 2, "<|reserved_special_token_0|>"),
        added_token(n + 3, "<tool_call>", special=False),   # as Qwen2.5's non-special added tokens
        added_token(n + 4, "</tool_call>", special=False),
    ]
    j["model"].update({"ignore_merges": True, "fuse_unk": False, "byte_fallback": False})
    j["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        template("<|begin_of_text|> $A", "<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                 {"<|begin_of_text|>": n}),
    ]}
    j["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    # merges stay as [a, b] pairs: the form tokenizers >= 0.20 writes.
    save_tokenizer_json(j, "llama3_bpe")
    tokenizer_config("llama3_bpe", {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "clean_up_tokenization_spaces": True,
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast"}, j)


# Training-only pre-tokenizer for the SentencePiece-style BPE: words start with "▁" and a
# run of "▁" is its own piece (like sentencepiece's split_by_whitespace with
# allow_whitespace_only_pieces), so no learned merge crosses a word boundary. The shipped
# file has no pre-tokenizer, as Llama-2's.
SPM_TRAIN_SPLIT = r"▁+(?=▁[^▁])|▁?[^▁]+|▁+"
BYTE_TOKENS = ["<0x%02X>" % b for b in range(256)]


def make_spm_bpe():
    """Trains the SentencePiece-style BPE once; returns (vocab, merges) with Llama-2's id layout."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(SPM_TRAIN_SPLIT), behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False, limit_alphabet=120,
                                  special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(train_lines(), trainer)
    j = json.loads(tok.to_str())
    trained = sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {}
    for t in ["<unk>", "<s>", "</s>"] + BYTE_TOKENS:  # Llama-2: 0..2 specials, 3..258 bytes
        vocab[t] = len(vocab)
    for t, _ in trained:
        if t not in vocab:
            vocab[t] = len(vocab)
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    # Whitespace-run pieces, as Llama-2 has ("▁▁" is its first merge, "▁▁▁▁" follows early).
    for t in ["▁▁", "▁▁▁▁", "▁▁▁▁▁▁▁▁"]:
        if t not in vocab:
            vocab[t] = len(vocab)
    extra = [m for m in ["▁ ▁", "▁▁ ▁▁", "▁▁▁▁ ▁▁▁▁"] if m not in merges]
    merges = extra[:1] + merges[:10] + extra[1:] + merges[10:]
    model = {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
             "vocab": vocab, "merges": merges}
    return model


SPM_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"},
    {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0},
]}


def spm_json(model, normalizer, pre_tokenizer):
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [added_token(0, "<unk>"), added_token(1, "<s>"), added_token(2, "</s>")],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": template("<s> $A", "<s> $A <s>:1 $B:1", {"<s>": 1}),
        "decoder": SPM_DECODER,
        "model": model,
    }


def make_llama2_spm_bpe(model):
    """Llama-2 / Mistral-7B-v0.1 tokenizer.json ("legacy": Prepend + Replace normalizer)."""
    normalizer = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
    ]}
    j = spm_json(model, normalizer, None)
    save_tokenizer_json(j, "llama2_spm_bpe")
    tokenizer_config("llama2_spm_bpe", {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": None, "legacy": True, "clean_up_tokenization_spaces": False,
        "model_max_length": 4096, "padding_side": "right", "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer"}, j)


def make_mistral_spm_metaspace(model):
    """Same model, the non-legacy layout (transformers' LlamaConverter with legacy=False, as in
    Mistral-7B-v0.3 and re-converted Llama-2 files): no normalizer, Metaspace pre-tokenizer
    with prepend_scheme "first" and split false."""
    pre = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    j = spm_json(model, None, pre)
    save_tokenizer_json(j, "mistral_spm_metaspace")
    tokenizer_config("mistral_spm_metaspace", {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": None, "legacy": False, "add_prefix_space": True,
        "clean_up_tokenization_spaces": False, "model_max_length": 32768, "padding_side": "left",
        "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer"}, j)


def make_unigram():
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.UnigramTrainer(vocab_size=600, show_progress=False, special_tokens=specials,
                                      unk_token="<unk>", max_piece_length=12)
    tok.train_from_iterator(train_lines(), trainer)
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    assert [p for p, _ in vocab[:4]] == specials, vocab[:4]
    have = {p for p, _ in vocab}
    # Byte pieces right after the specials with score 0.0, as a sentencepiece model with
    # byte_fallback converts (its BYTE pieces have score 0).
    vocab = vocab[:4] + [[b, 0.0] for b in BYTE_TOKENS if b not in have] + vocab[4:]
    j["model"] = {"type": "Unigram", "unk_id": 3, "vocab": vocab, "byte_fallback": True}
    j["added_tokens"] = [added_token(i, t) for i, t in enumerate(specials)]
    j["post_processor"] = template("<bos> $A", "<bos> $A <bos>:1 $B:1", {"<bos>": 2})
    j["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"},
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True},
    ]}
    save_tokenizer_json(j, "unigram")
    tokenizer_config("unigram", {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
        "model_max_length": 8192, "tokenizer_class": "PreTrainedTokenizerFast"}, j)


def make_wordpiece():
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=500, show_progress=False, special_tokens=specials,
                                        limit_alphabet=150)
    tok.train_from_iterator(train_chunks(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece(prefix="##")
    j = json.loads(tok.to_str())
    save_tokenizer_json(j, "wordpiece")
    tokenizer_config("wordpiece", {
        "do_lower_case": True, "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
        "unk_token": "[UNK]", "mask_token": "[MASK]", "tokenize_chinese_chars": True, "strip_accents": None,
        "clean_up_tokenization_spaces": True, "model_max_length": 512, "tokenizer_class": "BertTokenizer"}, j)


NAMES = ["gpt2_bpe", "llama3_bpe", "llama2_spm_bpe", "mistral_spm_metaspace", "unigram", "wordpiece"]


def bench(corpus, repeats=3):
    """Median of `repeats` single-threaded encodes of the whole corpus, each on a freshly loaded
    Tokenizer (so the BPE word cache starts cold). Reports wall time and the process's CPU time
    (the latter is steadier on a shared machine)."""
    mb = len(corpus.encode("utf-8")) / 1e6
    print("single-thread encode of corpus_mixed.txt (%.3f MB), median of %d, fresh Tokenizer each time:"
          % (mb, repeats))
    for name in NAMES:
        wall, cpu = [], []
        for _ in range(repeats):
            tok = Tokenizer.from_file(os.path.join(HERE, name, "tokenizer.json"))
            t0, c0 = time.perf_counter(), time.process_time()
            tok.encode(corpus, add_special_tokens=False)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        print("  %-24s wall %6.2f MB/s  cpu %6.2f MB/s  (wall s: %s)" % (
            name, mb / statistics.median(wall), mb / statistics.median(cpu), ", ".join("%.3f" % t for t in wall)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", action="store_true", help="also time single-threaded HF encoding")
    ap.add_argument("--bench-only", action="store_true", help="only time, from the files as they are")
    ap.add_argument("--check", action="store_true",
                    help="train nothing, write nothing: check the shipped expected files against this "
                         "library version on the shipped tokenizer.json files (exit 1 on a mismatch)")
    ap.add_argument("--expected-only", action="store_true",
                    help="train nothing: rewrite the expected files from the shipped tokenizer.json files")
    args = ap.parse_args()
    print("tokenizers", tokenizers.__version__, "python", sys.version.split()[0])
    # Training is not bit-reproducible (the library breaks some ties in hash-map order), so a
    # full run rewrites tokenizer.json and everything derived from it together.
    if not (args.bench_only or args.check or args.expected_only):
        corpus = make_corpus()
        with open(os.path.join(HERE, "corpus_mixed.txt"), "w", encoding="utf-8", newline="") as f:
            f.write(corpus)
        make_gpt2_bpe()
        make_llama3_bpe()
        spm_model = make_spm_bpe()
        make_llama2_spm_bpe(spm_model)
        make_mistral_spm_metaspace(spm_model)
        make_unigram()
        make_wordpiece()
    with open(os.path.join(HERE, "corpus_mixed.txt"), encoding="utf-8", newline="") as f:
        corpus = f.read()
    assert corpus == make_corpus(), "corpus_mixed.txt is not what make_corpus() gives"
    if args.check:
        ok = all([check_expected(name, corpus) for name in NAMES])
        print("check:", "all expected files match" if ok else "MISMATCHES")
        sys.exit(0 if ok else 1)
    if not args.bench_only:
        for name in NAMES:
            write_expected(name, corpus)
    if args.bench or args.bench_only:
        bench(corpus)


if __name__ == "__main__":
    main()
