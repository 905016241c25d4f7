"""engine-load's plot (`harken bench engine-load`): streams vs p50/p95 update latency and the
target, drawn with matplotlib where it is installed, else as a plain raster PNG written here."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot(result: dict, path: Path) -> str:
    """streams (log scale) vs p50/p95 update latency, the target as a line. matplotlib where it is
    installed (the device image has it); otherwise a plain raster written here (no text). Returns
    what drew it."""
    levels = [lv for lv in result["levels"] if lv["p95_update_ms"] is not None]
    xs = [lv["streams"] for lv in levels]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _raster_plot(xs, [lv["p95_update_ms"] for lv in levels], result["target_p95_update_ms"], path)
        return "raster"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(xs, [lv["p95_update_ms"] for lv in levels], "o-", label="p95 update")
    ax.plot(xs, [lv["p50_update_ms"] for lv in levels], "s--", label="p50 update", alpha=0.7)
    ax.axhline(result["target_p95_update_ms"], color="red", lw=1, label=f"target {result['target_p95_update_ms']:.0f} ms")
    if xs:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent real-time streams")
    ax.set_ylabel("update latency, ms")
    ax.set_title(f"harken engine-load: {result['model']}, {result['dtype']}, {result.get('gpu') or 'cpu'}",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


def _raster_plot(xs: list[int], ys: list[float], target: float, path: Path, w: int = 640, h: int = 400) -> None:
    import zlib

    img = np.full((h, w, 3), 255, np.uint8)
    m = 40
    img[h - m, m:w - m] = img[m:h - m, m] = 0  # axes
    if xs:
        lx = np.log2(np.array(xs, float))
        x0, x1 = lx.min(), max(lx.max(), lx.min() + 1)
        ymax = max(max(ys), target) * 1.15

        def px(x, y):
            return int(m + (x - x0) / (x1 - x0) * (w - 2 * m - 1)), int(h - m - y / ymax * (h - 2 * m - 1))

        img[px(x0, target)[1], m:w - m] = (220, 0, 0)
        pts = [px(a, b) for a, b in zip(lx, ys)]
        for (ax_, ay), (bx, by) in zip(pts, pts[1:]):
            for s in np.linspace(0, 1, max(abs(bx - ax_), abs(by - ay)) + 1):
                img[int(ay + s * (by - ay)), int(ax_ + s * (bx - ax_))] = (0, 70, 200)
        for x, y in pts:
            img[max(y - 3, 0):y + 4, max(x - 3, 0):x + 4] = (0, 70, 200)
    raw = b"".join(b"\0" + img[r].tobytes() for r in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6))
                     + chunk(b"IEND", b""))
