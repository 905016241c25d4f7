"""synth-en's out-of-distribution set (lab/training/ood.jsonl, `harken eval --set ood`): 100 recipes
that read like the held-out set's, in its acoustic conditions, with text no training source has. No
audio is synthesised. (The file is committed: the generator reads this machine's package files, which
another machine need not have, so it is not regenerated here.)"""

from __future__ import annotations

import dataclasses
import re

from harken.training import corpus, ood, text


def test_ood_file_is_100_held_out_conditions_with_new_plain_text():
    items = corpus.read_held_out(ood.OOD_FILE)  # the reader `harken eval --set` uses
    held = corpus.read_held_out()
    assert len(items) == 100
    # the same acoustic conditions as the held-out set's first 100 utterances, in order
    for u, h in zip(items, held):
        assert dataclasses.replace(u.recipe, text=h.recipe.text) == h.recipe, u.recipe.text
    held_keys = {text.key(h.recipe.text) for h in held}
    assert not [u.recipe.text for u in items if text.key(u.recipe.text) in held_keys], "texts of heldout.jsonl"
    assert len({text.key(u.recipe.text) for u in items}) == 100, "a text twice"
    counts = {s: sum(u.source == s for u in items) for s in ood.QUOTAS}
    assert counts == ood.QUOTAS
    for u in items:
        assert ood.MIN_WORDS <= len(u.recipe.text.split()) <= ood.MAX_WORDS, u.recipe.text
        assert not re.search(r"[0-9/_@<>=()\[\]{}|*#]", u.recipe.text), u.recipe.text


def test_no_ood_text_is_a_training_text():
    """Every training source (fortunes, KJV, meeting talk, WordNet's examples) where this machine
    has them, and the fortune files' raw lines besides their sentences."""
    keys = {text.key(u.recipe.text) for u in corpus.read_held_out(ood.OOD_FILE)}
    fortune_files = [p for p in sorted(text.FORTUNE_DIR.glob("*")) if p.is_file() and p.suffix not in (".dat", ".u8")]
    if fortune_files:  # without Debian's fortunes (a lent GPU) this part checks nothing
        lines = {text.key(ln) for p in fortune_files
                 for ln in p.read_text(encoding="utf-8", errors="replace").splitlines()}
        assert not keys & lines, f"texts that are lines of {text.FORTUNE_DIR}/*: {sorted(keys & lines)}"
        for name, sentences in text.sources(0).items():
            trained = keys & {text.key(s) for s in sentences}
            assert not trained, f"texts of the training source {name}: {sorted(trained)}"

