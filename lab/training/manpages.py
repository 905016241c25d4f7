"""Sentences of the manual pages: a training text source written far from meeting talk and fortunes.

synth-en's out-of-distribution set (`ood.py`: Debian package descriptions, Vim's user manual, the
Info manuals) read at 32-34% WER against ~15% on held-out sentences of the training sources' kinds:
the decoder has learnt the phrasing of its sources, not English. The manual pages on a Debian
machine (/usr/share/man, ~18,000 pages in sections 1, 5, 7 and 8) are a large body of plain technical
English of another kind. Their prose is read here from the roff source:

- the text lines of a page and the words of the font macros (`.B word`, `.IR a b`) make paragraphs;
  a paragraph ends at a paragraph, section or list macro, and a no-fill block (`.nf` ... `.fi`: an
  example) and the tag line after `.TP` (an option's name) are left out; any other macro ends the
  paragraph too (a sentence that runs through one is not read whole);
- roff's escapes become their characters or nothing (fonts, sizes, strings, comments);
- a sentence qualifies by `ood_sources.plain`'s rule (plain speakable English: 5-25 words, each a WordNet
  lemma, an inflection or a function word, no names), so options, paths and program names drop out.

None of the out-of-distribution set's sources may leak into training: a sentence any of its four
sources has (by `text.key`) is dropped, so the set still measures text training never read. The
held-out share (`text.is_held_out`) is kept out as for every source.
"""

from __future__ import annotations

import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

from harken.training import ood_sources, text
from harken.training.ood_sources import OOD_FILE
from harken.training.text import CorpusTextError

MAN_DIR = Path("/usr/share/man")
SECTIONS = ("man1", "man5", "man7", "man8")

_BREAKS = frozenset("PP P LP SH SS IP HP sp br RS RE in ti ce bp ne Sh Ss Pp Bl El It Bd Ed Dl TS TE EX EE".split())
_FONT_MACROS = frozenset("B I SM SB".split())
_ALTERNATING = frozenset("BR RB IR RI BI IB".split())
_NAMED = {"em": ", ", "en": "-", "aq": "'", "lq": '"', "rq": '"', "oq": "'", "cq": "'", "dq": '"',
          "hy": "-", "mi": "-", "bu": "", "co": "", "rg": "", "tm": "", "dg": "", "ti": "~", "ha": "^"}
_ESCAPES = re.compile(r"""\\(?:
      f(?:\[[^\]]*\]|\(..|.)            # fonts
    | s[-+]?(?:\d|\(\d\d|\[\d+\])       # sizes
    | \*(?:\[[^\]]*\]|\(..|.)           # strings
    | \((?P<two>..)                     # named glyphs \(em
    | \[(?P<long>[^\]]*)\]              # named glyphs \[em]
    | (?P<one>.)                        # one character: \- \e \& ...
)""", re.VERBOSE)


def _escape(m: re.Match) -> str:
    name = m.group("two") or m.group("long")
    if name is not None:
        return _NAMED.get(name, "")
    one = m.group("one")
    if one is None:  # a font, size or string
        return ""
    return {"-": "-", "e": "\\", " ": " ", "~": " ", "0": " ", "'": "'", "`": "'", ".": "."}.get(one, "")


def roff_text(line: str) -> str:
    """One roff text line with its escapes resolved and its comment cut."""
    line = line.split('\\"', 1)[0]
    return _ESCAPES.sub(_escape, line)


def paragraphs(source: str) -> list[str]:
    """The prose paragraphs of one page's roff source (see the module's description)."""
    out: list[str] = []
    current: list[str] = []
    nofill = skip_tag = False

    def end() -> None:
        if current:
            out.append(" ".join(current))
            current.clear()

    for raw in source.splitlines():
        if raw.startswith((".", "'")):
            parts = raw[1:].strip().split(None, 1)
            name = parts[0] if parts else ""
            args = parts[1] if len(parts) > 1 else ""
            if name in ("nf", "EX"):
                end()
                nofill = True
            elif name in ("fi", "EE"):
                nofill = False
            elif name == "TP":
                end()
                skip_tag = True
            elif nofill:
                continue
            elif skip_tag and name in _FONT_MACROS | _ALTERNATING:
                skip_tag = False  # the tag itself, in a font: an option's name
            elif name in _FONT_MACROS and args:
                current.append(roff_text(args.replace('"', "")))
            elif name in _ALTERNATING and args:
                current.append("".join(roff_text(a) for a in re.findall(r'"[^"]*"|\S+', args)).replace('"', ""))
            else:  # a paragraph, section or list macro, or one whose text is not prose
                end()
            continue
        if nofill:
            continue
        if skip_tag:
            skip_tag = False
            continue
        if not raw.strip():
            end()
            continue
        current.append(roff_text(raw).strip())
    end()
    return [re.sub(r"\s+", " ", p).strip() for p in out if p.strip()]


def page_sentences(source: str) -> list[str]:
    """The plain English sentences of one page (`ood_sources.plain`), in page order."""
    found = []
    for p in paragraphs(source):
        for s in text._split(p):
            if (plain := ood_sources.plain(s)) is not None:
                found.append(plain)
    return found


def page_files(directory: Path = MAN_DIR) -> list[Path]:
    """The English manual pages of sections 1, 5, 7 and 8, in name order (links and translations not)."""
    return sorted(f for s in SECTIONS for f in (directory / s).glob("*") if f.is_file() and not f.is_symlink())


@lru_cache(maxsize=1)
def ood_keys() -> frozenset[str]:
    """`text.key` of every sentence the out-of-distribution set's sources have."""
    keys: set[str] = set()
    for read in ood_sources.READERS.values():
        try:
            keys.update(text.key(s) for s in read())
        except CorpusTextError:
            continue  # a source not on this machine has nothing to leak
    keys.update(text.key(json.loads(line)["text"]) for line in OOD_FILE.read_text().splitlines() if line.strip())
    return frozenset(keys)


@lru_cache(maxsize=1)
def manpage_sentences(directory: Path = MAN_DIR) -> list[str]:
    """Distinct plain sentences of the manual pages, none an out-of-distribution source's, in page order."""
    files = page_files(directory)
    if not files:
        raise CorpusTextError(f"{directory}: no manual pages (apt-get install manpages man-db)")
    leak = ood_keys()
    seen: set[str] = set()
    out = []
    for f in files:
        try:
            raw = gzip.open(f, "rt", encoding="utf-8", errors="replace").read() if f.suffix == ".gz" \
                else f.read_text(encoding="utf-8", errors="replace")
        except (OSError, EOFError):
            continue  # a page that is not a readable file (compressed otherwise, truncated)
        if raw.startswith(".so "):
            continue  # a page that only includes another
        for s in page_sentences(raw):
            k = text.key(s)
            if k not in seen and k not in leak:
                seen.add(k)
                out.append(s)
    return out


def training_sentences() -> list[str]:
    """The man pages' sentences that training may read (the held-out share kept out)."""
    return text.split(manpage_sentences())[0]
