"""Sentences for synth-en: packaged English text plus generated meeting talk, split train / held-out.

Sources, all offline and deterministic:
- Debian `fortunes` (fortune-mod's data files: quotes, jokes, literature), split into sentences;
- the King James Bible from Debian `bible-kjv` (public domain), verses split at sentence and
  clause ends;
- `meeting_sentences`: a seeded generator of meeting-style talk with names, numbers (digits and
  words), dates, times, amounts and acronyms;
- WordNet 3.0's usage examples from Debian `wordnet-base` (the quoted sentences and phrases after
  each synset's gloss: everyday English over ~47,000 distinct examples and most of the language's
  common words), read at build time, never copied into the repo.

Targets are the written text as a person would write it (case, punctuation, digits); the scorer
normalises both sides with the Whisper English normaliser. A sentence is held out when a hash of
its normalised form says so (`is_held_out`), so the split does not depend on the order sources are
read in and no sentence can be on both sides even when two sources share it.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
from pathlib import Path

from harken.shared.errors import HarkenError

FORTUNE_DIR = Path("/usr/share/games/fortunes")
# Where Debian's packages are not installed (a lent GPU): a folder with `fortunes/` (the fortune
# files) and `kjv.txt` (what `bible -f gen1:1-rev22:21` prints), made by `make device-carry`
TEXT_DIR_ENV = "HARKEN_TEXT_DIR"
KJV_RANGE = "gen1:1-rev22:21"
WORDNET_DIR = Path("/usr/share/wordnet")
WORDNET_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")
HELD_OUT_PER_MILLE = 10  # 1% of distinct sentences never seen in training
MIN_WORDS, MAX_WORDS = 2, 28

_ALLOWED = re.compile(r"^[A-Za-z0-9 ,.;:!?'$%&-]+$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'])")


class CorpusTextError(HarkenError):
    """A text source is missing (a Debian package not installed)."""


def key(sentence: str) -> str:
    """The identity of a sentence for the split and for overlap checks: lower case, letters and
    digits only, single spaces."""
    return " ".join(re.sub(r"[^a-z0-9]+", " ", sentence.lower()).split())


def is_held_out(sentence: str) -> bool:
    digest = hashlib.sha1(key(sentence).encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < HELD_OUT_PER_MILLE


def clean(sentence: str) -> str | None:
    """One candidate sentence -> itself tidied, or None when it is not plain speakable English."""
    s = sentence.replace("\u2019", "'").replace("`", "'").replace("''", "").replace('"', "")
    s = re.sub(r"\s+", " ", s).strip(" -")
    s = re.sub(r"\s+([,.;:!?])", r"\1", s)
    if not s or not _ALLOWED.match(s) or not re.search(r"[A-Za-z]", s):
        return None
    if "--" in s or "&" in s and len(s) < 8:
        return None
    words = s.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS:
        return None
    if sum(w.isupper() and len(w) > 1 for w in words) > len(words) // 2:  # shouting, headings
        return None
    if s[-1] not in ".!?":
        s = s.rstrip(",;:") + "."
    return s[0].upper() + s[1:]


def _split(text: str) -> list[str]:
    return [p for p in _SENTENCE_END.split(text) if p]


def _text_dir() -> Path | None:
    d = os.environ.get(TEXT_DIR_ENV)
    return Path(d) if d else None


def fortune_sentences(directory: Path | None = None) -> list[str]:
    """Sentences of every fortune file (not the offensive set), in file-name order."""
    if directory is None:
        carried = _text_dir()
        directory = carried / "fortunes" if carried else FORTUNE_DIR
    files = sorted(p for p in directory.glob("*") if p.is_file() and p.suffix not in (".dat", ".u8"))
    if not files:
        raise CorpusTextError(f"{directory}: no fortune files (apt-get install fortunes fortunes-min)")
    out = []
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace")
        for entry in re.split(r"^%\s*$", text, flags=re.M):
            lines = [ln for ln in entry.splitlines() if not re.match(r"^\s*(--|-- |\()", ln)]
            body = " ".join(ln.strip() for ln in lines)
            out.extend(_split(body))
    return out


def kjv_text() -> str:
    """The whole KJV, one verse a line, as Debian's `bible` prints it (or $HARKEN_TEXT_DIR/kjv.txt)."""
    d = _text_dir()
    if d is not None:
        try:
            return (d / "kjv.txt").read_text(encoding="utf-8")
        except OSError as e:
            raise CorpusTextError(f"${TEXT_DIR_ENV}: {e}") from e
    exe = shutil.which("bible")
    if exe is None:
        raise CorpusTextError("the KJV text needs Debian's bible-kjv (apt-get install bible-kjv)")
    return subprocess.run([exe, "-f", KJV_RANGE], capture_output=True, text=True, timeout=120).stdout


