# Every target sets up .venv by itself: torch (CPU wheel, pinned) first, then harken with its extras,
# installed editable as a plain .pth entry for the project root (compat mode; harken/edge, harken/cloud,
# harken/shared and harken/proto are symlinks), which editors and type checkers follow.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: demo test typecheck test-gpu bench proto sysdeps venv clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[edge,cloud,dev,train,scale]' --config-settings editable_mode=compat
	touch $(STAMP)

venv: $(STAMP)

# espeak-ng speaks the generated test audio and the synth-en corpus; fortunes and the KJV Bible are
# the corpus text; Debian's chromium runs the browser page's test.
sysdeps:
	@command -v espeak-ng >/dev/null && command -v chromium >/dev/null && command -v bible >/dev/null && \
	  test -f /usr/share/games/fortunes/fortunes || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng chromium fortunes fortunes-min \
	  bible-kjv >/dev/null; }

demo: $(STAMP)
	$(VENV)/bin/harken demo

# mypy first ([tool.mypy] in pyproject.toml: the whole tree), then the test suite.
test: $(STAMP) sysdeps
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
	$(VENV)/bin/harken bench overload --json
	$(VENV)/bin/harken bench soak --minutes 5 --json
	$(VENV)/bin/harken bench fuzz --examples 100000 --json

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache

# Regenerate the committed gRPC stubs (proto/harken_pb2*.py) from proto/harken.proto.
proto: $(STAMP)
	$(PY) -m harken.proto.generate
