"""cloud/ray_app: harken on Ray Serve — two replicas of the tiny model behind Serve's gRPC proxy,
driven by the SDK (edge/client/grpc_client.py) as any `harken serve` would be.

What is checked: streams spread over both replicas, each transcript identical to the in-process
engine's; a resume after a cut connection reaches the replica that holds its session (it is
found: no replacement session); killing a replica mid-stream (ray.kill) costs no words — its
streams replay into new sessions on the other replica, the other replica's streams never notice.

One local Ray cluster for the module, kept small (2 CPUs, no dashboard, a 200 MB object store)
and always shut down.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import numpy as np
import pytest

import ray  # the scale extra (make installs it)

from harken.cloud.server import ServerOptions  # noqa: E402
from harken.edge.client import ClientOptions, TranscriptionClient  # noqa: E402
from harken.edge.audio import peak_normalize  # noqa: E402
from harken.edge.client.front_end import audio_pieces  # noqa: E402
from harken.shared.transcript import TranscriptEvent  # noqa: E402
from faults import CuttingProxy  # noqa: E402
from signals import concat, silence, speech  # noqa: E402

LANGUAGE = "English"
REPLICAS = 2
FAST = dict(backoff_initial_s=0.05, backoff_max_s=0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """Two utterances with a pause: two VAD segments, ~5 s."""
    return peak_normalize(concat(silence(0.3), speech("Hello there, this is a test."), silence(0.8),
                                 speech("A second sentence follows now."), silence(0.5)))


@pytest.fixture(scope="module")
def serving():
    """Two replicas of the tiny model on a local Ray cluster; Serve and Ray shut down after."""
    from harken.cloud.ray_app import Scaling, start_ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 << 20, logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        yield start_ray("tiny", ServerOptions(host="127.0.0.1", port=_free_port(), max_sessions=4,
                                              shutdown_grace_s=2.0),
                        Scaling(REPLICAS, REPLICAS, replica_cpus=0.5), serve_http_port=_free_port())
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def same_transcript(events: list[TranscriptEvent], reference: list[TranscriptEvent]) -> bool:
    """The same committed text per segment and the same finals (segment, times). Partial events
    may differ: a segment's last update is folded into its final when the segment's end arrives
    before the engine got to that update, which depends on timing, not on the features."""
    def texts(evs):
        out: dict[int, str] = {}
        for e in evs:
            out[e.segment_id] = out.get(e.segment_id, "") + e.committed_delta
        return out

    def finals(evs):
        return [(e.segment_id, e.start_s, e.end_s, e.language) for e in evs if e.is_final]

    return texts(events) == texts(reference) and finals(events) == finals(reference)


def keys_per_replica(serving, n: int) -> dict[str, list[str]]:
    """`n` route keys for each replica (asked of the router: the key a stream sends decides its
    replica), so that the tests do not depend on how random keys happen to fall."""
    out: dict[str, list[str]] = {}
    i = 0
    while len(out) < REPLICAS or any(len(v) < n for v in out.values()):
        key = f"stream-{i}"
        i += 1
        replica = serving.replica_of(key)["replica"]
        if len(out.setdefault(replica, [])) < n:
            out[replica].append(key)
        assert i < 200, out
    return out


def wait_for_running_replicas(n: int) -> None:
    import time

    from ray import serve

    from harken.cloud.ray_app import APP_NAME, DEPLOYMENT_NAME

    for _ in range(600):  # a hang guard, not a timing
        dep = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME]
        if dep.replica_states.get("RUNNING", 0) == n and sum(dep.replica_states.values()) == n:
            return
        time.sleep(0.2)
    raise AssertionError(f"not {n} running replicas: {dep.replica_states}")


async def transcribe(target: str, audio, key: str, **options) -> tuple[list[TranscriptEvent], object]:
    client = TranscriptionClient(target, options=ClientOptions(language=LANGUAGE, route_key=key, **FAST, **options))
    events = [e async for e in client.stream(audio_pieces(audio))]
    return events, client.stats


def test_streams_spread_over_both_replicas_with_identical_transcripts(serving, audio, reference):
    keys = keys_per_replica(serving, 3)
    assert len(keys) == REPLICAS

    async def main():
        return await asyncio.gather(*(transcribe(serving.address, audio, k) for ks in keys.values() for k in ks))

    results = asyncio.run(main())
    assert len(results) == 6
    for events, stats in results:
        assert same_transcript(events, reference)
        assert stats.sessions_opened == 1 and stats.resumes == 0


def test_resume_after_a_cut_lands_on_the_replica_holding_the_session(serving, audio, reference):
    """The TCP connection to Serve's proxy is cut several times: every resume finds its session
    (a resume reaching the other replica would get NOT_FOUND and open a replacement session)."""
    keys = keys_per_replica(serving, 1)

    async def main():
        host, port = serving.address.rsplit(":", 1)
        proxy = await CuttingProxy(host, int(port), min_bytes=1_500, max_bytes=4_000, max_cuts=4, seed=3).start()
        try:
            return await asyncio.gather(*(transcribe(proxy.target, audio, ks[0]) for ks in keys.values())), proxy.cuts
        finally:
            await proxy.close()

    results, cuts = asyncio.run(main())
    assert cuts >= 2
    assert sum(stats.resumes for _, stats in results) >= 2
    for events, stats in results:
        assert stats.sessions_opened == 1, stats
        assert same_transcript(events, reference)


def test_killed_replica_loses_no_words(serving, audio, reference):
    """ray.kill one replica mid-stream: its streams replay their unfinished segments into new
    sessions on a replica still alive and come out identical; the other replica's streams go on
    as if nothing happened."""
    keys = keys_per_replica(serving, 2)
    victim, survivor = list(keys)
    victim_actor = ray.get_actor(serving.replica_of(keys[victim][0])["actor"], namespace="serve")
    killed = asyncio.Event()

    async def stream(key: str):
        client = TranscriptionClient(serving.address, options=ClientOptions(language=LANGUAGE, route_key=key, **FAST))
        events = []
        async for e in client.stream(audio_pieces(audio)):
            events.append(e)
            if key in keys[victim] and e.is_final and not killed.is_set():
                killed.set()
                ray.kill(victim_actor, no_restart=False)
        return events, client.stats

    async def main():
        return await asyncio.gather(*(stream(k) for ks in keys.values() for k in ks))

    results = asyncio.run(main())
    for k, (_, stats) in zip([k for ks in keys.values() for k in ks], results):
        print(f"\n{'killed' if k in keys[victim] else 'alive'} replica: sessions={stats.sessions_opened} "
              f"failed attempts={stats.failed_attempts} frames resent={stats.frames_resent} of "
              f"{stats.frames_produced} ({stats.last_failure[:80]})")
    assert killed.is_set()
    by_key = dict(zip([k for ks in keys.values() for k in ks], results))
    for key, (events, stats) in by_key.items():
        assert same_transcript(events, reference), key
        if key in keys[survivor]:
            assert stats.sessions_opened == 1 and stats.failed_attempts == 0, stats
    replayed = [stats for k, (_, stats) in by_key.items() if k in keys[victim]]
    assert any(s.sessions_opened == 2 for s in replayed), replayed


def test_leaving_replicas_finalise_their_open_segments(serving, reference):
    """Drain: the application is redeployed (Serve replaces the replicas one by one, a rolling
    update) while one stream on each replica is held inside its second segment (the client sends
    nothing more, its stream open). The leaving replica finalises that segment and sends its final
    while the client still holds: only the drain can have made it (no End was sent, and Serve's
    own stop would have waited for the stream to end, then killed the replica with the segment
    unfinished). A stream may move twice (to the other old replica, then to a new one) and is
    drained again. Released, each client goes on in a new session: the first segment as the
    reference's, no final segment given more text. (Last with `serving`.)"""
    wait_for_running_replicas(REPLICAS)  # the one the previous test killed is back
    keys = [ks[0] for ks in keys_per_replica(serving, 1).values()]
    parts = [silence(0.3), speech("Hello there, this is a test."), silence(0.8),
             speech("A second sentence follows now."), silence(0.5)]
    audio = peak_normalize(concat(*parts))
    hold_at = sum(p.size for p in parts[:3]) + parts[3].size // 2  # inside the second segment
    held = {k: asyncio.Event() for k in keys}
    during_hold: dict[str, list[TranscriptEvent]] = {k: [] for k in keys}

    async def main():
        release = asyncio.Event()

        async def source(key: str):
            sent = 0
            for p in audio_pieces(audio):
                if sent >= hold_at and not release.is_set():
                    held[key].set()
                    await release.wait()
                yield p
                sent += p.size

        async def stream(key: str):
            client = TranscriptionClient(serving.address,
                                         options=ClientOptions(language=LANGUAGE, route_key=key, **FAST))
            events = []
            async for e in client.stream(source(key)):
                events.append(e)
                if held[key].is_set() and not release.is_set():
                    during_hold[key].append(e)
            return events, client.stats

        tasks = [asyncio.create_task(stream(k)) for k in keys]
        await asyncio.wait_for(asyncio.gather(*(h.wait() for h in held.values())), 120)
        await asyncio.sleep(1.0)  # the held segments' last packets reach their engines
        redeployed = asyncio.create_task(asyncio.to_thread(serving.redeploy, REPLICAS))
        for _ in range(600):  # until both drained finals arrive (a hang guard, not a timing)
            if all(any(e.is_final and e.segment_id == 1 for e in evs) for evs in during_hold.values()):
                break
            await asyncio.sleep(0.1)
        await redeployed  # the new replicas are up: the clients' resumes reach them
        release.set()
        return dict(zip(keys, await asyncio.gather(*tasks)))

    results = asyncio.run(main())
    for key in keys:
        assert 1 in [e.segment_id for e in during_hold[key] if e.is_final], during_hold[key]
        events, stats = results[key]
        assert stats.sessions_opened >= 2, stats  # went on in a new session on another replica
        assert same_transcript([e for e in events if e.segment_id == 0], [e for e in reference if e.segment_id == 0])
        final: set[int] = set()
        for e in events:  # a final segment gets no more text
            assert e.segment_id not in final, e
            if e.is_final:
                final.add(e.segment_id)


