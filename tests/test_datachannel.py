"""shared/datachannel: on a real aiortc data channel (two peer connections on loopback), a writer
waits on `bufferedamountlow` while the channel's queue is past the high-water mark, so the queue
stays bounded, and every message arrives in order; a writer waiting on a channel that closes gets
ConnectionError instead of hanging."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest

from harken.bench.wire import open_loopback
from harken.shared.datachannel import send_when_drained

TIMEOUT = 60


@asynccontextmanager
async def channel_pair():
    """(sending channel, list the receiver appends every message to)."""
    from aiortc import RTCPeerConnection

    client, server = RTCPeerConnection(), RTCPeerConnection()
    received: list[bytes] = []

    @server.on("datachannel")
    def on_channel(channel):
        channel.on("message", received.append)

    channel = client.createDataChannel("test", ordered=True)
    try:
        await open_loopback(client, server, channel)
        yield channel, received, client
    finally:
        await client.close()
        await server.close()


def test_the_queue_stays_bounded_and_everything_arrives_in_order():
    high_water, size, count = 64 << 10, 16 << 10, 200  # 3.2 MB through a 64 kB queue

    async def main():
        async with channel_pair() as (channel, received, _):
            peak, waited = 0, 0
            for i in range(count):
                waited += channel.bufferedAmount > high_water
                await send_when_drained(channel, i.to_bytes(4, "big") * (size // 4), high_water)
                peak = max(peak, channel.bufferedAmount)
            while len(received) < count:
                await asyncio.sleep(0.05)
            return peak, waited, received

    peak, waited, received = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert peak <= high_water + size
    assert waited > 0  # the writer did wait: the network is slower than a loop of sends
    assert [m[:4] for m in received] == [i.to_bytes(4, "big") for i in range(count)]


def test_a_writer_waiting_on_a_channel_that_closes_gets_an_error():
    async def main():
        async with channel_pair() as (channel, _, client):
            for _ in range(64):
                channel.send(bytes(16 << 10))  # 1 MB queued at once, past the mark below
            writer = asyncio.create_task(send_when_drained(channel, b"late", high_water=1 << 10))
            await asyncio.sleep(0)
            assert not writer.done()  # waiting for the queue to drain
            await client.close()  # the connection goes
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(writer, 10)

    asyncio.run(asyncio.wait_for(main(), TIMEOUT))
