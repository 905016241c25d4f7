"""The edge's test vectors (edge/web/vectors/) and the TypeScript port checked against them.

- The committed vectors still match the Python edge: the same features (1e-5), VAD decisions,
  packets and wire messages (byte for byte), codec payloads and codec tables.
- The node tests (edge/web/test/, `node --test` on onnxruntime-node) pass: the TypeScript log-mel
  and VAD within 1e-4 of these vectors, its payloads and messages byte-identical. Node is required
  (`make test` installs the npm packages; CI without node fails here rather than skipping).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import web_vectors as wv

WEB = wv.ROOT / "edge" / "web"


@pytest.fixture(scope="module")
def computed():
    return wv.compute()


def test_committed_vectors_match_the_python_edge(computed):
    mels, records, cases = computed
    assert sorted(mels) == ["tone_silence", "two_segments"]
    for name, mel in mels.items():
        committed = np.fromfile(wv.VECTORS / f"{name}.logmel.f32", dtype="<f4").reshape(128, -1)
        assert committed.shape == mel.shape
        assert float(np.abs(committed - mel).max()) <= 1e-5, name
        want = json.loads((wv.VECTORS / f"{name}.json").read_text())
        got = json.loads(wv.dumps(records[name]))
        probs_want, probs_got = want.pop("vad_probabilities"), got.pop("vad_probabilities")
        assert np.abs(np.array(probs_want) - np.array(probs_got)).max() <= 1e-5
        assert got == want, name
    assert json.loads(wv.dumps({"cases": cases})) == json.loads((wv.VECTORS / "codec.json").read_text())
    assert json.loads(wv.dumps(wv.wire_cases())) == json.loads((wv.VECTORS / "wire.json").read_text())
    assert any(r["packets"] for r in records.values())  # speech: packets, not only silence


def test_codec_tables_are_current():
    """edge/web/src/codec_tables.json is the Python codec's constants (rerun tests/web_vectors.py)."""
    assert json.loads(wv.TABLES.read_text()) == json.loads(wv.dumps(wv.codec_tables()))
    assert json.loads((wv.VECTORS / "entropy_tables.json").read_text()) == wv.entropy_tables()


def test_vector_packets_decode_to_their_frames():
    """Each packet's payload decodes (shared/codec) to the floored frames within the mode's step."""
    from harken.shared.codec import decode_frames
    from harken.shared.integrity import payload_crc32c

    rec = json.loads((wv.VECTORS / "two_segments.json").read_text())
    mel = np.fromfile(wv.VECTORS / "two_segments.logmel.f32", dtype="<f4").reshape(128, -1)
    floored = wv.floored(mel)
    for p in rec["packets"]:
        payload = bytes.fromhex(p["payload"])
        assert payload_crc32c(payload) == p["crc32c"]
        frames = decode_frames(payload)
        a, k = p["first_frame"], p["frame_count"]
        assert frames.shape == (128, k)
        if k:
            assert np.sqrt(np.mean((frames - floored[:, a:a + k]) ** 2)) < 0.2


def _node() -> str:
    node = shutil.which("node")
    assert node is not None, "node (>= 20) is required: the TypeScript edge's tests run on it (make test)"
    return node


def test_typescript_edge_matches_the_vectors():
    """`node --test edge/web/test/`: features, VAD, payloads and messages against the vectors."""
    node = _node()
    env = dict(os.environ, ONNXRUNTIME_NODE_INSTALL="skip")
    if not (WEB / "node_modules" / "onnxruntime-node").exists():
        npm = shutil.which("npm")
        assert npm is not None, "npm is required to install the TypeScript edge's packages (make test)"
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=WEB, env=env, check=True)
    subprocess.run([node, "build.mjs"], cwd=WEB, env=env, check=True)
    suites = sorted(str(p.relative_to(WEB)) for p in (WEB / "test").glob("*.test.mjs"))
    assert len(suites) >= 4
    r = subprocess.run([node, "--test", "--test-reporter=dot", *suites], cwd=WEB, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
