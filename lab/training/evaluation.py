"""synth-en's checkpoint and its measures: the official-layout export, held-out WER (jiwer after the
Whisper English normaliser), the encoder's phoneme error, the loss/WER curve."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from harken.training.train import Trainee


# --- export -------------------------------------------------------------------------------------

def export_state_dict(model: Trainee) -> dict[str, np.ndarray]:
    """The official tensor names (`thinker.*`), fp32, untrained vocabulary rows zero."""
    out = {f"thinker.audio_tower.{k}": v.detach().float().cpu().numpy().copy() for k, v in model.encoder.state_dict().items()}
    for i, layer in enumerate(model.layers):
        for k, v in layer.state_dict().items():
            out[f"thinker.model.layers.{i}.{k}"] = v.detach().float().cpu().numpy().copy()
    out["thinker.model.norm.weight"] = model.norm.weight.detach().float().cpu().numpy().copy()
    emb = np.zeros((model.cfg.text.vocab_size, model.cfg.text.hidden_size), np.float32)
    emb[model.vocab.ids.numpy()] = model.emb.detach().float().cpu().numpy()
    out["thinker.model.embed_tokens.weight"] = emb
    return out


def export_checkpoint(model: Trainee, out: Path) -> Path:
    """Write an official-layout checkpoint directory (config, safetensors, tokenizer files)."""
    from safetensors.numpy import save_file

    from harken.cloud.model.tiny import _write_json, config_json, write_tokenizer_files

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").exists():
        write_tokenizer_files(out, "real")
    _write_json(out / "config.json", config_json(model.cfg))
    _write_json(out / "generation_config.json", {"eos_token_id": [151645, 151643], "pad_token_id": 151643,
                                                 "do_sample": False})
    tmp = out / "model.safetensors.tmp"
    save_file(export_state_dict(model), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    return out


def export_state(state: dict[str, Any], out: Path) -> Path:
    """A saved run state (`state.load()`'s warm start, or OUTDIR/state.pt) as an official-layout
    checkpoint directory, at the depth its decoder has: what `harken eval --model DIR` reads."""
    from harken.training import growth
    from harken.training.examples import Vocab
    from harken.training.train import Trainee, synth_en_config

    cfg = synth_en_config(growth.decoder_layers_of(state["model"]))
    model = Trainee(cfg, Vocab(state["vocab"], cfg.text.vocab_size), len(state["phones"]), 0)
    model.load_state_dict(state["model"], strict=True)
    return export_checkpoint(model, out)


# --- evaluation ---------------------------------------------------------------------------------

@dataclass
class HeldOut:
    """The first n held-out utterances as the trainer measures them."""
    feats: list[np.ndarray]  # fp16 [128, T], like the training features
    refs: list[str]
    voices: list[str]  # `voice_family`
    sources: list[str]  # meeting, fortunes, kjv
    phones: list[list[int]]  # espeak-ng's phonemes in the run's table


def held_out_set(out: Path, n: int, table: dict[str, int]) -> HeldOut:
    """The held-out utterances' features from OUTDIR/heldout-N.npz (any rendered copy of at least n),
    else rendered here and saved there. A copy may hold some of them only (a lent GPU gets the
    Piper-voiced ones, as it has no Piper voice: deploy/device/carry_parts.py): the rest are
    rendered here and the whole set saved."""
    from harken.training import corpus, speech

    held = corpus.read_held_out()[:n]
    rendered = sorted((p for p in out.glob("heldout-*.npz") if p.stem.split("-")[1].isdigit()
                       and int(p.stem.split("-")[1]) >= len(held)), key=lambda p: int(p.stem.split("-")[1]))
    found: dict[int, np.ndarray] = {}
    if rendered:
        with np.load(rendered[0]) as z:
            found = {i: z[f"f{i}"] for i in range(len(held)) if f"f{i}" in z.files}
    feats = [found[i] if i in found else corpus.render_features(u.recipe).astype(np.float16)
             for i, u in enumerate(held)]
    if len(found) < len(held):
        whole: dict[str, Any] = {f"f{i}": f for i, f in enumerate(feats)}
        np.savez(out / f"heldout-{n}.npz", **whole)
    return HeldOut(feats, [u.recipe.text for u in held], [voice_family(u.recipe.voice) for u in held],
                   [u.source for u in held],
                   [[table[c] for c in speech.phonemes(u.recipe.text, u.recipe.voice) if c in table] for u in held])

def wer(refs: list[str], hyps: list[str]) -> float:
    """Word error rate with jiwer after the Whisper English normaliser (Open ASR Leaderboard)."""
    import jiwer
    from whisper_normalizer.english import EnglishTextNormalizer

    norm = EnglishTextNormalizer()
    pairs = [(norm(r), norm(h)) for r, h in zip(refs, hyps)]
    pairs = [(r, h) for r, h in pairs if r.strip()]
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))


def evaluate(ckpt_dir: Path, feats: list[np.ndarray], refs: list[str]) -> tuple[float, list[str]]:
    from harken.cloud.model.asr import Qwen3ASR

    from harken.cloud.model.decode_limits import DecodeLimits

    asr = Qwen3ASR.load(str(ckpt_dir), dtype="fp32", device="cpu")
    hyps = [asr.transcribe(f.astype(np.float32), limits=DecodeLimits()).text for f in feats]
    return wer(refs, hyps), hyps


def audio_gain(model: Trainee, feats: list[np.ndarray], targets: list[list[int]],
               prompt_ids: tuple[list[int], list[int]], n_prefix: int) -> float:
    """Held-out transcript cross-entropy with another utterance's audio minus with its own (nats
    per token): ~0 while the decoder ignores the audio, large once it reads it."""
    import torch

    from harken.training.train import Batch, losses

    keep = [i for i, t in enumerate(targets) if (model.vocab.index[torch.tensor(t)] >= 0).all()]
    if len(keep) < 2:
        return float("nan")
    dev = model.emb.device
    batch = Batch([torch.from_numpy(feats[i].astype(np.float32)).to(dev) for i in keep],
                  [targets[i] for i in keep], [[] for _ in keep], n_prefix)
    own = losses(model, batch, prompt_ids, aux=False)["ce"].item()
    other = losses(model, batch, prompt_ids, aux=False, roll_audio=True)["ce"].item()
    return other - own


def phoneme_hyps(model: Trainee, feats: list[np.ndarray]) -> list[list[int]]:
    """The encoder's phoneme head decoded greedily: the best symbol of each CTC slot, repeats merged,
    blanks dropped. What the encoder hears, apart from the decoder."""
    import torch

    dev = model.emb.device
    hyps = []
    for f in feats:
        with torch.no_grad():
            a = model.encoder.encode_items([torch.from_numpy(f.astype(np.float32)).to(dev)])[0]
            best = model.phone_head(a).view(2 * a.shape[0], -1).argmax(-1).tolist()  # row t -> slots 2t, 2t+1
        hyps.append([p for i, p in enumerate(best) if p != 0 and (i == 0 or best[i - 1] != p)])
    return hyps


def phoneme_rate(refs: list[list[int]], hyps: list[list[int]]) -> float:
    """Edit distance over the reference length, summed over the utterances (jiwer over phoneme ids)."""
    import jiwer

    pairs = [(" ".join(map(str, r)), " ".join(map(str, h))) for r, h in zip(refs, hyps) if r]
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs])) if pairs else float("nan")


def phoneme_error(model: Trainee, feats: list[np.ndarray], refs: list[list[int]]) -> float:
    """The encoder's phoneme error rate against espeak-ng's phonemes (`phoneme_hyps`, `phoneme_rate`)."""
    return phoneme_rate(refs, phoneme_hyps(model, feats))


def voice_family(voice: str) -> str:
    """'piper' for the Piper voice(s), 'espeak' for espeak-ng's: the two kinds of synthetic speech."""
    return "piper" if voice.startswith("piper") else "espeak"


