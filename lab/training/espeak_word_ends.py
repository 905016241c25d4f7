"""When each word of a synthesised utterance ends: espeak-ng's own word and phoneme events.

The espeak-ng library (libespeak-ng, through ctypes) synthesises exactly the samples the `espeak-ng`
command writes for the same voice, rate and pitch (a test compares them), and reports, in stream
order, a WORD event where each word starts (its character span in the text) and a PHONEME event
where each phoneme starts, both with the sample they start at. A text token (a whitespace-separated
word of the recipe's text) owns the phonemes after each of its WORD events; it ends where the next
boundary after its last phoneme starts: another token's WORD event, a pause phoneme (`_`, `_:`,
`_!`), or the end of the audio, moved back over exact digital silence (at the end of a clause the
events can run a few tens of ms past the last sounding sample). A number is one token however many
words espeak-ng says for it.

    word_ends_dry(text, voice, variant, rate, pitch) -> [WordTime]   on the synthesiser's output
    word_ends(recipe) -> [WordTime] | None                           on `speech.render(recipe)`

`augment` moves time in two ways only: tempo (a resampling, t -> t / tempo) and the leading
silence; reverb keeps the direct path and noise adds no delay. Piper voices have no word events
(the voice reports none): `word_ends` gives None for them, and the latency figures cover the
espeak-ng utterances only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from harken.training import speech

# speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_PHONEME_EVENTS = 0x0001
_POS_CHARACTER = 1
_SYNTH_FLAGS = 0x0100 | 0x1000  # espeakPHONEMES | espeakENDPAUSE, as the espeak-ng command sets them
_RATE, _PITCH = 1, 3
_EVENT_LIST_TERMINATED, _EVENT_WORD, _EVENT_END, _EVENT_MSG_TERMINATED, _EVENT_PHONEME = 0, 1, 5, 6, 7


class _Voice(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("languages", ctypes.c_char_p), ("identifier", ctypes.c_char_p),
                ("gender", ctypes.c_ubyte), ("age", ctypes.c_ubyte), ("variant", ctypes.c_ubyte),
                ("xx1", ctypes.c_ubyte), ("score", ctypes.c_int), ("spare", ctypes.c_void_p)]


class _Event(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", ctypes.c_char * 8)]


_Callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


@dataclass(frozen=True)
class WordTime:
    """One token of the text and the time its last sound ends (seconds from the audio's start)."""

    word: str
    end_s: float


@dataclass(frozen=True)
class SynthEvent:
    """One espeak-ng event: kind "word" (with the 1-based character position of the word in the
    text), "phoneme" (with its name) or "end"; `sample` where it starts in the output."""

    kind: str
    sample: int
    text_position: int = 0
    name: str = ""


class _Espeak:
    """The library in this process. A synthesis leaves state behind in it (the next one's clause
    pauses come out longer, and re-initialising does not clear it), so the parent process runs
    each synthesis in a fresh child (`synthesize`), as each `espeak-ng` command is a fresh process."""

    def __init__(self) -> None:
        path = ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1"
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            raise speech.SynthesisError(f"libespeak-ng is not installed (apt-get install espeak-ng): {e}") from e
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.rate_hz = self.lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, None, _INITIALIZE_PHONEME_EVENTS)
        if self.rate_hz <= 0:
            raise speech.SynthesisError("libespeak-ng failed to initialise")
        self.events: list[SynthEvent] = []
        self.pcm: list[bytes] = []
        self._callback = _Callback(self._on_synth)  # kept referenced: the library calls it
        self.lib.espeak_SetSynthCallback(self._callback)

    def _on_synth(self, wav, n: int, events) -> int:
        i = 0
        while events[i].type != _EVENT_LIST_TERMINATED:
            e = events[i]
            if e.type == _EVENT_WORD and e.length > 0:
                self.events.append(SynthEvent("word", e.sample, text_position=e.text_position))
            elif e.type == _EVENT_PHONEME:
                self.events.append(SynthEvent("phoneme", e.sample, name=bytes(e.id).split(b"\0")[0].decode()))
            elif e.type in (_EVENT_END, _EVENT_MSG_TERMINATED):
                self.events.append(SynthEvent("end", e.sample))
            i += 1
        if n > 0:
            self.pcm.append(ctypes.string_at(wav, 2 * n))
        return 0

    def set_voice(self, voice: str) -> None:
        """As the espeak-ng command does: by voice file name, else by language ("en-gb+m3")."""
        if self.lib.espeak_SetVoiceByName(voice.encode()) == 0:
            return
        if self.lib.espeak_SetVoiceByProperties(ctypes.byref(_Voice(languages=voice.encode()))) != 0:
            raise speech.SynthesisError(f"espeak-ng has no voice {voice!r}")

    def synth(self, text: str, voice: str, rate: int, pitch: int) -> tuple[bytes, list[SynthEvent]]:
        self.set_voice(voice)
        self.lib.espeak_SetParameter(_RATE, int(rate), 0)
        self.lib.espeak_SetParameter(_PITCH, int(pitch), 0)
        data = text.encode("utf-8")
        err = self.lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _SYNTH_FLAGS, None, None)
        if err != 0:
            raise speech.SynthesisError(f"espeak-ng failed (error {err}) for voice {voice}")
        return b"".join(self.pcm), self.events


