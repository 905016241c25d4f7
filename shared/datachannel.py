"""Writing to a WebRTC data channel (aiortc) with back-pressure: one copy for both sides
(edge/client/webrtc_client.py, cloud/adapters/webrtc.py).

A data channel queues whatever is sent at once, however slow the network; a writer that waits
while more than a high-water mark is queued backs a slow network up to itself instead of into
memory. It waits for aiortc's `bufferedamountlow` event (fired when the queue drops to
`bufferedAmountLowThreshold`), as a browser would, not polling `bufferedAmount`.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Any

SEND_HIGH_WATER = 1 << 20  # bytes queued on a channel before a write waits for the network


async def send_when_drained(channel: Any, data: bytes | str, high_water: int = SEND_HIGH_WATER) -> None:
    """Send `data` on `channel` (an aiortc RTCDataChannel) once no more than `high_water` bytes
    are queued on it. Raises ConnectionError when the channel is, or gets, closed."""
    if channel.readyState == "open" and channel.bufferedAmount > high_water:
        channel.bufferedAmountLowThreshold = high_water
        drained = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not drained.done():
                drained.set_result(None)

        channel.on("bufferedamountlow", wake)
        channel.on("close", wake)
        try:
            await drained
        finally:
            for event in ("bufferedamountlow", "close"):
                with suppress(KeyError):  # a closed channel has dropped every listener already
                    channel.remove_listener(event, wake)
    if channel.readyState != "open":
        raise ConnectionError("the data channel closed")
    channel.send(data)