def rates_by(groups: list[str], refs: list[Any], hyps: list[Any],
             rate: Callable[[list[Any], list[Any]], float]) -> dict[str, float]:
    """`rate` (`wer`, `phoneme_rate`) over each group's utterances alone (groups: `voice_family`,
    text source), so a group's figure is its own errors over its own reference length."""
    out = {}
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        out[g] = rate([refs[i] for i in idx], [hyps[i] for i in idx])
    return out


def held_out_split(families: list[str], sources: list[str], refs: list[str], hyps: list[str],
                   phones: list[list[int]], phone_hyps: list[list[int]]) -> dict[str, float]:
    """The evaluation record's split: heldout_wer_{piper,espeak}, heldout_per_{piper,espeak} by voice
    family and heldout_wer_{meeting,fortunes,kjv} by text source."""
    out = {f"heldout_wer_{k}": v for k, v in rates_by(families, refs, hyps, wer).items()}
    out |= {f"heldout_per_{k}": v for k, v in rates_by(families, phones, phone_hyps, phoneme_rate).items()}
    out |= {f"heldout_wer_{k}": v for k, v in rates_by(sources, refs, hyps, wer).items()}
    return out


def plot_curve(log_path: Path, png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    recs = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    if not recs:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in recs]
    ax.plot(steps, [r["ce"] for r in recs], label="transcript CE")
    ax.plot(steps, [r["ctc_tok"] for r in recs], label="token CTC (aux)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax2 = ax.twinx()
    ax2.plot(steps, [100 * r["heldout_wer"] for r in recs], "k--", label="held-out WER %")
    per = [(r["step"], 100 * r["heldout_per"]) for r in recs if "heldout_per" in r]
    if per:
        ax2.plot(*zip(*per), "k:", label="held-out phoneme error %")
    ax2.set_ylabel("error %")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
