"""OpenAI's own client against `harken serve`: one base URL changed, nothing else.

    harken serve --model synth-en --http-port 8080 &     # in another terminal
    python examples/openai_client.py talk.wav [--url http://localhost:8080/v1] [--key KEY]

Transcribes the file three ways through the `openai` package: the whole text (`harken transcribe`'s),
WebVTT subtitles (the streaming engine's segments), and streamed (`stream=True`: a
`transcript.text.delta` per pass as the server goes, then `.done`).
Needs `pip install openai`.
"""

from __future__ import annotations

import argparse
import sys

from openai import OpenAI


def transcribe(path: str, url: str, key: str, language: str | None = None, out=sys.stdout) -> dict[str, str]:
    """The file's text, its WebVTT and its streamed text, each as the `openai` client returns it."""
    client = OpenAI(base_url=url, api_key=key)
    extra = {"language": language} if language else {}
    with open(path, "rb") as f:
        text = client.audio.transcriptions.create(model="harken", file=f, **extra).text
    print(text, file=out)
    with open(path, "rb") as f:
        vtt = client.audio.transcriptions.create(model="harken", file=f, response_format="vtt", **extra)
    print(vtt, file=out)
    streamed, done = "", ""
    with open(path, "rb") as f:
        for event in client.audio.transcriptions.create(model="harken", file=f, stream=True, **extra):
            if event.type == "transcript.text.delta":
                streamed += event.delta
                print(event.delta, end="", file=out, flush=True)
            elif event.type == "transcript.text.done":
                done = event.text
    print(file=out)
    return {"text": text, "vtt": str(vtt), "streamed": streamed, "done": done}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("audio", help="an audio file (wav, flac, mp3, ...)")
    parser.add_argument("--url", default="http://localhost:8080/v1", help="harken serve's HTTP port, /v1")
    parser.add_argument("--key", default="none", help="an API key, if the server asks for one")
    parser.add_argument("--language", default=None, help="en, zh, ... (default: detected)")
    args = parser.parse_args(argv)
    transcribe(args.audio, args.url, args.key, args.language)
    return 0


if __name__ == "__main__":
    sys.exit(main())