def kjv_sentences() -> list[str]:
    """Sentences and clauses of the King James Bible (Debian `bible-kjv`), in book order."""
    out: list[str] = []
    for line in kjv_text().splitlines():
        verse = line.split(" ", 1)[1] if " " in line else ""
        for sentence in _split(verse):
            # long verses: clauses at ';' and ':' are sentences a person could say alone
            parts = re.split(r"(?<=[;:])\s+", sentence) if len(sentence.split()) > 18 else [sentence]
            out.extend(p.rstrip(";:") for p in parts)
    return out


def wordnet_examples(directory: Path = WORDNET_DIR) -> list[str]:
    """WordNet's usage examples as written (the quoted strings after each synset's `|` gloss), in
    file and synset order; `$HARKEN_TEXT_DIR/wordnet.txt` (one a line, `make device-carry`) instead
    where that folder is given."""
    carried = _text_dir()
    if carried is not None:
        try:
            return (carried / "wordnet.txt").read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise CorpusTextError(f"${TEXT_DIR_ENV}: {e}") from e
    files = [directory / name for name in WORDNET_FILES]
    if not all(f.is_file() for f in files):
        raise CorpusTextError(f"{directory}: no WordNet data files (apt-get install wordnet-base)")
    out: list[str] = []
    for f in files:
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line[:1].isdigit() or " | " not in line:  # the licence header lines start with spaces
                continue
            out.extend(re.findall(r'"([^"]+)"', line.split(" | ", 1)[1]))
    return out


def wordnet_sentences() -> list[str]:
    """WordNet's usage examples that are whole sentences or phrases a person could say alone."""
    return [e.strip() for e in wordnet_examples() if "..." not in e and "_" not in e]


# --- meeting talk -------------------------------------------------------------------------------

