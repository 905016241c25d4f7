"""A Pipecat voice bot's speech-to-text pointed at harken: Pipecat's own `DeepgramSTTService` with
`base_url` changed, nothing else.

    python examples/pipecat_bot.py talk.wav --url http://localhost:8080 [--key KEY]

Pipecat (pipecat-ai[deepgram] 1.14.0) needs protobuf 6.x, which harken's own install excludes: a
client needs no harken install, so run this in an environment of its own (`make setup-pipecat`
makes `.venv-pipecat`). It pushes the file as the 20 ms `InputAudioRawFrame`s a transport would,
then, as Pipecat's own VAD does when the user stops, a `VADUserStoppedSpeakingFrame`: the service
sends Deepgram's `Finalize`, and harken answers with a final marked `from_finalize`, which Pipecat
turns into a `TranscriptionFrame(finalized=True)` without waiting out its STT timeout. Prints one
JSON line per transcription frame: {"text", "finalized", "interim"}.

In a bot:

    stt = DeepgramSTTService(api_key=KEY, base_url="http://localhost:8080", sample_rate=16000)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import wave

FRAME_BYTES = 640  # 20 ms of 16 kHz PCM16


async def transcribe(pcm: bytes, url: str, key: str, tail_s: float = 1.0) -> list[dict]:
    """16 kHz PCM16 mono through Pipecat's DeepgramSTTService against harken at `url`; the
    transcription frames it produced."""
    from pipecat.frames.frames import (InputAudioRawFrame, InterimTranscriptionFrame, TranscriptionFrame,
                                       VADUserStartedSpeakingFrame, VADUserStoppedSpeakingFrame)
    from pipecat.services.deepgram.stt import DeepgramSTTService
    from pipecat.tests.utils import SleepFrame, run_test

    stt = DeepgramSTTService(api_key=key, base_url=url, sample_rate=16000)
    frames: list = [SleepFrame(sleep=0.5), VADUserStartedSpeakingFrame()]
    frames += [InputAudioRawFrame(audio=pcm[i:i + FRAME_BYTES], sample_rate=16000, num_channels=1)
               for i in range(0, len(pcm), FRAME_BYTES)]
    frames += [VADUserStoppedSpeakingFrame(), SleepFrame(sleep=tail_s)]
    down, _ = await run_test(stt, frames_to_send=frames)
    out = []
    for f in down:
        if isinstance(f, (TranscriptionFrame, InterimTranscriptionFrame)):
            out.append({"text": f.text, "finalized": bool(getattr(f, "finalized", False)),
                        "interim": isinstance(f, InterimTranscriptionFrame)})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("audio", help="a 16 kHz mono PCM16 WAV file")
    p.add_argument("--url", default="http://localhost:8080", help="harken serve's HTTP port")
    p.add_argument("--key", default="no-key", help="an API key of the server (any, on an open server)")
    args = p.parse_args()
    with wave.open(args.audio) as w:
        if (w.getframerate(), w.getnchannels(), w.getsampwidth()) != (16000, 1, 2):
            print("pipecat_bot: give a 16 kHz mono PCM16 WAV file", file=sys.stderr)
            return 2
        pcm = w.readframes(w.getnframes())
    for frame in asyncio.run(transcribe(pcm, args.url, args.key)):
        print(json.dumps(frame, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