def _context(reports: list[tuple[float, float, float]], current: int, lo: int = 1, hi: int = 4):
    """Serve's AutoscalingContext with each replica's (sessions, slots, waiting) report."""
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    dep = DeploymentID(name="TranscriptionReplica", app_name="harken")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(len(reports))]
    metrics = {name: {r: rep[j] for r, rep in zip(replicas, reports)}
               for j, name in enumerate(("sessions", "slots", "waiting"))}
    return AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name, current_num_replicas=current,
        target_num_replicas=current, running_replicas=replicas, total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=metrics, raw_metrics=None, capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=None, config=AutoscalingConfig(min_replicas=lo, max_replicas=hi))


def test_autoscaling_policy_follows_sessions_held_over_slots():
    """Sessions / (slots x 0.75), within the bounds; one more while every replica has sessions
    waiting for the model; none reported yet: unchanged."""
    from harken.cloud.ray_app import autoscaling_policy

    assert autoscaling_policy(_context([(14, 16, 0), (14, 16, 0)], current=2))[0] == 3  # 28 / 12
    assert autoscaling_policy(_context([(2, 16, 0), (1, 16, 0)], current=2))[0] == 1
    assert autoscaling_policy(_context([(0, 16, 0)], current=1))[0] == 1
    assert autoscaling_policy(_context([(16, 16, 0)] * 4, current=4))[0] == 4  # capped at max
    assert autoscaling_policy(_context([(4, 16, 3), (4, 16, 1)], current=2))[0] == 3  # model saturated
    assert autoscaling_policy(_context([(4, 16, 3), (4, 16, 0)], current=2))[0] == 1


def test_the_drain_watch_keeps_the_controller_load_linear_in_the_fleet():
    """Each replica's poll reads the whole deployment's details (O(replicas)); every replica polls.
    The interval grows with the fleet so the polls a second stay at DRAIN_POLLS_PER_S in all, and
    stays within half of Serve's margin, so a leaving replica still notices in time to drain."""
    from harken.cloud.ray_app import DRAIN_MARGIN_S, DRAIN_POLL_S, DRAIN_POLLS_PER_S, drain_poll_interval

    assert drain_poll_interval(1) == drain_poll_interval(4) == DRAIN_POLL_S
    for n in (10, 20, 40):
        assert n / drain_poll_interval(n) <= DRAIN_POLLS_PER_S + 1e-9  # the fleet's polls a second
    assert drain_poll_interval(1000) == DRAIN_MARGIN_S / 2
