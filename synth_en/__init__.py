"""synth-en's weights (synth-en.safetensors.zst, fp16 in zstd) and config (synth-en.json): the
harken-synth-en distribution, a wheel of its own. `harken.cloud.model.shipped` reads them."""
