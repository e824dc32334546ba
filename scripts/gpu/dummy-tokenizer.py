# A word-level tokenizer.json for dummy weights (scripts/gpu/serve.sh, coldstart.sh): the bench's
# word list, then w0, w1, ... up to the vocabulary size, so one bench word is one token.
# usage: python3 scripts/gpu/dummy-tokenizer.py MODEL_DIR VOCAB
import json, re, sys
words = re.findall(r'^\s*"([^"\\]+)",$', open("crates/pdnode-bench/src/text.rs").read(), re.M)
vocab, seen = {}, set()
for w in ["<unk>"] + words:
    if w not in seen:
        seen.add(w); vocab[w] = len(vocab)
i = 0
while len(vocab) < int(sys.argv[2]):
    vocab.setdefault(f"w{i}", len(vocab)); i += 1
tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
       "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
       "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
json.dump(tok, open(sys.argv[1] + "/tokenizer.json", "w"))
print("tokenizer.json:", len(words), "bench words,", len(vocab), "entries")
