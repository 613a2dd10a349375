"""A tiny tokenizer and a small `c4_test`-style dataset for torchtitan's debug model, made on demand.

torchtitan's llama3 debug config reads a Hugging Face tokenizer (`tokenizer.json` +
`tokenizer_config.json`) and the `c4_test` dataset from its source tree; neither ships in the
wheel.  We make both, deterministically, from a seeded Markov chain over a fixed made-up
vocabulary (no downloads, nothing binary committed):

    ASSETS/tokenizer/tokenizer.json, tokenizer_config.json   word-level, < 2048 ids (the debug model's vocab)
    ASSETS/c4_test/c4-train.json                              JSON lines {"text": ...}, NUM_DOCS documents (a new epoch, reshuffled by torchtitan, starts at step 8 on 1 rank)

`make_assets(folder)` writes them once (atomically, so two ranks starting together are safe) and
returns the folder; a folder that already holds them is left as it is.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

NUM_WORDS = 900          # words in the made-up vocabulary (+ 3 special tokens: well under 2048)
NUM_DOCS = 24            # documents in c4_test: about 7 steps of data, so torchtitan reshuffles (a new epoch) within a 10-step run
BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "zi", "po", "da", "fe", "gu", "hi", "jo")


def _vocabulary() -> list[str]:
    """NUM_WORDS distinct made-up words, the same list on every call."""
    rng = random.Random(20261206)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < NUM_WORDS:
        word = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def _documents(words: list[str]) -> list[str]:
    """NUM_DOCS texts from a sparse random Markov chain over `words` (so there is something to learn)."""
    rng = random.Random(7)
    successors = [[rng.randrange(len(words)) for _ in range(4)] for _ in words]
    docs = []
    for _ in range(NUM_DOCS):
        current = rng.randrange(len(words))
        text = []
        for _ in range(rng.randint(40, 240)):
            text.append(words[current])
            current = rng.choice(successors[current]) if rng.random() < 0.9 else rng.randrange(len(words))
        docs.append(" ".join(text) + ".")
    return docs


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def make_assets(folder: str | os.PathLike) -> Path:
    """Write the tokenizer and the dataset under `folder` (if not there yet) and return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = Path(folder)
    tokenizer_json = folder / "tokenizer" / "tokenizer.json"
    data_file = folder / "c4_test" / "c4-train.json"
    if tokenizer_json.exists() and data_file.exists():
        return folder
    words = _vocabulary()
    vocab = {token: i for i, token in enumerate([BOS, EOS, UNK, *words, "."])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    _write_atomically(tokenizer_json, tokenizer.to_str())
    _write_atomically(folder / "tokenizer" / "tokenizer_config.json", json.dumps({
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK,
        "add_bos_token": False, "add_eos_token": False,
    }))
    _write_atomically(data_file, "".join(json.dumps({"text": doc}) + "\n" for doc in _documents(words)))
    return folder
