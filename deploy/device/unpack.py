"""Unpack what `make device-carry` gathered, with the Python standard library alone (a lent GPU's
image may have no dpkg and no pip):

    python deploy/device/unpack.py deb PACKAGE.deb ROOT     the package's files under ROOT (never /)
    python deploy/device/unpack.py wheel WHEEL.whl SITE     the wheel's files under SITE (on PYTHONPATH)
"""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from pathlib import Path


def ar_members(data: bytes) -> dict[str, bytes]:
    """The members of a Unix ar archive (a .deb is one: debian-binary, control.tar.*, data.tar.*)."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    out, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        out[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
    return out


def unpack_deb(deb: Path, root: Path) -> None:
    members = ar_members(deb.read_bytes())
    name = next((n for n in members if n.startswith("data.tar")), None)
    if name is None:
        raise ValueError(f"{deb}: no data.tar member")
    payload = members[name]
    if name.endswith(".zst"):
        if sys.version_info >= (3, 14):
            from compression import zstd
        else:
            from backports import zstd  # the carried wheel: Python < 3.14 has no zstd of its own

        payload = zstd.decompress(payload)
    with tarfile.open(fileobj=io.BytesIO(payload), mode="r:*") as tar:
        tar.extractall(root, filter="tar")


def unpack_wheel(wheel: Path, site: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("deb", "wheel"):
        print(__doc__, file=sys.stderr)
        return 2
    kind, src, dest = argv[0], Path(argv[1]), Path(argv[2])
    dest.mkdir(parents=True, exist_ok=True)
    (unpack_deb if kind == "deb" else unpack_wheel)(src, dest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
