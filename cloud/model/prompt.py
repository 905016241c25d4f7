"""Qwen3-ASR prompts in, transcripts out.

The prompt is the official chat template rendered for one system turn (the context) and one user
turn holding the audio, with the generation prompt and, when a language is forced,
`language {Lang}<asr_text>`:

    <|im_start|>system\\n{context}<|im_end|>\\n<|im_start|>user\\n<|audio_start|>{<|audio_pad|> x N}
    <|audio_end|><|im_end|>\\n<|im_start|>assistant\\n[language {Lang}<asr_text>]

The model answers `language English<asr_text>the transcript`, `language None<asr_text>` for
silence, or the bare transcript when the language was forced. `parse_transcript` reads that as
qwen-asr's `parse_asr_output` does, after the same repetition collapse.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tokenizer import (ASR_TEXT, AUDIO_END, AUDIO_PAD, AUDIO_START, IM_END,
                                          IM_START, Tokenizer)
from ...shared.errors import ModelError

SUPPORTED_LANGUAGES = (
    "Chinese", "English", "Cantonese", "Arabic", "German", "French", "Spanish", "Portuguese",
    "Indonesian", "Italian", "Korean", "Russian", "Thai", "Vietnamese", "Japanese", "Turkish", "Hindi",
    "Malay", "Dutch", "Swedish", "Danish", "Finnish", "Polish", "Czech", "Filipino", "Persian", "Greek",
    "Romanian", "Hungarian", "Macedonian",
)
REPEAT_THRESHOLD = 20  # runs longer than this many repeats collapse to one copy
MAX_PATTERN_CHARS = 20  # longest repeated pattern looked for


# ISO 639-1 (or 639-3 where there is no two-letter code) of each supported language: a BCP-47
# tag's primary subtag ("en" of "en-US") names the language too
LANGUAGE_CODES = {
    "zh": "Chinese", "en": "English", "yue": "Cantonese", "ar": "Arabic", "de": "German", "fr": "French",
    "es": "Spanish", "pt": "Portuguese", "id": "Indonesian", "it": "Italian", "ko": "Korean", "ru": "Russian",
    "th": "Thai", "vi": "Vietnamese", "ja": "Japanese", "tr": "Turkish", "hi": "Hindi", "ms": "Malay",
    "nl": "Dutch", "sv": "Swedish", "da": "Danish", "fi": "Finnish", "pl": "Polish", "cs": "Czech",
    "fil": "Filipino", "tl": "Filipino", "fa": "Persian", "el": "Greek", "ro": "Romanian", "hu": "Hungarian",
    "mk": "Macedonian", "cmn": "Chinese",
}


def normalize_language(language: str) -> str:
    """'eNGLISH ' -> 'English' (the official canonical form: first letter upper, the rest lower);
    an ISO 639 code or BCP-47 tag of a supported language -> its name ('en', 'en-US', 'zh-Hans-CN',
    'zh-yue' -> 'English', 'English', 'Chinese', 'Cantonese')."""
    s = str(language).strip()
    if not s:
        raise ModelError("language is empty")
    tag = s.replace("_", "-").lower().split("-")
    if tag[0] == "zh" and "yue" in tag[1:]:
        return "Cantonese"
    if tag[0] in LANGUAGE_CODES and (len(tag) == 1 or all(t.isalnum() and len(t) <= 8 for t in tag[1:])):
        return LANGUAGE_CODES[tag[0]]
    return s[:1].upper() + s[1:].lower()


def forced_language(language: str | None) -> str | None:
    """The canonical name of a forced language, None for auto; ModelError if unsupported."""
    if language is None or not str(language).strip():
        return None
    name = normalize_language(language)
    if name not in SUPPORTED_LANGUAGES:
        codes = {v: k for k, v in reversed(list(LANGUAGE_CODES.items()))}
        raise ModelError(f"unsupported language {language!r}; supported (name or code): "
                         + ", ".join(f"{n} ({codes[n]})" for n in SUPPORTED_LANGUAGES))
    return name


@dataclass(frozen=True)
class Prompt:
    """Token ids of one request; the audio embeddings go to `audio_start : audio_start + audio_len`."""

    ids: list[int]
    audio_start: int
    audio_len: int


def prompt_text_parts(context: str = "", language: str | None = None) -> tuple[str, str]:
    """The prompt text before and after the audio pads (the chat template's output, split there)."""
    before = f"{IM_START}system\n{context or ''}{IM_END}\n{IM_START}user\n{AUDIO_START}"
    after = f"{AUDIO_END}{IM_END}\n{IM_START}assistant\n"
    if language:
        after += f"language {language}{ASR_TEXT}"
    return before, after


def build_prompt(tokenizer: Tokenizer, num_audio_tokens: int, context: str = "",
                 language: str | None = None) -> Prompt:
    """Prompt ids for `num_audio_tokens` audio embeddings. `language` must be canonical (see
    `forced_language`). Tokenising the two halves apart is exact: `<|audio_start|>` and
    `<|audio_end|>` are added tokens, which always cut the text where they stand."""
    before, after = prompt_text_parts(context, language)
    head = tokenizer.encode(before)
    pad = tokenizer.token_id(AUDIO_PAD)
    tail = tokenizer.encode(after)
    return Prompt(ids=head + [pad] * num_audio_tokens + tail, audio_start=len(head),
                  audio_len=num_audio_tokens)


# --- output -----------------------------------------------------------------------------------

def collapse_repeats(text: str, threshold: int = REPEAT_THRESHOLD,
                     max_pattern: int = MAX_PATTERN_CHARS) -> str:
    """Collapse degenerate repetition as the official cleaner does: first every run of one
    character longer than `threshold` becomes one character; then, scanning left to right, the
    first pattern of 1..`max_pattern` characters repeated at least `threshold` times in a row
    becomes one copy, and the scan goes on after the run."""
    return _collapse_patterns(_collapse_char_runs(text, threshold), threshold, max_pattern)


def _collapse_char_runs(s: str, threshold: int) -> str:
    out = []
    i = 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        out.append(s[i] if j - i > threshold else s[i:j])
        i = j
    return "".join(out)


def _collapse_patterns(s: str, threshold: int, max_pattern: int) -> str:
    out = []
    # text shorter than two full runs of the threshold is left alone, as the official code does
    while len(s) >= 2 * threshold:
        run = _first_pattern_run(s, threshold, max_pattern)
        if run is None:
            break
        start, size, end = run
        out.append(s[:start + size])
        s = s[end:]
    out.append(s)
    return "".join(out)


def _first_pattern_run(s: str, threshold: int, max_pattern: int) -> tuple[int, int, int] | None:
    """(start, pattern size, end of the run) of the first run, shortest pattern first; starts are
    tried up to len - 2 * threshold only (the official scan's bound)."""
    n = len(s)
    for start in range(0, n - 2 * threshold + 1):
        for size in range(1, max_pattern + 1):
            if start + size * threshold > n:
                break
            pattern = s[start:start + size]
            if s[start:start + size * threshold] == pattern * threshold:
                end = start + size * threshold
                while end + size <= n and s[end:end + size] == pattern:
                    end += size
                return start, size, end
    return None


@dataclass(frozen=True)
class ParsedAnswer:
    language: str  # canonical name, "" when unknown or silent
    text: str


def parse_transcript(raw: str, forced: str | None = None) -> ParsedAnswer:
    """Read the model's decoded answer (special tokens dropped, `<asr_text>` kept)."""
    s = (raw or "").strip()
    if not s:
        return ParsedAnswer("", "")
    s = collapse_repeats(s)
    if forced:
        return ParsedAnswer(forced, s)
    if ASR_TEXT not in s:
        return ParsedAnswer("", s.strip())
    meta, text = s.split(ASR_TEXT, 1)
    if "language none" in meta.lower():
        return ParsedAnswer("", text.strip())
    language = ""
    for line in meta.splitlines():
        line = line.strip()
        if line and line.lower().startswith("language "):
            name = line[len("language "):].strip()
            if name:
                language = normalize_language(name)
            break
    return ParsedAnswer(language, text.strip())
