"""What the fuzzer feeds harken (lab/bench/fuzz_targets.py): a corpus of valid inputs and random generators.

The corpus comes from the bundled sample through the edge pipeline; every generator takes a
`random.Random` (a seeded one in `harken bench fuzz`, hypothesis's in tests/test_fuzz.py) and draws
the same randomness whatever else it is given, so hypothesis can replay an example from its draws.

    random_codec_input              (payload, max_frames) for the codec's decoder
    random_wire_input               bytes of one client message
    random_datachannel_server_input a data-channel frame from a client (binary message or text)
    random_datachannel_client_input a data-channel frame from a server
    random_stream                   a whole stream: Start (or not), then valid, replayed, reordered,
                                    corrupted and garbage messages, then a half-close or a drop
Mostly they start from something valid and break it a little, so the inputs get past the first
checks into the code behind them.
"""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harken.proto import harken_pb2 as pb
from harken.shared.codec import CODEC_NAME, MAX_FRAMES, MODES, PacketHeader, encode_frames
from harken.shared.features_spec import N_MELS, SAMPLE_RATE
from harken.shared.integrity import payload_crc32c
from harken.shared.protocol import FeaturePacket

FUZZ_LANGUAGE = "English"  # the tiny random checkpoint writes text only with a forced language

# ---- the corpus: valid inputs to start from ------------------------------------------------------

@dataclass(frozen=True)
class FuzzCorpus:
    """Valid inputs the generators mutate: codec payloads of every kind, the edge's feature packets
    and 100 ms PCM16 pieces of the bundled sample's first seconds, and serialized ClientMessages."""

    payloads: tuple[bytes, ...]
    packets: tuple[FeaturePacket, ...]
    pcm_pieces: tuple[bytes, ...]  # 16 kHz PCM16, 100 ms each
    messages: tuple[bytes, ...]


def build_corpus(seconds: float = 4.0) -> FuzzCorpus:
    """From the bundled sample: its first `seconds` through the edge pipeline (VAD, log-mel, codec)."""
    from importlib.resources import files

    from harken.edge.audio import load_audio, peak_normalize
    from harken.edge.pipeline import FeatureStream

    audio = peak_normalize(load_audio(str(files("harken") / "data" / "sample.wav")))[:int(seconds * SAMPLE_RATE)]
    stream = FeatureStream()
    piece = SAMPLE_RATE // 10
    packets = []
    for i in range(0, audio.size, piece):
        packets += stream.push(audio[i:i + piece])
    packets += stream.flush()
    pcm = np.clip(np.round(audio * 32768), -32768, 32767).astype("<i2")
    pcm_pieces = tuple(pcm[i:i + piece].tobytes() for i in range(0, pcm.size, piece))
    frames = np.random.default_rng(0).normal(-2.0, 1.0, (N_MELS, 40)).astype(np.float32)
    payloads = [p.payload for p in packets]
    payloads += [encode_frames(frames[:, :k], mode) for mode in MODES for k in (1, 7, 40)]
    payloads += [encode_frames(frames[:, :12], "balanced", floor_log10=-1.0),
                 PacketHeader(None, 0, np.zeros(0, np.float32)).serialize(),  # keep-alive
                 PacketHeader("balanced", 72, np.full(72, -3.0, np.float32), at_floor=True).serialize()]
    messages = [pb.ClientMessage(start=pb.Start(language=FUZZ_LANGUAGE, codec=CODEC_NAME)),
                pb.ClientMessage(start=pb.Start(session_id="x" * 24, last_event_seq=3)),
                pb.ClientMessage(start=pb.Start(seed=pb.SessionSeed(present=True, running_max_log10=-1.5,
                                                                    context_tail="earlier", next_segment_id=2))),
                pb.ClientMessage(audio=pb.Audio(seq=1, pcm16=pcm_pieces[0], sample_rate=SAMPLE_RATE)),
                pb.ClientMessage(finalize=pb.Finalize()), pb.ClientMessage(end=pb.End())]
    messages += [features_message(p, seq=i + 1) for i, p in enumerate(packets[:6])]
    return FuzzCorpus(tuple(payloads), tuple(packets), pcm_pieces, tuple(m.SerializeToString() for m in messages))


