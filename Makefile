# The README's two commands: `make demo` and `make test` each set up everything
# they need on a fresh machine (a .venv with torch's CPU build first, then kvmux
# with vLLM for the CPU and its dev tools) and are cheap to repeat: set-up reruns
# only when pyproject.toml changes.

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvmux-installed
# torch first and pinned to the CPU build on disk: anything else pulls a
# multi-GB CUDA build (shared/NOTES.md). The pin lives here only (kvmux's own
# metadata does not cap torch: a GPU user's vLLM pins its own), as a constraint
# on every install, so no dependency installed later can move torch.
TORCH  := torch==2.13.0
PIN    := $(VENV)/torch-pin.txt
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup demo test lint bench bench-serve clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -U pip
	echo '$(TORCH)' > $(PIN)
	$(PIP) install -c $(PIN) $(TORCH)
	$(PIP) install -c $(PIN) -e '.[dev,vllm,bench,model]'
	# PyPI's torchvision & co. are CUDA builds that break transformers' imports on
	# a CPU torch; vLLM does not need them on the CPU, nor triton (shared/NOTES.md).
	$(PIP) uninstall -y torchvision torchaudio torchcodec triton
	# kvmux[nixl] by hand: nixl's meta package has no cp311 wheel today, and its
	# parts declare an unpinned torch (shared/NOTES.md). cu13 too, or NIXL fails
	# to import once anything installs cuda.bindings.
	$(PIP) install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 nixl-cu13==1.5.1
	# kvmux[mooncake]: the non-CUDA Transfer Engine needs one system library.
	dpkg -s libibverbs1 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libibverbs1; } \
		|| echo "warning: could not install libibverbs1; the mooncake backends will be unavailable"
	$(PIP) install -c $(PIN) -e '.[mooncake]'
	# The separate-hosts tests (network namespaces, tc) need iproute2; as root only.
	dpkg -s iproute2 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq iproute2; } \
		|| echo "warning: could not install iproute2; the separate-hosts tests will be skipped"
	# kvmux[lmcache] last: it pins numpy and friends lower, which the rest accepts
	# (shared/NOTES.md); its cuda.bindings is why nixl-cu13 is installed above.
	$(PIP) install -c $(PIN) -e '.[lmcache]'
	touch $@

demo: $(STAMP)
	$(BIN)/kvmux demo

# LMCache over Mooncake Store runs in a pytest process of its own: in the one
# long process of the whole suite, LMCache's Mooncake client crashed it twice
# (SIGSEGV, at a random test of that class; 0 of 5 runs alone). See CHANGELOG.
ISOLATED := tests/test_lmcache.py::TestLmcacheMooncakeStoreConformance

test: $(STAMP)
	$(BIN)/pytest --deselect $(ISOLATED)
	$(BIN)/pytest $(ISOLATED)

lint: $(STAMP)
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/kvmux bench

# Colocated vs 1P1D vLLM serving under load (~20 min on 2 cores); results in bench-serve/.
bench-serve: $(STAMP)
	$(BIN)/kvmux bench serve --out bench-serve

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
