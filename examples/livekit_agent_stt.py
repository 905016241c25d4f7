"""LiveKit Agents' speech-to-text plugins pointed at harken: one base URL changed, nothing else.

    python examples/livekit_agent_stt.py talk.wav --url http://localhost:8080 [--key KEY]

Runs the audio through LiveKit's Deepgram plugin (`livekit-plugins-deepgram`: live over /v1/listen,
then the same file over its REST `recognize()`) and its OpenAI plugin (`livekit-plugins-openai`,
the realtime transcription API on /v1/realtime), pushing the file as the 20 ms frames an agent's
room track would deliver, and prints the plugins' speech events. In an agent, the same two lines go
into `AgentSession(stt=...)`:

    stt = deepgram.STT(base_url="http://localhost:8080/v1/listen", api_key=KEY)
    stt = openai.STT(base_url="http://localhost:8080/v1", api_key=KEY, use_realtime=True)

Needs `pip install livekit-plugins-deepgram livekit-plugins-openai` (harken's dev extra pins them) and
`harken serve --http-port 8080` somewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np

FRAME_SAMPLES = 320  # 20 ms at 16 kHz, as a LiveKit room track delivers audio


def frames(pcm: np.ndarray, rate: int = 16000):
    from livekit import rtc

    for i in range(0, pcm.size, FRAME_SAMPLES):
        chunk = pcm[i:i + FRAME_SAMPLES]
        yield rtc.AudioFrame(data=chunk.tobytes(), sample_rate=rate, num_channels=1, samples_per_channel=chunk.size)


async def _events(stream, pcm: np.ndarray, until_final: bool = False) -> list:
    """Push every frame, flush (the plugin's end of a turn), end the input; the stream's events."""
    for f in frames(pcm):
        stream.push_frame(f)
    stream.flush()
    if not until_final:
        stream.end_input()
    out = []
    async for ev in stream:
        out.append(ev)
        if until_final and ev.type.name == "FINAL_TRANSCRIPT":
            break
    await stream.aclose()
    return out


async def transcribe(pcm: np.ndarray, url: str, key: str) -> dict[str, list]:
    """16 kHz int16 mono `pcm` through both plugins against harken at `url`: each plugin's events as
    (event type name, text) pairs, and the Deepgram plugin's REST answer."""
    from livekit.agents.utils import http_context
    from livekit.plugins import deepgram, openai

    def named(events) -> list:
        return [(ev.type.name, ev.alternatives[0].text if ev.alternatives else "") for ev in events
                if ev.type.name != "RECOGNITION_USAGE"]

    async with http_context.open():
        dg = deepgram.STT(base_url=f"{url}/v1/listen", api_key=key, language="en-US")
        live = named(await _events(dg.stream(), pcm))
        rest = await dg.recognize(list(frames(pcm)))
        oa = openai.STT(base_url=f"{url}/v1", api_key=key, use_realtime=True, language="en")
        realtime = named(await _events(oa.stream(), pcm, until_final=True))  # a realtime session stays open
    return {"deepgram": live, "deepgram_rest": [("FINAL_TRANSCRIPT", rest.alternatives[0].text)],
            "openai_realtime": realtime}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("audio", help="an audio file (any format soundfile reads)")
    p.add_argument("--url", default="http://localhost:8080", help="harken serve's HTTP port")
    p.add_argument("--key", default="no-key", help="an API key of the server (any, on an open server)")
    args = p.parse_args()
    from harken.edge.audio import load_audio, peak_normalize

    pcm = (np.clip(peak_normalize(load_audio(args.audio)), -1, 1) * 32767).astype("<i2")
    for plugin, events in asyncio.run(transcribe(pcm, args.url, args.key)).items():
        for kind, text in events:
            print(f"{plugin:16} {kind:20} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
