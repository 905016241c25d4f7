"""The four kinds of English the out-of-distribution set (`ood.py`) draws from, and the rule a
sentence of theirs must pass (`plain`). Apart from the set so that a training source (`manpages`)
can keep every one of their sentences out of training without importing the corpus.
"""

from __future__ import annotations

import gzip
import re
import subprocess
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from harken.training import text
from harken.training.text import CorpusTextError

OOD_FILE = Path(__file__).with_name("ood.jsonl")  # the set itself (`ood.py` writes it)
MIN_WORDS, MAX_WORDS = 5, 25

DPKG_STATUS = Path("/var/lib/dpkg/status")
APT_LISTS = Path("/var/lib/apt/lists")
APT_HELPER = "/usr/lib/apt/apt-helper"  # `cat-file` reads apt's index in whatever compression it has
VIM_DOCS = "/usr/share/vim/vim*/doc/usr_*.txt"
INFO_DIR = Path("/usr/share/info")

FUNCTION_WORDS = frozenset("""a an the and or but nor so yet for of to in on at by with from into onto upon
about above below over under between among through during before after since until while as than that this
these those there here where when why how what which who whom whose whether if then else not no yes all any
each every some many much more most few less least other another such own same both either neither i me my
mine we us our ours you your yours he him his she her hers it its they them their theirs is are was were be
been being am do does did done have has had having will would shall should can could may might must also
only just very too even still again ever never always often once twice itself themselves yourself
yourselves ourselves himself herself myself within without against toward towards via per instead unless
although though because it's don't doesn't didn't isn't aren't wasn't weren't can't couldn't won't
wouldn't shouldn't you're we're they're i'm i've you've we've they've let's that's there's here's what's
who's he's she's i'll you'll we'll they'll i'd you'd""".split())
AVOID_WORDS = frozenset("license licence licensed licenses copyright warranty".split())  # no legalese
_CHARS = re.compile(r"^[A-Za-z ,.;:!?'-]+$")
_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_SUFFIXES = (("s", ""), ("es", ""), ("ies", "y"), ("ed", ""), ("ed", "e"), ("ied", "y"), ("ing", ""),
             ("ing", "e"), ("ly", ""), ("er", ""), ("er", "e"), ("est", ""), ("ers", ""), ("'s", ""), ("d", ""))


@lru_cache(maxsize=1)
def lemmas() -> frozenset[str]:
    """WordNet's one-word lemmas and irregular forms (Debian `wordnet-base`): the plain-word list."""
    out: set[str] = set()
    for pos in ("noun", "verb", "adj", "adv"):
        for name in (f"index.{pos}", f"{pos}.exc"):
            path = text.WORDNET_DIR / name
            if not path.is_file():
                raise CorpusTextError(f"{path}: missing (apt-get install wordnet-base)")
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                w = line.split(" ", 1)[0]
                if line[:1] != " " and w and "_" not in w:
                    out.add(w)
    return frozenset(out)


def known(word: str) -> bool:
    """A function word, a WordNet lemma or a regular inflection of one (lower case)."""
    words = lemmas()
    if word in FUNCTION_WORDS or word in words:
        return True
    for suffix, stem in _SUFFIXES:
        if word.endswith(suffix) and len(word) > len(suffix) + 1 and word[:-len(suffix)] + stem in words:
            return True
    base = re.sub(r"(ed|ing)$", "", word)  # stopped, running
    return base != word and len(base) > 2 and base[-1] == base[-2] and base[:-1] in words


def plain(sentence: str) -> str | None:
    """One candidate sentence -> itself with its spaces tidied, or None unless it is plain English."""
    s = re.sub(r"\s+", " ", sentence.replace('"', "")).strip()
    if not s or not _CHARS.match(s) or s[-1] not in ".!?" or not s[0].isupper():
        return None
    words = s.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or "--" in s:
        return None
    for i, raw in enumerate(words):
        w = raw.rstrip(",.;:!?")
        if not w or not w[0].isalpha() or not w[-1].isalpha() or any(c in w for c in ",.;:!?"):
            return None
        if (i > 0 and w[0].isupper() and w != "I") or any(c.isupper() for c in w[1:]):
            return None  # names of programs, acronyms, CamelCase
        lower = w.lower()
        if lower in AVOID_WORDS or (len(lower) == 1 and lower not in ("a", "i")):
            return None  # single letters: key names and commands in the manuals
        parts = lower.split("-")
        if len(parts) > 2 or not all(part and known(part) for part in parts):
            return None  # "ever-growing" is a word, "node-browser-pack" a name
    return s


