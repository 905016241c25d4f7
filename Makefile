# Every target sets up .venv by itself: torch (CPU wheel, pinned) first, then harken with its extras,
# installed editable as a plain .pth entry for the project root (compat mode; harken/edge, harken/cloud,
# harken/shared and harken/proto are symlinks), which editors and type checkers follow.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: demo test typecheck test-gpu bench proto sysdeps venv clean web

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[edge,cloud,dev,train,scale]' --config-settings editable_mode=compat
	touch $(STAMP)

venv: $(STAMP)

# espeak-ng speaks the generated test audio and the synth-en corpus; fortunes and the KJV Bible are
# the corpus text; Debian's chromium runs the browser page's test; node and npm build and test the
# TypeScript edge (edge/web/).
sysdeps:
	@command -v espeak-ng >/dev/null && command -v chromium >/dev/null && command -v bible >/dev/null && \
	  command -v node >/dev/null && command -v npm >/dev/null && \
	  test -f /usr/share/games/fortunes/fortunes || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng chromium fortunes fortunes-min \
	  bible-kjv $$(command -v node >/dev/null || echo nodejs) $$(command -v npm >/dev/null || echo npm) >/dev/null; }

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

# mypy and the TypeScript check first ([tool.mypy] in pyproject.toml: the whole tree), then the test
# suite (which runs the node tests too).
test: $(STAMP) sysdeps
	$(MAKE) web
	$(PY) -m mypy
	$(PY) -m pytest -q

typecheck: $(STAMP)
	$(PY) -m mypy

test-gpu: $(STAMP) sysdeps
	$(PY) -m pytest -q -m gpu || test $$? -eq 5

# Slow tests (exit 5 = none selected is fine), then every benchmark; each prints one JSON object.
bench: $(STAMP) sysdeps
	$(PY) -m pytest -q -m slow || test $$? -eq 5
	$(VENV)/bin/harken bench edge --json --repeats 5
	$(VENV)/bin/harken bench model --json --threads 1
	$(VENV)/bin/harken bench stream --model tiny --seconds 60 --streams 8 --json
	$(VENV)/bin/harken bench load --self-serve --model tiny --streams 4 --seconds 20 --json
	$(MAKE) web
	$(VENV)/bin/harken bench web --json

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache $(WEB)/node_modules $(WEB)/dist

# Regenerate the committed gRPC stubs (proto/harken_pb2*.py) from proto/harken.proto.
proto: $(STAMP)
	$(PY) -m harken.proto.generate
