"""Text as token ids: a word tokenizer with a vocabulary built from the training pool, and a
generated topic-classification corpus that runs offline.

Token id 0 is padding and 1 is out-of-vocabulary; texts are truncated or zero-padded to a fixed
length, so text clients stack like images. No TensorFlow is needed.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Sequence

import numpy as np

from fedjax_pfedes.errors import ConfigError

PAD_ID = 0
OOV_ID = 1
_WORD = re.compile(r"[a-z0-9']+")


def words(text: str | bytes) -> list[str]:
    """Lower-cased words (letters, digits, apostrophes) of a text."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return _WORD.findall(text.lower())


def build_vocabulary(texts: Iterable[str | bytes], vocab_size: int) -> dict[str, int]:
    """The `vocab_size - 2` most frequent words, ids from 2 (ties broken alphabetically)."""
    if vocab_size < 3:
        raise ConfigError(f"config.data.text_vocab_size must be >= 3, got {vocab_size}")
    counts = collections.Counter(w for t in texts for w in words(t))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 2]
    return {w: i + 2 for i, (w, _) in enumerate(ranked)}


def encode(texts: Sequence[str | bytes], vocabulary: dict[str, int], max_length: int
           ) -> np.ndarray:
    """Token ids [len(texts), max_length]: truncated, unknown words -> 1, padded with 0."""
    if max_length < 1:
        raise ConfigError(f"config.data.text_max_length must be >= 1, got {max_length}")
    ids = np.zeros((len(texts), max_length), np.int32)
    for row, t in enumerate(texts):
        toks = [vocabulary.get(w, OOV_ID) for w in words(t)[:max_length]]
        ids[row, : len(toks)] = toks
    return ids


def synthetic_topic_corpus(num_docs: int, num_classes: int, vocab_size: int, max_length: int,
                           seed: int, topic_share: float = 0.2, topic_words: int = 300,
                           topic_concentration: float = 0.1
                           ) -> tuple[np.ndarray, np.ndarray]:
    """A generated topic-classification corpus (token ids, labels); no real text.

    Generative model: a background distribution over the vocabulary follows Zipf's law (shared by
    all classes); each class has a topic distribution ~ Dirichlet(`topic_concentration`) over a
    common pool of `topic_words` ids, so classes share topical words with different weights. A
    document of class c has a length ~ U(max_length / 4, max_length); each token comes from c's
    topic with probability `topic_share`, else from the background. Labels are balanced.
    """
    rng = np.random.default_rng(seed)
    ids = np.arange(2, vocab_size)
    background = 1.0 / np.arange(1, len(ids) + 1)
    background /= background.sum()
    pool = rng.choice(ids, size=min(topic_words, len(ids)), replace=False)
    topics = rng.dirichlet(np.full(len(pool), topic_concentration), size=num_classes)
    labels = rng.permutation(np.arange(num_docs) % num_classes)
    lengths = rng.integers(max(max_length // 4, 1), max_length + 1, size=num_docs)
    x = np.zeros((num_docs, max_length), np.int32)
    for d in range(num_docs):
        n = lengths[d]
        from_topic = rng.random(n) < topic_share
        toks = rng.choice(ids, size=n, p=background)
        toks[from_topic] = rng.choice(pool, size=int(from_topic.sum()), p=topics[labels[d]])
        x[d, :n] = toks
    return x, labels.astype(np.int64)
