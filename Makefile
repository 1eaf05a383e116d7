# kvq: fresh-machine entry points. `make demo` and `make test` set everything up.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
KVQ_DATA_DIR ?= $(abspath ../shared/data)
DEMO_OUT ?= artifacts/demo
DEMO_BITS ?= 4
DEMO_WINDOWS ?= 16
DEMO_SEQLEN ?= 512
# test processes: one per core (each runs torch on one thread, tests/conftest.py)
TEST_WORKERS ?= auto
BIN := $(VENV)/bin
export KVQ_DATA_DIR

.PHONY: setup demo test test-quick check bench clean

$(BIN)/.stamp: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev,eval]"
	touch $@

setup: $(BIN)/.stamp

# The schema and the report go beside the artifact, not into it: --overwrite replaces
# only a folder that holds nothing but an artifact, so the demo can run again.
demo: setup
	$(BIN)/kvq calibrate channel-scales --model gemma3-270m \
	    --dataset $(KVQ_DATA_DIR)/calibration/groups_merged.txt \
	    --samples 16 --seqlen 512 --bits $(DEMO_BITS) --out $(DEMO_OUT) --overwrite
	$(BIN)/kvq export manifest $(DEMO_OUT) --schema-out $(DEMO_OUT).schema.json
	$(BIN)/kvq run-eval --model gemma3-270m --artifact $(DEMO_OUT) --dataset wikitext2 \
	    --tasks ppl,kld,bytes --windows $(DEMO_WINDOWS) --seqlen $(DEMO_SEQLEN) \
	    --protocol prefill --json $(DEMO_OUT).eval.json

test: setup
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15

# the subset to run while iterating (under 2 minutes on 2 cores): no real-model or
# interpreter-heavy modules (those are marked slow); `make test` is what CI runs
test-quick: setup
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile -m "not slow"

check: setup
	$(BIN)/ruff check kvq tests bench
	$(BIN)/ruff format --check kvq tests bench

bench: setup
	$(BIN)/pip install -q -e .[bench]
	mkdir -p artifacts/bench
	$(BIN)/python bench/decode_attention.py --json artifacts/bench/decode_attention.json
	$(BIN)/python bench/eval_matrix.py --json artifacts/bench/eval_matrix.json
	$(BIN)/python bench/kvquant_ablation.py --bits 3 --json artifacts/bench/kvquant_ablation.json

clean:
	rm -rf $(VENV) artifacts .pytest_cache
