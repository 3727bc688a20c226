#!/usr/bin/env python3
"""Makes the chat-template fixtures in this directory (provenance; run by hand, never by the build).

    python3 -m venv /tmp/hfv5 && /tmp/hfv5/bin/pip install transformers==5.25.0 jinja2==3.1.6
    /tmp/hfv5/bin/python tests/data/chat_templates/make_fixtures.py           # rewrite everything
    /tmp/hfv5/bin/python tests/data/chat_templates/make_fixtures.py --bench   # also time HF's rendering

For each template <name>.jinja (see README.md) it writes <name>_tokenizer/: the tokenizer of
tests/data/tokenizers/llama3_bpe with every special token the template emits added to it
(HF `tokenizers`), and a tokenizer_config.json with the family's bos/eos/... tokens and the
template as "chat_template". Then, for each conversation of CONVERSATIONS, one line of
expected.jsonl from transformers' AutoTokenizer on that directory:
  template, case, messages, add_generation_prompt,
  text   apply_chat_template(messages, tokenize=False, add_generation_prompt=...)
  ids    apply_chat_template(messages, tokenize=True, ...)["input_ids"]
  error  instead of text and ids when the template raises: the exception's message
  assistant_spans  for each assistant message i: {"index": i, "text": the part of
         render(messages[:i+1]) after render(messages[:i], add_generation_prompt=True)},
         or "text": null when the shorter render is not a prefix of the longer one
and, for generation.jinja (a small template of ours with {% generation %} marks), the
assistant spans transformers records for return_assistant_tokens_mask, as UTF-8 byte offsets:
  generation_spans  [[begin, end), ...]
"""

import argparse
import json
import os
import pathlib
import shutil
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

import tokenizers  # noqa: E402
import transformers  # noqa: E402
from tokenizers import AddedToken, Tokenizer  # noqa: E402
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
BASE_TOKENIZER = HERE.parent / "tokenizers" / "llama3_bpe" / "tokenizer.json"

# name: the tokenizer_config.json special tokens, and the added tokens the template emits
# (special=True unless listed in "plain": Qwen3's <think> tokens are not special).
FAMILIES = {
    "llama3": {
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "added": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
    },
    "qwen2_5": {
        "config": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "added": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    },
    "qwen3": {
        "config": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "added": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        "plain": ["<think>", "</think>"],
    },
    "mistral": {
        "config": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "added": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"],
    },
    "gemma2": {
        "config": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
        "added": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
    },
    "phi3": {
        "config": {"bos_token": "<s>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                   "unk_token": "<unk>"},
        "added": ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>"],
    },
    # Ours (not a model's): Qwen-style turns with {% generation %} around the assistant text.
    "generation": {
        "config": {"bos_token": None, "eos_token": "<|im_end|>"},
        "added": ["<|im_start|>", "<|im_end|>"],
    },
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CONVERSATIONS = {
    "system_user_assistant": [
        SYSTEM,
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "2+2 equals 4."},
    ],
    "multi_turn": [
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven is prime."},
        {"role": "user", "content": "And an even one?"},
        {"role": "assistant", "content": "Two is the only even prime."},
    ],
    "non_ascii": [
        {"role": "user", "content": "Grüße! Wie viele Menschen leben in 東京? 🚀"},
        {"role": "assistant", "content": "Über 14 Millionen — 约1400万人。✨ Ça va?"},
    ],
    "empty_assistant": [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
    ],
    "generation_prompt": [
        SYSTEM,
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke about tensors."},
    ],
    "whitespace": [
        {"role": "user", "content": "  padded question\n"},
        {"role": "assistant", "content": "\n  an answer with spaces  \n"},
    ],
    "think_in_content": [
        {"role": "user", "content": "What is 3*3?"},
        {"role": "assistant", "content": "<think>\nThree threes.\n</think>\n\n3*3 = 9."},
    ],
    "reasoning_field": [
        {"role": "user", "content": "What is 5-1?"},
        {"role": "assistant", "content": "Four.", "reasoning_content": "5 minus 1 is 4."},
        {"role": "user", "content": "And 5-2?"},
    ],
    "null_keys": [
        {"role": "user", "content": "Ping?"},
        {"role": "assistant", "content": "Pong.", "tool_calls": None},
    ],
    "roles_not_alternating": [
        {"role": "user", "content": "First."},
        {"role": "user", "content": "Second."},
    ],
}


def make_tokenizer_dir(name, family, template):
    out = HERE / f"{name}_tokenizer"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    tok = Tokenizer.from_file(str(BASE_TOKENIZER))
    plain = set(family.get("plain", []))
    for content in family["added"]:
        if tok.token_to_id(content) is None:
            if content in plain:
                tok.add_tokens([AddedToken(content, special=False, normalized=False)])
            else:
                tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    decoder = {}
    for entry in json.loads((out / "tokenizer.json").read_text())["added_tokens"]:
        decoder[str(entry["id"])] = {key: entry[key] for key in
                                     ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
    config = dict(family["config"])
    config.update({
        "added_tokens_decoder": decoder,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out


def render(tokenizer, messages, add_generation_prompt):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer, messages):
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i == 0:
            continue
        try:
            before = render(tokenizer, messages[:i], True)
            after = render(tokenizer, messages[: i + 1], False)
        except Exception:  # noqa: BLE001 (a prefix the template refuses)
            continue
        spans.append({"index": i, "text": after[len(before):] if after.startswith(before) else None})
    return spans


def byte_offset(text, i):
    return len(text[:i].encode("utf-8"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", action="store_true", help="time apply_chat_template(tokenize=False)")
    parser.add_argument("--renders", type=int, default=2000)
    args = parser.parse_args()
    print(f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")
    lines, work = [], []
    for name, family in FAMILIES.items():
        template = (HERE / f"{name}.jinja").read_text(encoding="utf-8")
        directory = make_tokenizer_dir(name, family, template)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
        for case, messages in CONVERSATIONS.items():
            add_generation_prompt = messages[-1]["role"] == "user"
            line = {"template": name, "case": case, "messages": messages,
                    "add_generation_prompt": add_generation_prompt}
            try:
                line["text"] = render(tokenizer, messages, add_generation_prompt)
                ids = tokenizer.apply_chat_template(messages, tokenize=True,
                                                    add_generation_prompt=add_generation_prompt)
                line["ids"] = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
                work.append((tokenizer, messages, add_generation_prompt))
            except Exception as error:  # noqa: BLE001
                line["error"] = getattr(error, "message", None) or str(error)
            line["assistant_spans"] = assistant_spans(tokenizer, messages)
            if name == "generation" and "text" in line:
                text, indices = render_jinja_template(
                    conversations=[messages], chat_template=template, return_assistant_tokens_mask=True,
                    add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens_map)
                assert text[0] == line["text"]
                line["generation_spans"] = [[byte_offset(text[0], b), byte_offset(text[0], e)] for b, e in indices[0]]
            lines.append(line)
    with open(HERE / "expected.jsonl", "w", encoding="utf-8") as out:
        for line in lines:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    print(f"expected.jsonl: {len(lines)} lines, {sum('error' in l for l in lines)} raising")
    if args.bench:
        start = time.perf_counter()
        for i in range(args.renders):
            tokenizer, messages, add_generation_prompt = work[i % len(work)]
            render(tokenizer, messages, add_generation_prompt)
        seconds = time.perf_counter() - start
        print(f"HF apply_chat_template(tokenize=False): {args.renders} renders over {len(work)} conversations "
              f"in {seconds:.3f} s = {args.renders / seconds:.0f} records/s (one thread)")


if __name__ == "__main__":
    main()