def features_message(p: FeaturePacket, seq: int) -> pb.ClientMessage:
    """The edge's message for packet `p` (shared/wire.features_to_proto: with its CRC32C)."""
    from harken.shared.wire import features_to_proto

    return features_to_proto(p, seq=seq)


# ---- random values -------------------------------------------------------------------------------

_INTERESTING_INTS = (0, 1, 2, 3, 7, 8, 9, 20, 72, 127, 128, 255, 256, 6000, 6001, 32767, 65535, 65536,
                     2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
_INTERESTING_FLOATS = (0.0, -0.0, 1.0, -1.0, -3.5, 99.9, 100.0, 100.5, -100.5, 1e30, -1e30, 3.4e38,
                       math.inf, -math.inf, math.nan)
_ALPHABETS = ("abcdefghijklmnopqrstuvwxyz ", "ABC-_0123456789", "éüßçñ", "中文日本語", "😀🎧", "\x00\t\n\x7f")


def random_int(rng: random.Random, bits: int) -> int:
    """An unsigned value of a `bits`-bit field: an edge case, small, or anything."""
    r = rng.random()
    if r < 0.5:
        return min(rng.choice(_INTERESTING_INTS), (1 << bits) - 1)
    if r < 0.8:
        return rng.randrange(0, 64)
    return rng.getrandbits(bits)


def random_float(rng: random.Random) -> float:
    """A value for a float32 field."""
    return rng.choice(_INTERESTING_FLOATS) if rng.random() < 0.6 else rng.uniform(-150.0, 150.0)


def random_text(rng: random.Random, max_len: int = 80) -> str:
    """Valid UTF-8 (proto strings must be): letters, digits, accents, CJK, emoji, controls."""
    n = rng.randrange(0, max_len + 1)
    alphabet = "".join(rng.sample(_ALPHABETS, rng.randrange(1, len(_ALPHABETS) + 1)))
    return "".join(rng.choice(alphabet) for _ in range(n))


def random_bytes(rng: random.Random, max_len: int = 64) -> bytes:
    return rng.randbytes(rng.randrange(0, max_len + 1))


def pick_id(rng: random.Random, session_ids: Sequence[str]) -> str:
    """One of `session_ids` (sessions the fuzzer saw), or a well-formed id no session has. Draws
    the same randomness whatever the ids: hypothesis replays an example from its draws alone."""
    x = rng.random()
    return session_ids[int(x * len(session_ids))] if session_ids else "never-issued-" + str(int(x * 1e9))


def mutate(data: bytes, rng: random.Random, others: Sequence[bytes] = ()) -> bytes:
    """1-4 byte-level mutations: bit flips, edge-case bytes, inserts, deletes, truncation,
    duplicated ranges, splices with another input."""
    out = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        op = rng.randrange(8)
        if op == 0 and out:
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[rng.randrange(len(out))] = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFF, 0xA7, 0x10, 0x40))
        elif op == 2:
            i = rng.randrange(len(out) + 1)
            out[i:i] = rng.randbytes(rng.randrange(1, 9))
        elif op == 3 and out:
            i = rng.randrange(len(out))
            del out[i:i + rng.randrange(1, 9)]
        elif op == 4:
            del out[rng.randrange(len(out) + 1):]
        elif op == 5 and out:
            i = rng.randrange(len(out))
            j = min(len(out), i + rng.randrange(1, 17))
            out[j:j] = out[i:j]
        elif op == 6 and others:
            other = rng.choice(others)
            cut = rng.randrange(len(out) + 1)
            out = out[:cut] + other[rng.randrange(len(other) + 1):]
        elif op == 7 and out:  # a varint-looking run: lengths and counts that overflow
            i = rng.randrange(len(out))
            out[i:i + 1] = bytes([0xFF] * rng.randrange(1, 11) + [0x01])
    return bytes(out)


# ---- generators, one per target ------------------------------------------------------------------

