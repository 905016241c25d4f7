"""What marks a Qwen3-ForcedAligner checkpoint and its prompt: the model type in its config.json and
the timestamp token the aligner's head answers at (one per word boundary, in 80 ms classes).
Both the aligner (aligner.py) and the tiny random aligner (tiny_aligner.py) build on them."""

TIMESTAMP = "<timestamp>"
TIMESTAMP_TOKEN_ID = 151705
TIMESTAMP_SEGMENT_MS = 80.0
ALIGNER_MODEL_TYPE = "qwen3_forced_aligner"