FIRST_NAMES = """Alice Bob Carol David Emma Frank Grace Henry Isabel Jack Karen Liam Maria Noah Olivia
Peter Quinn Rachel Samuel Tara Umar Victor Wendy Xavier Yusuf Zoe Aisha Ben Chloe Daniel Elena Felix
Gina Hugo Ivy James Kate Leo Mia Nina Oscar Priya Raj Sofia Tom Uma Vera Will Yara Zack Anna Brian
Claire Diego Erin Fatima George Hannah Ian Julia Kevin Laura Marco Nadia Owen Paula Ravi Sara Tim
Nora Ahmed Lucy Mark Helen Paul Amy Chen Kenji Lars Ines Omar Rosa Sean Tessa Adam Beth Carl Dana
Eric Fiona Gary Holly Irene Jason Kim Lena Mike Nick Olga Pedro Rita Steve Tina Vince Wes""".split()
LAST_NAMES = """Smith Johnson Brown Garcia Miller Davis Wilson Anderson Taylor Thomas Moore Martin
Jackson Lee Walker Hall Allen Young King Wright Scott Green Baker Adams Nelson Carter Mitchell Roberts
Turner Phillips Campbell Parker Evans Edwards Collins Stewart Morris Murphy Cook Rogers Patel Nguyen
Kim Singh Chen Wang Lopez Gonzalez Clark Lewis Hill Ward Cooper Reed Bailey Bell Kelly Howard""".split()
TEAMS = """marketing sales engineering design finance legal support research operations product
security data platform mobile web infrastructure hiring""".split()
THINGS = """budget roadmap launch release report proposal contract invoice migration deadline
forecast dashboard survey workshop demo review backlog presentation prototype schedule""".split()
ACRONYMS = """API CEO CFO CTO HR KPI OKR SLA QA UI UX PR ETA ROI SDK VPN CRM SQL AWS GPU""".split()
MONTHS = """January February March April May June July August September October November
December""".split()
WEEKDAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def spell(n: int) -> str:
    """0 <= n < 1,000,000 in words, as a person writes it ("forty-two", "three hundred and five")."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + spell(rest))
    rest = n % 1000
    tail = "" if rest == 0 else (" and " if rest < 100 else " ") + spell(rest)
    return spell(n // 1000) + " thousand" + tail


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _number(r: random.Random, lo: int, hi: int) -> str:
    n = r.randint(lo, hi)
    if r.random() < 0.4 and n < 1000:
        return spell(n)
    return f"{n:,}" if n >= 10000 else str(n)


def _time(r: random.Random) -> str:
    h, m = r.randint(1, 12), r.choice([0, 0, 15, 30, 45, 10, 20, 40, 5])
    kind = r.random()
    if kind < 0.5:
        suffix = r.choice(["am", "pm"]) if m else r.choice(["am", "pm", "o'clock"])
        return f"{h}:{m:02d} {suffix}" if m else f"{h} {suffix}"
    if kind < 0.7:
        return f"{h}:{m:02d}"
    if kind < 0.85:
        return {0: f"{spell(h)} o'clock", 15: f"quarter past {spell(h)}", 30: f"half past {spell(h)}",
                45: f"quarter to {spell(h % 12 + 1)}"}.get(m, f"{spell(h)} {spell(m)}")
    return r.choice(["noon", "midnight", "the end of the day", "lunchtime"])


def _date(r: random.Random) -> str:
    month, day = r.choice(MONTHS), r.randint(1, 28)
    return r.choice([f"{month} {day}", f"{month} {_ordinal(day)}", f"the {_ordinal(day)} of {month}",
                     f"{r.choice(WEEKDAYS)}", f"next {r.choice(WEEKDAYS)}", f"{r.choice(WEEKDAYS)}, {month} {day}",
                     f"{month} {day}, {r.randint(2019, 2031)}"])


def _amount(r: random.Random) -> str:
    kind = r.random()
    if kind < 0.35:
        return f"${r.randint(1, 999):,}"
    if kind < 0.55:
        return f"${r.randint(1, 99)},{r.randint(0, 999):03d}"
    if kind < 0.7:
        return f"${r.randint(1, 9)}.{r.randint(1, 9)} million"
    if kind < 0.85:
        return f"{r.randint(2, 95)}%"
    return f"{spell(r.randint(2, 900))} dollars"


_TEMPLATES = [
    "Can we move the {thing} review to {date}?",
    "{name} will send the {thing} by {time}.",
    "Let's meet on {date} at {time}.",
    "The {team} team needs {amount} for the {thing}.",
    "{name}, could you share the {acro} numbers before {date}?",
    "We closed {number} tickets last week.",
    "The {thing} is {number} days late.",
    "I talked to {full} about the {acro} yesterday.",
    "Revenue grew {pct} in the third quarter.",
    "Please add {name} and {name2} to the {team} channel.",
    "Our {acro} target for Q{q} is {number}.",
    "The call with {full} starts at {time} on {date}.",
    "We spent {amount} on the {thing} so far.",
    "{name} is out until {date}, so {name2} will cover the {thing}.",
    "Room {room} is booked from {time} to {time2}.",
    "Does anyone have questions about the {thing}?",
    "I think the {team} {thing} can wait until {date}.",
    "{full} joined the {team} team in {month}.",
    "The {acro} dashboard shows {number} active users.",
    "Send me the {thing} before {time} please.",
    "We need to cut the {thing} by {pct}.",
    "{name} said the {acro} is down again.",
    "Action item for {name}: update the {thing} by {date}.",
    "That's {number} out of {number2} tests passing.",
    "The {thing} costs {amount} a month.",
    "Let's take a {minutes} minute break.",
    "{name}, you're on mute.",
    "Could you repeat the last {number} points, {name}?",
    "The {team} and {team2} teams will sync on {date}.",
    "Version {major}.{minor} of the {acro} ships on {date}.",
    "We hired {number} people in {month}.",
    "Call {name} at extension {ext}.",
    "Okay, let's wrap up. Thanks, everyone.",
    "My flight lands at {time} on {date}.",
    "{full} approved the {amount} {thing}.",
    "Is the {thing} still on track for {month}?",
]


def meeting_sentence(r: random.Random) -> str:
    template = r.choice(_TEMPLATES)
    fields = {
        "name": r.choice(FIRST_NAMES), "name2": r.choice(FIRST_NAMES),
        "full": f"{r.choice(FIRST_NAMES)} {r.choice(LAST_NAMES)}",
        "team": r.choice(TEAMS), "team2": r.choice(TEAMS), "thing": r.choice(THINGS),
        "acro": r.choice(ACRONYMS), "date": _date(r), "time": _time(r), "time2": _time(r),
        "amount": _amount(r), "number": _number(r, 2, 2500), "number2": _number(r, 2, 5000),
        "pct": f"{r.randint(2, 60)}%" if r.random() < 0.6 else f"{spell(r.randint(2, 60))} percent",
        "q": r.randint(1, 4), "room": r.randint(100, 999), "month": r.choice(MONTHS),
        "minutes": r.choice(["five", "ten", "15", "fifteen", "20"]), "major": r.randint(1, 9),
        "minor": r.randint(0, 12), "ext": r.randint(1000, 9999),
    }
    s = template.format(**fields)
    return s[0].upper() + s[1:]


def meeting_sentences(seed: int, n: int) -> list[str]:
    r = random.Random(f"meeting-{seed}")
    return [meeting_sentence(r) for _ in range(n)]


# --- the whole text corpus ----------------------------------------------------------------------

def sources(seed: int = 0, meeting: int = 30000) -> dict[str, list[str]]:
    """Distinct cleaned sentences of each source, in a fixed order; a sentence two sources share
    belongs to the first (fortunes, kjv, meeting, wordnet: the source added last comes last, so the
    sentences of the others did not move when it came)."""
    seen: set[str] = set()
    out: dict[str, list[str]] = {}
    for name, raw in (("fortunes", fortune_sentences()), ("kjv", kjv_sentences()),
                      ("meeting", meeting_sentences(seed, meeting)), ("wordnet", wordnet_sentences())):
        out[name] = []
        for s in raw:
            c = clean(s)
            if not c:
                continue
            k = key(c)
            if k and k not in seen:
                seen.add(k)
                out[name].append(c)
    return out


def all_sentences(seed: int = 0, meeting: int = 30000) -> list[str]:
    """Distinct cleaned sentences of every source, in a fixed order."""
    return [s for group in sources(seed, meeting).values() for s in group]


def split(sentences: list[str]) -> tuple[list[str], list[str]]:
    """(train, held_out) by `is_held_out`."""
    train: list[str] = []
    held: list[str] = []
    for s in sentences:
        (held if is_held_out(s) else train).append(s)
    return train, held


def stats(sentences: list[str]) -> dict:
    words = {w for s in sentences for w in key(s).split()}
    return {"sentences": len(sentences), "distinct_words": len(words)}
