"""The Qwen2 byte-level BPE tokenizer of a Qwen3-ASR checkpoint, on the `tokenizers` library.

Read from the checkpoint's own files: `tokenizer.json` when it is there, otherwise `vocab.json` +
`merges.txt` + the added tokens of `tokenizer_config.json` assembled exactly as transformers'
Qwen2 converter does (NFC, the Qwen2 pre-tokenizer regex, byte-level BPE and decoding). No
transformers at run time.

`QWEN2_PRETOKENIZE_REGEX`, `bytes_to_unicode` and `tokenizer_json` are also what `tiny.py` writes
checkpoints with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ...shared.errors import ModelError

QWEN2_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
AUDIO_START = "<|audio_start|>"
AUDIO_END = "<|audio_end|>"
AUDIO_PAD = "<|audio_pad|>"
ASR_TEXT = "<asr_text>"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies use."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


@dataclass(frozen=True)
class AddedToken:
    """One entry of `added_tokens_decoder`: a token matched before BPE, with a fixed id."""

    id: int
    content: str
    special: bool  # special tokens are dropped by decode(skip_special_tokens=True)


def tokenizer_json(vocab: dict[str, int], merges: list[tuple[str, str]],
                   added: list[AddedToken]) -> dict[str, Any]:
    """A `tokenizer.json` document for a Qwen2 byte-level BPE (what Qwen2TokenizerFast saves)."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": t.id, "content": t.content, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": t.special}
                         for t in sorted(added, key=lambda t: t.id)],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_PRETOKENIZE_REGEX}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": [list(m) for m in merges]},
    }


class Tokenizer:
    """Text <-> token ids for one checkpoint. Added tokens (`<|im_start|>`, `<asr_text>`, ...) are
    recognised in text; nothing is prepended or appended."""

    def __init__(self, backend, added: list[AddedToken]):
        self._tk = backend
        self.added = {t.content: t for t in added}
        self.added_ids = frozenset(t.id for t in added)
        # the backend renumbers added tokens that do not follow the vocabulary contiguously: a
        # checkpoint whose ids would shift is refused rather than silently misread
        for t in added:
            got = backend.token_to_id(t.content)
            if got != t.id:
                raise ModelError(f"tokenizer: added token {t.content!r} has id {got}, the checkpoint "
                                 f"says {t.id} (vocabulary ids are not contiguous)")

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load from a checkpoint directory (tokenizer.json, or vocab.json + merges.txt)."""
        from tokenizers import Tokenizer as Backend

        d = Path(path)
        config = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").exists() else {}
        if (d / "tokenizer.json").exists():
            doc = _read_json(d / "tokenizer.json")
            added = [AddedToken(int(t["id"]), t["content"], bool(t.get("special", False)))
                     for t in doc.get("added_tokens", [])]
            backend = Backend.from_str(json.dumps(doc))
            return cls(backend, added)
        if not (d / "vocab.json").exists() or not (d / "merges.txt").exists():
            raise ModelError(f"{d}: no tokenizer.json and no vocab.json + merges.txt")
        vocab = _read_json(d / "vocab.json")
        merges = _read_merges(d / "merges.txt")
        added = [AddedToken(int(i), t["content"], bool(t.get("special", False)))
                 for i, t in config.get("added_tokens_decoder", {}).items()]
        backend = Backend.from_str(json.dumps(tokenizer_json(vocab, merges, added)))
        return cls(backend, added)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, added tokens matched literally."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD; ids outside the vocabulary are dropped."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token contributes to `decode(..., skip_special_tokens=True)`: special
        tokens and ids outside the vocabulary give b"". Streaming text is built from these, so a
        character split across tokens is never shown half-decoded."""
        token = self._tk.id_to_token(int(token_id))
        if token is None:
            return b""
        added = self.added.get(token)
        if added is not None and added.id == token_id:
            return b"" if added.special else token.encode("utf-8")
        table = _unicode_to_bytes()
        try:
            return bytes(table[c] for c in token)
        except KeyError:  # not byte-level BPE (a filler such as `--vocab small`'s "␀unused447"): its text
            return token.encode("utf-8")

    def encode_byte(self, byte: int) -> int | None:
        """The id of the vocabulary token that is exactly one byte (None if there is none)."""
        return self._tk.token_to_id(bytes_to_unicode()[byte])

    def token_id(self, token: str) -> int:
        """Id of a single (added or vocabulary) token; ModelError if the checkpoint lacks it."""
        i = self._tk.token_to_id(token)
        if i is None:
            raise ModelError(f"tokenizer has no token {token!r}")
        return i

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: unreadable ({e})") from e


def _read_merges(path: Path) -> list[tuple[str, str]]:
    merges = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line or line.startswith("#version"):
            continue
        left, right = line.split(" ")
        merges.append((left, right))
    return merges
