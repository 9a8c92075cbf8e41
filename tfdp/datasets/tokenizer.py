"""A small WordPiece tokenizer (BERT's uncased basic + greedy longest-match-first) over a vocab file."""

import collections
from typing import Iterable, Mapping
import unicodedata

import numpy as np

from tfdp import errors

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL = (PAD, UNK, CLS, SEP, MASK)


def _is_punctuation(ch):
  cp = ord(ch)
  if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
    return True
  return unicodedata.category(ch).startswith("P")


def basic_tokenize(text: str) -> list[str]:
  """Lower-cases, strips accents and splits on whitespace and punctuation (BERT's BasicTokenizer)."""
  text = unicodedata.normalize("NFD", text.lower())
  words, current = [], []
  for ch in text:
    cat = unicodedata.category(ch)
    if cat == "Mn" or ch == "\ufffd" or (cat.startswith("C") and not ch.isspace()):
      continue
    if ch.isspace():
      if current:
        words.append("".join(current))
        current = []
    elif _is_punctuation(ch) or 0x4E00 <= ord(ch) <= 0x9FFF:
      if current:
        words.append("".join(current))
        current = []
      words.append(ch)
    else:
      current.append(ch)
  if current:
    words.append("".join(current))
  return words


def load_vocab(path: str | None) -> dict[str, int]:
  """token -> id from a WordPiece vocab file (one token per line, id = line number).

  Raises:
    ConfigError: the file is missing or lacks a special token.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if not path or not tf.io.gfile.exists(path):
    raise errors.ConfigError(
        f"WordPiece vocabulary file {path!r} not found; pass --vocab_file=PATH "
        "(one token per line, as BERT's vocab.txt; scripts/make_dataset.py "
        "--modality=text writes one next to its corpus).")
  with tf.io.gfile.GFile(path, "r") as f:
    tokens = [line.rstrip("\n") for line in f]
  vocab = {t: i for i, t in enumerate(tokens) if t}
  missing = [t for t in SPECIAL if t not in vocab]
  if missing:
    raise errors.ConfigError(
        f"Vocabulary {path} lacks the special tokens {missing}; a BERT vocabulary "
        f"needs {', '.join(SPECIAL)}.")
  return vocab


class WordPiece:
  """Text -> BERT input ids: `[CLS] pieces... [SEP]`, padded or truncated to `seq_len`."""

  def __init__(self, vocab: str | Mapping[str, int] | None, max_chars_per_word: int = 100):
    """`vocab` is a vocab file (see `load_vocab`; None raises its ConfigError) or token -> id."""
    self.vocab = dict(vocab) if isinstance(vocab, Mapping) else load_vocab(vocab)
    self.max_chars = max_chars_per_word
    self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
        self.vocab[t] for t in SPECIAL)

  @property
  def vocab_size(self) -> int:
    return max(self.vocab.values()) + 1

  def word_pieces(self, word: str) -> list[str]:
    """Greedy longest-match-first split of one word; [UNK] if it cannot be split."""
    if len(word) > self.max_chars:
      return [UNK]
    pieces, start = [], 0
    while start < len(word):
      end = len(word)
      while end > start:
        piece = word[start:end] if start == 0 else "##" + word[start:end]
        if piece in self.vocab:
          break
        end -= 1
      if end == start:
        return [UNK]
      pieces.append(piece)
      start = end
    return pieces

  def tokenize(self, text: str) -> list[str]:
    return [p for w in basic_tokenize(text) for p in self.word_pieces(w)]

  def encode(self, text: str | bytes, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [seq_len], mask int32 [seq_len]) of one text."""
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    pieces = self.tokenize(text)[:seq_len - 2]
    ids = [self.cls_id] + [self.vocab[p] for p in pieces] + [self.sep_id]
    out = np.full(seq_len, self.pad_id, np.int32)
    out[:len(ids)] = ids
    mask = np.zeros(seq_len, np.int32)
    mask[:len(ids)] = 1
    return out, mask


def build_vocab(texts: Iterable[str], size: int = 2000) -> list[str]:
  """A WordPiece vocabulary for `texts`: special tokens, every character (alone and as ##suffix), then the commonest words.

  Every word of `texts` is thus encodable without [UNK]. (A real vocabulary
  is learnt with the WordPiece algorithm; this suffices for tests and demos.)
  """
  words = collections.Counter(w for t in texts for w in basic_tokenize(t))
  chars = sorted({c for w in words for c in w})
  vocab = list(SPECIAL) + chars + ["##" + c for c in chars]
  for w, _ in words.most_common():
    if len(vocab) >= size:
      break
    if len(w) > 1:
      vocab.append(w)
  return vocab