# --- the sources -------------------------------------------------------------------------------

def _paragraphs(body: str, example: tuple[str, ...]) -> list[str]:
    """Runs of prose lines: a blank line or an indented example line (or a Vim line ending in `>`,
    which announces one) ends a paragraph."""
    out: list[str] = []
    current: list[str] = []
    for line in body.splitlines():
        if not line.strip() or line.startswith(example):
            out.append(" ".join(current))
            current = []
        else:
            current.append(line.strip().removesuffix(" >") if line.rstrip() != ">" else "")
    out.append(" ".join(current))
    return [p for p in out if p.strip()]


def _sentences(paragraphs: list[str]) -> list[str]:
    return [s for p in paragraphs for s in _SPLIT.split(re.sub(r"\s+", " ", p).strip()) if s]


def _descriptions(control: str) -> list[tuple[str, str]]:
    """(summary, long description) of each stanza of a dpkg/apt control file."""
    out = []
    for m in re.finditer(r"^Description: (.*)\n((?:[ \t].*\n?)*)", control, re.M):
        out.append((m.group(1).strip(), m.group(2)))
    return out


def debian_descriptions(path: Path = DPKG_STATUS) -> list[str]:
    """Sentences of the installed packages' long descriptions (their prose paragraphs, not the
    indented lists and examples)."""
    if not path.is_file():
        raise CorpusTextError(f"{path}: no dpkg status file (not a Debian system)")
    paragraphs: list[str] = []
    for _, body in _descriptions(path.read_text(encoding="utf-8", errors="replace")):
        current: list[str] = []
        for line in body.splitlines():
            line = line[1:]
            if line.strip() == "." or line[:1] in (" ", "\t"):
                paragraphs.append(" ".join(current))
                current = []
            else:
                current.append(line)
        paragraphs.append(" ".join(current))
    return _sentences(paragraphs)


def apt_index_files(lists: Path = APT_LISTS) -> list[Path]:
    """apt's `main` package indexes of the release itself (not -updates, -security, -backports:
    they change from week to week)."""
    out = []
    for p in sorted(lists.glob("*_dists_*_main_binary-*_Packages*")):
        m = re.search(r"_dists_([^_]+)_main_binary-", p.name)
        if m and "-" not in m.group(1) and not p.name.endswith((".diff_Index", ".IndexDiff")):
            out.append(p)
    return out


def debian_summaries(lists: Path = APT_LISTS) -> list[str]:
    """The one-line descriptions of the packages in apt's index ("Real-time strategy game of
    ancient warfare"), as sentences."""
    files = apt_index_files(lists)
    if not files:
        raise CorpusTextError(f"{lists}: no package index of a release's main component (apt-get update)")
    out = []
    for f in files:
        run = subprocess.run([APT_HELPER, "cat-file", str(f)], capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            raise CorpusTextError(f"{f}: apt-helper cat-file failed: {run.stderr.strip()[:200]}")
        for summary, _ in _descriptions(run.stdout):
            if summary:
                out.append(summary[0].upper() + summary[1:].rstrip(".") + ".")
    return out


def vim_manual(pattern: str = VIM_DOCS) -> list[str]:
    """Sentences of Vim's user manual: prose paragraphs, without the tab-indented examples."""
    files = sorted(Path("/").glob(pattern.lstrip("/")))
    if not files:
        raise CorpusTextError(f"{pattern}: no Vim user manual (apt-get install vim-runtime)")
    return _sentences([p for f in files for p in _paragraphs(f.read_text(encoding="utf-8", errors="replace"),
                                                             ("\t", " " * 5))])


def info_manuals(directory: Path = INFO_DIR) -> list[str]:
    """Sentences of the Info manuals: prose paragraphs, without deeply indented examples."""
    files = sorted(directory.glob("*.info*.gz"))
    if not files:
        raise CorpusTextError(f"{directory}: no Info manuals")
    paragraphs = []
    for f in files:
        with gzip.open(f, "rt", encoding="utf-8", errors="replace") as fh:
            paragraphs += _paragraphs(fh.read(), (" " * 8, "\t"))
    return _sentences(paragraphs)


READERS: dict[str, Callable[[], list[str]]] = {
    "debian-descriptions": debian_descriptions, "vim-manual": vim_manual, "info-manuals": info_manuals,
    "debian-summaries": debian_summaries}
