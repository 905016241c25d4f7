"""The manual pages as a training text source (lab/training/manpages.py): roff read as prose, only
plain sentences kept, and no sentence of the out-of-distribution set's sources let into training."""

from __future__ import annotations

import gzip
import json

from harken.training import manpages, ood, text

PAGE = r""".\" a comment line
.TH DEMO 1
.SH NAME
demo \- show how pages are read
.SH DESCRIPTION
The program reads the \fBwhole\fR file before it writes the output.
It keeps a copy of the \fIold\fP version\(emjust in case.
.PP
A second paragraph begins here
and goes on over two lines of the source.
.TP
.B \-\-verbose
Print more about what happens at every step.
.nf
This line is part of an example and never prose.
.fi
Each line of the input becomes one record in the output. \" trailing comment
.BR This " is " "a word" split by a font macro.
"""


def test_roff_prose_and_plain_sentences():
    assert manpages.paragraphs(PAGE)[1] == ("The program reads the whole file before it writes the output. It keeps a "
                                            "copy of the old version, just in case.")
    got = manpages.page_sentences(PAGE)
    assert got == [
        "The program reads the whole file before it writes the output.",
        "It keeps a copy of the old version, just in case.",
        "A second paragraph begins here and goes on over two lines of the source.",
        "Print more about what happens at every step.",
        "Each line of the input becomes one record in the output.",
    ]  # not the NAME line, the option's tag, the no-fill example nor the font macro's run-together words


def test_no_sentence_of_an_ood_source_or_the_set_is_read(tmp_path, monkeypatch):
    """A page that repeats one of the set's own sentences and one its sources have: both dropped."""
    in_set = json.loads(ood.OOD_FILE.read_text().splitlines()[0])["text"]
    in_a_source = "The quick reader finds every plain sentence in the manual."
    monkeypatch.setattr(manpages, "ood_keys", lambda: frozenset({text.key(in_set), text.key(in_a_source)}))
    manpages.manpage_sentences.cache_clear()
    (tmp_path / "man1").mkdir()
    kept = "Nothing in this sentence is in any other source at all."
    with gzip.open(tmp_path / "man1" / "demo.1.gz", "wt") as f:
        f.write(f".TH DEMO 1\n.SH DESCRIPTION\n{in_set}\n{in_a_source}\n{kept}\n{kept}\n")
    try:
        assert manpages.manpage_sentences(tmp_path) == [kept]
    finally:
        manpages.manpage_sentences.cache_clear()


def test_the_leak_guard_holds_the_set_itself():
    assert {text.key(json.loads(ln)["text"]) for ln in ood.OOD_FILE.read_text().splitlines() if ln.strip()} \
        <= manpages.ood_keys()