def random_codec_input(rng: random.Random, corpus: FuzzCorpus) -> tuple[bytes, int]:
    """(payload, max_frames) for `check_codec`."""
    r = rng.random()
    if r < 0.15:
        payload = rng.choice(corpus.payloads)
    elif r < 0.75:
        payload = mutate(rng.choice(corpus.payloads), rng, corpus.payloads)
    elif r < 0.9:  # a valid-looking header, then anything
        payload = bytes([0xA7, 0x10 | rng.randrange(5)]) + random_bytes(rng, 40)
    else:
        payload = random_bytes(rng)
    max_frames = rng.choice((MAX_FRAMES, MAX_FRAMES, rng.randrange(0, 100)))
    return payload, max_frames


def random_client_message(rng: random.Random, corpus: FuzzCorpus, session_ids: Sequence[str] = ()) -> pb.ClientMessage:
    """A ClientMessage of any kind whose fields hold edge cases or anything (what a client written
    from the proto alone might send)."""
    kind = rng.choice(("start", "features", "features", "audio", "finalize", "end", "empty"))
    if kind == "start":
        s = pb.Start(language=rng.choice(("", FUZZ_LANGUAGE, "en", "en-US", "zh", "Klingon", random_text(rng))),
                     context=rng.choice(("", "harken", random_text(rng), "é" * rng.randrange(7990, 8010))),
                     codec=rng.choice(("", CODEC_NAME, "opus", "harken-mel/2", random_text(rng, 50))),
                     session_id=rng.choice(("", "", random_text(rng, 70), pick_id(rng, session_ids))),
                     last_event_seq=random_int(rng, 64))
        if rng.random() < 0.3:
            s.seed.CopyFrom(pb.SessionSeed(present=rng.random() < 0.8, running_max_log10=random_float(rng),
                                           context_tail=random_text(rng), next_segment_id=random_int(rng, 32)))
        return pb.ClientMessage(start=s)
    if kind == "features":
        payload = rng.choice((rng.choice(corpus.payloads), mutate(rng.choice(corpus.payloads), rng), random_bytes(rng),
                              b""))
        f = pb.Features(seq=random_int(rng, 64), segment_id=random_int(rng, 32), first_frame=random_int(rng, 64),
                        frame_count=random_int(rng, 32), segment_start=rng.random() < 0.5,
                        segment_end=rng.random() < 0.5, payload=payload)
        if rng.random() < 0.5:
            f.running_max_log10 = random_float(rng)
        if rng.random() < 0.5:
            f.payload_crc32c = payload_crc32c(payload) if rng.random() < 0.7 else rng.getrandbits(32)
        return pb.ClientMessage(features=f)
    if kind == "audio":
        pcm = rng.choice((rng.choice(corpus.pcm_pieces), random_bytes(rng, 801), b"", rng.choice(corpus.pcm_pieces)[1:]))
        rate = rng.choice((SAMPLE_RATE, 8_000, 48_000, 7_999, 192_001, random_int(rng, 32)))
        return pb.ClientMessage(audio=pb.Audio(seq=random_int(rng, 64), pcm16=pcm, sample_rate=rate))
    if kind == "finalize":
        return pb.ClientMessage(finalize=pb.Finalize())
    if kind == "end":
        return pb.ClientMessage(end=pb.End())
    return pb.ClientMessage()


def random_wire_input(rng: random.Random, corpus: FuzzCorpus) -> bytes:
    """Bytes a client could send as one message."""
    r = rng.random()
    if r < 0.35:
        return random_client_message(rng, corpus).SerializeToString()
    if r < 0.7:
        return mutate(rng.choice(corpus.messages), rng, corpus.messages)
    if r < 0.85:
        return rng.choice(corpus.messages)
    return random_bytes(rng)


def random_json_text(rng: random.Random) -> str:
    """Text frames for the data channel: control frames, statuses, JSON of every shape, not JSON."""
    r = rng.randrange(10)
    if r == 0:
        return json.dumps({"half_close": rng.choice((True, 1, "yes", None, 0, [], {}))})
    if r == 1:
        return json.dumps({"flush_audio": rng.choice((True, False, 2))})
    if r == 2:
        return json.dumps({"status": rng.choice(("OK", "INVALID_ARGUMENT", "UNAVAILABLE", "ok", "", 3, None, [1],
                                                 {"a": 1})),
                           "message": rng.choice(("", random_text(rng), 7, None, ["x"]))})
    if r == 3:  # deep nesting: the JSON parser's recursion limit
        depth = rng.choice((10, 1_000, 20_000, 60_000))
        return rng.choice(("[", '{"a":')) * depth
    if r == 4:
        return rng.choice(("1" * rng.randrange(1, 6000), "1e999", "-0", "NaN", "Infinity", "null", "true", '""', "[]"))
    if r == 5:
        return json.dumps([random_text(rng, 10) for _ in range(rng.randrange(4))])
    if r == 6:
        return random_text(rng, 200)
    if r == 7:
        return "".join(rng.choice('{}[]:,"01a ') for _ in range(rng.randrange(60)))
    if r == 8:
        return json.dumps({random_text(rng, 8): random_text(rng, 8) for _ in range(rng.randrange(4))})
    return ""


