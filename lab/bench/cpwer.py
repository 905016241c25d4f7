"""Speaker-attributed WER for `harken bench diarize --cpwer N`: who said what, scored by meeteval's cpWER.

    errors = meeting_cpwer(model, meeting, segments, labels)     # one meeting's CPErrorRate

Each meeting is streamed through an in-process engine with the recogniser (`--model`, synth-en by
default) exactly as `harken stream` runs a file (cloud/embedded.py: the edge pipeline in 100-ms pieces);
the edge's segments there are the bench's (one `FeatureStream`, the same VAD and pieces), so each final's
text takes its segment's label after every relabel. The reference: each speaker's turns' texts in
order; the hypothesis: each label's finals in order. meeteval's cpWER finds the best mapping of labels to
speakers and counts word errors across it (a segment under the wrong label is its words deleted from one
speaker and inserted at another), so it is the WER where the labels are perfect and grows with label
errors. Both sides lowercased and stripped of punctuation, as `harken bench wer` compares words.
"""

from __future__ import annotations

from harken.bench.word_latency import normalize_word


def words(text: str) -> str:
    return " ".join(w for w in (normalize_word(x) for x in text.split()) if w)


def meeting_texts(engine, audio) -> dict[int, str]:
    """The committed text of each final segment of `audio` streamed through `engine`: {segment_id: text}."""
    from harken.cloud.embedded import stream_audio
    from harken.cloud.inference.decoder_stream import SessionOptions

    from harken.shared.text import events_text

    by_segment: dict[int, list] = {}
    for event in stream_audio(audio, engine, SessionOptions(language="en")):
        by_segment.setdefault(event.segment_id, []).append(event)
    return {sid: events_text(events) for sid, events in by_segment.items()}


def cpwer(reference: dict[str, list[str]], hypothesis: dict[str, list[str]]):
    """meeteval's cpWER of {speaker: [texts in order]} against {label: [texts in order]}."""
    from meeteval.wer import cp_word_error_rate

    ref = {k: words(" ".join(v)) for k, v in reference.items()}
    hyp = {k: words(" ".join(v)) for k, v in hypothesis.items()} or {"S1": ""}
    return cp_word_error_rate(ref, hyp)


def truth_labels(meeting, spans: dict[int, tuple[float, float]]) -> dict[int, str]:
    """Each segment's true speaker ({segment_id: (start_s, end_s)}): the turn it overlaps most."""
    def who(start: float, end: float) -> str:
        return max(meeting.turns, key=lambda t: min(t.end_s, end) - max(t.start_s, start)).speaker

    return {sid: who(*span) for sid, span in spans.items()}


def meeting_cpwer(meeting, texts: dict[int, str], labels: dict[int, str]):
    """One meeting's CPErrorRate: its turns against the finals' `texts` ({segment_id: text}) under
    `labels` ({segment_id: speaker}; a final whose segment has no label goes under the last label)."""
    reference: dict[str, list[str]] = {}
    for t in meeting.turns:
        reference.setdefault(t.speaker, []).append(t.text)
    hypothesis: dict[str, list[str]] = {}
    last = next(iter(labels.values()), "S1")
    for sid, text in sorted(texts.items()):
        last = labels.get(sid, last)
        hypothesis.setdefault(last, []).append(text)
    return cpwer(reference, hypothesis)


def bench_cpwer(model: str, scored: list, labelled: list[dict[int, str]]) -> dict:
    """cpWER pooled over `scored` meetings (bench Scored: meeting and segments) with their final labels,
    and with each segment's true speaker (the recogniser's own share of the errors)."""
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.model.asr import Qwen3ASR

    engine = Engine(Qwen3ASR.load(model), EngineConfig(max_sessions=1, max_batch=1))
    errors = truth_errors = length = 0
    rows = []
    for s, labels in zip(scored, labelled):
        texts = meeting_texts(engine, s.meeting.audio)
        spans = {x.segment_id: (x.start_s, x.end_s) for x in s.segments}
        r = meeting_cpwer(s.meeting, texts, labels)
        t = meeting_cpwer(s.meeting, texts, truth_labels(s.meeting, spans))
        errors, truth_errors, length = errors + r.errors, truth_errors + t.errors, length + r.length
        rows.append({"meeting": s.meeting.name, "cpwer": round(r.error_rate, 4),
                     "cpwer_true_labels": round(t.error_rate, 4)})
    return {"model": model, "meetings": len(rows), "words": length, "cpwer": round(errors / max(length, 1), 4),
            "cpwer_true_labels": round(truth_errors / max(length, 1), 4), "per_meeting": rows}