def synthesize(text: str, voice: str, variant: str = "", rate: float = 160, pitch: int = 50
               ) -> tuple[bytes, int, list[SynthEvent]]:
    """(PCM16 little-endian bytes at the library's rate, that rate, events) for the text, with the
    voice, rate and pitch `speech.espeak` gives the `espeak-ng` command: in a fresh child process."""
    import harken

    request = {"text": text, "voice": f"{voice}+{variant}" if variant else voice, "rate": int(rate),
               "pitch": int(pitch)}
    root = str(Path(harken.__file__).resolve().parent.parent)  # the child imports this very tree
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-m", "harken.training.espeak_word_ends"], input=json.dumps(request).encode(),
                         capture_output=True, timeout=120, env=env, cwd=root)
    if run.returncode != 0:
        raise speech.SynthesisError(f"espeak-ng word timing failed: {run.stderr.decode(errors='replace')[-300:]}")
    header, _, pcm = run.stdout.partition(b"\n")
    meta = json.loads(header)
    return pcm, meta["rate_hz"], [SynthEvent(**e) for e in meta["events"]]


def _child() -> None:
    request = json.loads(sys.stdin.buffer.read())
    lib = _Espeak()
    pcm, events = lib.synth(request["text"], request["voice"], request["rate"], request["pitch"])
    header = json.dumps({"rate_hz": lib.rate_hz, "events": [asdict(e) for e in events]})
    sys.stdout.buffer.write(header.encode() + b"\n" + pcm)


def token_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) 1-based character positions of the whitespace-separated tokens of `text`
    (espeak-ng counts characters from 1)."""
    spans, start = [], None
    for i, ch in enumerate(text, 1):
        if ch.isspace():
            if start is not None:
                spans.append((start, i))
                start = None
        elif start is None:
            start = i
    if start is not None:
        spans.append((start, len(text) + 1))
    return spans


def _is_pause(name: str) -> bool:
    return name.startswith("_")


def token_end_samples(events: list[SynthEvent], spans: list[tuple[int, int]], total_samples: int
                      ) -> list[int | None]:
    """For each token span, the sample where it ends (None for a token espeak-ng said nothing for):
    the start of the first boundary (another token's WORD, a pause phoneme, the end) after the last
    phoneme the token owns. A token owns the phonemes after its WORD events."""
    def token_of(position: int) -> int | None:
        for k, (a, b) in enumerate(spans):
            if a <= position < b:
                return k
        return None

    ends: list[int | None] = [None] * len(spans)
    owner: int | None = None  # the token of the latest WORD event
    speaking: int | None = None  # the token whose phonemes have sounded since the last boundary
    for e in events:
        pause = e.kind == "phoneme" and _is_pause(e.name)
        word = token_of(e.text_position) if e.kind == "word" else None
        if speaking is not None and (e.kind == "end" or pause or (e.kind == "word" and word != speaking)):
            ends[speaking] = e.sample  # a later boundary of the same token (a long number) wins
            speaking = None
        if e.kind == "word":
            owner = word
        elif e.kind == "phoneme" and not pause and owner is not None:
            speaking = owner
    if speaking is not None:
        ends[speaking] = total_samples
    return ends


def trim_to_sound(ends: list[int | None], samples: np.ndarray) -> list[int | None]:
    """Each end moved back over exact digital silence (never past the previous end): before a pause
    the phoneme events can run a few tens of ms past the last sounding sample of a clause."""
    out: list[int | None] = []
    floor = 0
    for end in ends:
        if end is not None:
            sounding = np.flatnonzero(samples[floor:end])
            end = floor + int(sounding[-1]) + 1 if sounding.size else end
            floor = end
        out.append(end)
    return out


def word_ends_dry(text: str, voice: str, variant: str = "", rate: float = 160, pitch: int = 50) -> list[WordTime]:
    """The end of every token of `text` in espeak-ng's output for this voice (seconds)."""
    pcm, rate_hz, events = synthesize(text, voice, variant, rate, pitch)
    spans = token_spans(text)
    samples = np.frombuffer(pcm, "<i2")
    ends = trim_to_sound(token_end_samples(events, spans, samples.size), samples)
    tokens = text.split()
    out, last = [], 0.0
    for word, end in zip(tokens, ends):
        # a token espeak-ng said nothing for (a lone punctuation mark) ends with the one before it
        last = last if end is None else end / rate_hz
        out.append(WordTime(word, last))
    return out


def word_ends(recipe: speech.Recipe) -> list[WordTime] | None:
    """The end of every token of the recipe's text in `speech.render(recipe)`, or None for a Piper
    voice (no word events)."""
    if recipe.voice == speech.PIPER:
        return None
    lead_s = int(recipe.lead_s * speech.SAMPLE_RATE) / speech.SAMPLE_RATE  # as `augment` pads
    return [WordTime(w.word, lead_s + w.end_s / recipe.tempo)
            for w in word_ends_dry(recipe.text, recipe.voice, recipe.variant, recipe.rate, recipe.pitch)]


if __name__ == "__main__":
    _child()