def random_datachannel_server_input(rng: random.Random, corpus: FuzzCorpus) -> bytes | str:
    return random_wire_input(rng, corpus) if rng.random() < 0.5 else random_json_text(rng)


def random_server_message(rng: random.Random) -> pb.ServerMessage:
    kind = rng.randrange(5)
    if kind == 0:
        return pb.ServerMessage(ready=pb.Ready(session_id=random_text(rng, 30), resume_after_seq=random_int(rng, 64),
                                               last_final_segment=random_int(rng, 63) * rng.choice((1, -1)),
                                               keep_alive=rng.random() < 0.5))
    if kind == 1:
        t = pb.Transcript(segment_id=random_int(rng, 32), committed_delta=random_text(rng), partial=random_text(rng),
                          stability=random_float(rng), start_s=random_float(rng), end_s=random_float(rng),
                          language=random_text(rng, 12), is_final=rng.random() < 0.5, event_seq=random_int(rng, 64))
        if rng.random() < 0.3:
            t.seed.CopyFrom(pb.SessionSeed(present=rng.random() < 0.8, running_max_log10=random_float(rng),
                                           context_tail=random_text(rng), next_segment_id=random_int(rng, 32)))
        return pb.ServerMessage(transcript=t)
    if kind == 2:
        return pb.ServerMessage(ack=pb.Ack(seq=random_int(rng, 64), last_final_segment=random_int(rng, 63)))
    if kind == 3:
        code = rng.choice(("OK", "INVALID_ARGUMENT", "NOT_FOUND", "name", "value", "__class__", random_text(rng, 20)))
        return pb.ServerMessage(error=pb.Error(code=code, message=random_text(rng)))
    return pb.ServerMessage()


def random_datachannel_client_input(rng: random.Random) -> bytes | str:
    r = rng.random()
    if r < 0.3:
        return random_json_text(rng)
    message = random_server_message(rng).SerializeToString()
    if r < 0.6:
        return message
    if r < 0.9:
        return mutate(message, rng)
    return random_bytes(rng)


# ---- whole streams ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class FuzzStream:
    """One stream: raw messages (what the client writes), then a half-close or a dropped connection."""

    messages: tuple[bytes, ...]
    drop: bool = False  # keep the request side open after the messages, then cancel the call
    drop_after_s: float = 0.0

    def first_kind(self) -> str | None:
        """The first message's kind, "garbage" when it is no ClientMessage, None when there is none."""
        if not self.messages:
            return None
        try:
            return pb.ClientMessage.FromString(self.messages[0]).WhichOneof("kind") or "empty"
        except Exception:
            return "garbage"


MAX_STREAM_MESSAGES = 12
_OPS = ("next_features", "next_audio", "duplicate", "gap", "stray_packet", "mutated_features", "mutated_bytes",
        "garbage", "empty", "finalize", "end", "start", "random_message")
_OP_WEIGHTS = (8, 2, 1, 1, 1, 2, 1, 1, 0.5, 1, 1.5, 0.5, 1)


