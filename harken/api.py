"""harken in one process: a file to text, and a file streamed as it would be live, without a server.

    import harken

    harken.transcribe("talk.wav", model="synth-en").text        # the offline pass, as `harken transcribe`
    for event in harken.stream("talk.wav", model="synth-en"):   # the streaming engine, as `harken stream`
        print(event.segment_id, event.is_final, event.text)

`model` is anything `Qwen3ASR.load` takes (a Hugging Face id, a local checkpoint directory, "synth-en",
"tiny") or an already loaded `Qwen3ASR`, which is how a caller reuses one model across files.
"""

from __future__ import annotations

from collections.abc import Iterator

from .cloud.embedded import stream_file
from .cloud.inference.decoder_stream import EngineEvent, SessionOptions
from .cloud.inference.offline import OfflineTranscript, transcribe_audio
from .cloud.model.asr import Qwen3ASR
from .edge.audio import load_audio, peak_normalize
from .shared.protocol import model_context


def load_model(model: str | Qwen3ASR, device: str | None = None, dtype: str | None = None) -> Qwen3ASR:
    """A loaded recogniser: `model` as it is when already loaded, else `Qwen3ASR.load(model)`."""
    return model if isinstance(model, Qwen3ASR) else Qwen3ASR.load(model, dtype=dtype, device=device)


def transcribe(path: str, model: str | Qwen3ASR = "synth-en", language: str | None = None,
               context: str = "", keyterms: tuple[str, ...] = ()) -> OfflineTranscript:
    """An audio file (any format `load_audio` reads) -> its offline transcript (`.text`, `.language`,
    `.pieces`): one pass per piece of at most 20 minutes cut at quiet points, as `harken transcribe`."""
    audio = peak_normalize(load_audio(path))
    return transcribe_audio(load_model(model), audio, language, model_context(context, tuple(keyterms)))


def stream(path: str, model: str | Qwen3ASR = "synth-en", language: str | None = None,
           context: str = "", keyterms: tuple[str, ...] = ()) -> Iterator[EngineEvent]:
    """An audio file streamed through an in-process engine on audio time: the partial and final
    transcript events a live stream of it would get (committed text is never taken back)."""
    options = SessionOptions(language=language, context=model_context(context, tuple(keyterms)))
    yield from stream_file(path, load_model(model), options)
