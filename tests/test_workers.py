"""`harken serve --workers N` (cloud/workers.py, cloud/hosting/engine_link.py): front-end processes
on one port, the engine in this test's process on the tiny model.

The crash test: several live streams through two front ends; the front end holding most of them is
killed with SIGKILL mid-stream. Its clients reconnect (to a front end that does not know their
sessions: NOT_FOUND), open seeded sessions and replay their unfinished segments: every transcript
equals the one without the fault and no frame is lost; the engine process starts a new front end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import psutil
import pytest

from harken.cloud.server import ServerOptions
from harken.cloud.workers import start_workers
from harken.edge.client.grpc_client import ClientOptions, TranscriptionClient, audio_pieces
from harken.shared.errors import HarkenError
from streaming import segment_texts
from transport_helpers import LANGUAGE, REPO, _finals, _frames_applied, live
from transport_helpers import audio  # noqa: F401 - the module fixture: pytest finds it here

STREAMS = 4


async def paced(pieces):
    """100-ms pieces at 2x real time: the kill falls mid-stream, with seconds of audio to go."""
    async for piece in live(pieces):  # (3x real time)
        await asyncio.sleep(0.02)
        yield piece


def _connections(pid: int, port: int) -> int:
    """Client connections the process `pid` holds on the served port."""
    return sum(1 for c in psutil.Process(pid).net_connections(kind="tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)


def test_a_front_end_killed_mid_stream_loses_no_word(asr, audio, reference):  # noqa: F811
    async def main():
        workers = await start_workers(asr, ServerOptions(host="127.0.0.1", port=0, workers=2))
        try:
            first_finals = [asyncio.Event() for _ in range(STREAMS)]
            clients = [TranscriptionClient(workers.address, language=LANGUAGE,
                                           options=ClientOptions(backoff_initial_s=0.05, backoff_max_s=0.5))
                       for _ in range(STREAMS)]

            async def one(i: int):
                events = []
                async for e in clients[i].stream(paced(audio_pieces(audio))):
                    events.append(e)
                    if e.is_final:
                        first_finals[i].set()
                return events

            tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in first_finals)), 120)
            pids = workers.front_end_pids()
            held = {i: _connections(pid, workers.port) for i, pid in pids.items()}
            victim = max(held, key=lambda i: held[i])
            os.kill(pids[victim], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
            for _ in range(600):  # the engine process starts a new front end in its place
                if workers.front_end_pids().get(victim, pids[victim]) != pids[victim]:
                    break
                await asyncio.sleep(0.1)
            after = workers.front_end_pids()
            alive = all(psutil.pid_exists(pid) for pid in after.values())  # the new one serving beside the other
            return results, [c.stats for c in clients], held, victim, after, pids, workers.restarts, alive
        finally:
            await workers.stop(1)

    results, stats, held, victim, after, before, restarts, alive = asyncio.run(main())
    print(f"\nconnections per front end {held}; killed front end {victim}; "
          f"sessions opened per client {[s.sessions_opened for s in stats]}, "
          f"frames resent {[s.frames_resent for s in stats]}")
    assert held[victim] >= STREAMS // 2
    # its clients went on in new sessions (a client whose stream had ended before the kill, if
    # any, had nothing left to replay)
    assert sum(s.sessions_opened > 1 for s in stats) >= 1 and all(s.sessions_opened <= 2 for s in stats)
    for events, s in zip(results, stats):
        assert _frames_applied(events) == s.frames_produced  # no frame lost
        assert segment_texts(events) == segment_texts(reference)
        assert _finals(events) == _finals(reference)
        assert s.replay_mismatches == 0
    assert restarts == 1 and after[victim] != before[victim] and alive and len(after) == 2


def test_streams_through_workers_are_the_in_process_ones(asr, audio, reference):  # noqa: F811
    """Without faults, streams spread over two front ends get the in-process engine's events."""
    async def main():
        workers = await start_workers(asr, ServerOptions(host="127.0.0.1", port=0, workers=2))
        try:
            async def one():
                return [e async for e in TranscriptionClient(workers.address, language=LANGUAGE).stream(
                    audio_pieces(audio))]
            return await asyncio.gather(*(one() for _ in range(3)))
        finally:
            await workers.stop(1)

    for events in asyncio.run(main()):
        assert segment_texts(events) == segment_texts(reference)
        assert _finals(events) == _finals(reference)


@pytest.mark.parametrize("flags, says", [
    (["--aligner", "tiny"], "--aligner does not go with --workers"),
    (["--ray"], "--workers does not go with --ray"),
    (["--metrics-port", "0"], "--metrics-port does not go with --workers"),
])
def test_options_that_do_not_go_with_workers_say_so(flags, says):
    out = subprocess.run([sys.executable, "-m", "harken", "serve", "--model", "tiny", "--port", "0",
                          "--workers", "2", *flags], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0 and says in out.stderr, out.stderr[-2000:]


def test_workers_options_are_checked():
    with pytest.raises(HarkenError, match="--workers"):
        ServerOptions(workers=-1)


def test_frames_cross_the_link_as_raw_float32_behind_a_fixed_head():
    import numpy as np

    from harken.cloud.hosting.engine_link import FRAME_HEAD, FRAMES, HEAD, frames_message, parse_frames

    frames = np.random.default_rng(0).standard_normal((128, 7)).astype(np.float32)
    for running in (None, -3.25):
        msg = frames_message(5, 9, 120, frames, True, False, running)
        kind, n = HEAD.unpack_from(msg)
        assert kind == FRAMES and n == len(msg) - HEAD.size == FRAME_HEAD.size + frames.nbytes  # no pickle
        h, seg, first, got, start, end, got_running = parse_frames(msg[HEAD.size:])
        assert (h, seg, first, start, end, got_running) == (5, 9, 120, True, False, running)
        np.testing.assert_array_equal(got, frames)