def random_stream(rng: random.Random, corpus: FuzzCorpus, session_ids: Sequence[str] = ()) -> FuzzStream:
    """A stream that mostly goes some way into a valid session before it goes wrong, if it does."""
    r = rng.random()
    if r < 0.65:
        first = pb.ClientMessage(start=pb.Start(language=rng.choice((FUZZ_LANGUAGE, FUZZ_LANGUAGE, "", "en")),
                                                codec=rng.choice((CODEC_NAME, CODEC_NAME, ""))))
    elif r < 0.75:
        first = pb.ClientMessage(start=pb.Start(session_id=pick_id(rng, session_ids), language=FUZZ_LANGUAGE,
                                                last_event_seq=rng.choice((0, 0, 1, 5, random_int(rng, 64)))))
    elif r < 0.8:
        first = pb.ClientMessage(start=pb.Start(codec=CODEC_NAME, language=FUZZ_LANGUAGE, seed=pb.SessionSeed(
            present=True, running_max_log10=rng.choice((-2.0, 0.5, -math.inf)), context_tail=random_text(rng, 20),
            next_segment_id=rng.choice((0, 1, 3)))))
    else:
        first = random_client_message(rng, corpus, session_ids)
    messages = [first.SerializeToString()]
    if r >= 0.95:
        messages[0] = mutate(messages[0], rng)
    seq, cursor, pcm_cursor = 0, 0, 0
    for _ in range(rng.randrange(0, MAX_STREAM_MESSAGES + 1)):
        op = rng.choices(_OPS, _OP_WEIGHTS)[0]
        if op == "next_features" and cursor < len(corpus.packets):
            seq += 1
            messages.append(features_message(corpus.packets[cursor], seq).SerializeToString())
            cursor += 1
        elif op == "next_audio":
            seq += 1
            pcm = corpus.pcm_pieces[pcm_cursor % len(corpus.pcm_pieces)]
            pcm_cursor += 1
            messages.append(pb.ClientMessage(audio=pb.Audio(seq=seq, pcm16=pcm, sample_rate=SAMPLE_RATE))
                            .SerializeToString())
        elif op in ("duplicate", "gap", "stray_packet"):
            p = rng.choice(corpus.packets) if op == "stray_packet" else corpus.packets[max(0, cursor - 1)]
            s = {"duplicate": max(seq, 1), "gap": seq + rng.randrange(2, 5), "stray_packet": seq + 1}[op]
            messages.append(features_message(p, s).SerializeToString())
        elif op == "mutated_features":
            f = features_message(corpus.packets[min(cursor, len(corpus.packets) - 1)], seq + 1).features
            _mutate_features(f, rng)
            messages.append(pb.ClientMessage(features=f).SerializeToString())
        elif op == "mutated_bytes":
            messages.append(mutate(rng.choice(corpus.messages), rng, corpus.messages))
        elif op == "garbage":
            messages.append(random_bytes(rng))
        elif op == "empty":
            messages.append(b"")
        elif op == "finalize":
            messages.append(pb.ClientMessage(finalize=pb.Finalize()).SerializeToString())
        elif op == "end":
            messages.append(pb.ClientMessage(end=pb.End()).SerializeToString())
        elif op == "start":
            messages.append(pb.ClientMessage(start=pb.Start(codec=CODEC_NAME)).SerializeToString())
        elif op == "random_message":
            messages.append(random_client_message(rng, corpus, session_ids).SerializeToString())
    drop = rng.random() < 0.2
    return FuzzStream(tuple(messages), drop=drop, drop_after_s=rng.choice((0.0, 0.0, 0.01, 0.05)) if drop else 0.0)


def _mutate_features(f: pb.Features, rng: random.Random) -> None:
    """One field of a valid Features message made wrong (or right in another way)."""
    what = rng.randrange(10)
    if what == 0:
        f.frame_count = max(0, f.frame_count + rng.choice((-1, 1, 100)))
    elif what == 1:
        f.first_frame = random_int(rng, 64)
    elif what == 2:
        f.segment_id = random_int(rng, 32)
    elif what == 3:
        f.segment_start = not f.segment_start
    elif what == 4:
        f.segment_end = not f.segment_end
    elif what == 5:
        f.payload = mutate(f.payload, rng)  # its CRC32C no longer matches (mostly)
    elif what == 6:
        f.payload = mutate(f.payload, rng)
        f.payload_crc32c = payload_crc32c(f.payload)  # a corrupted payload that passes the CRC
    elif what == 7:
        f.running_max_log10 = random_float(rng)
    elif what == 8:
        f.seq = random_int(rng, 64)
    else:
        f.payload = struct.pack("<BB", 0xA7, 0x10 | rng.randrange(1, 4)) + f.payload[2:]
        f.payload_crc32c = payload_crc32c(f.payload)
