# The README's two commands:  `make main` (set up, run the main job)  and  `make test` (set up, run all tests).
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup main export test test-export test-lint test-readme test-site test-nbs test-py readme site nbs clean

setup: $(VENV)/.installed

# PyTorch first, pinned: an unpinned torch pulled in by a dependency would fetch a multi-GB CUDA build.
# The main job needs the runtime and matplotlib only; the tests add the dev and docs extras on top.
$(VENV)/.installed-main: setup.py settings.ini
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[plot]"
	touch $@

$(VENV)/.installed: $(VENV)/.installed-main
	$(BIN)/python -m pip install -q -e ".[dev,docs]"
	touch $@

# The main job: held-out accuracy of the shipped tiny base, a LoRA fine-tune on the column-type task (every epoch
# saved, best/ = lowest validation loss), the accuracy of best/, and the run's loss curves. It owns
# /tmp/torchtune_lit/tiny_lora: overwrite=true replaces the previous main job's run there.
main: $(VENV)/.installed-main
	$(BIN)/tunelit run eval_accuracy --config tiny/eval output_dir=/tmp/torchtune_lit/tiny_eval_before
	$(BIN)/tunelit run lora_finetune_single_device --config tiny/lora overwrite=true
	$(BIN)/tunelit run eval_accuracy --config tiny/eval checkpointer.checkpoint_dir=/tmp/torchtune_lit/tiny_lora/best \
		output_dir=/tmp/torchtune_lit/tiny_lora/eval_best
	$(BIN)/tunelit plot /tmp/torchtune_lit/tiny_lora

# Write torchtune_lit/ from the notebooks. nbdev rewrites one-line imports of the package as relative ones, which
# moves them in isort's order; ruff puts them back in order, so the generated package passes `ruff check`.
export: setup
	$(BIN)/nbdev_export
	$(BIN)/ruff check --select I --fix --quiet torchtune_lit

# (a) export sync, lint (ruff, and the import rules in tests/test_imports.py run with pytest), README sync,
# (d) site build, (b) every notebook, (c) pytest -- pytest's summary line last.
test: setup test-export test-lint test-readme test-site test-nbs test-py

test-export:
	$(BIN)/python tests/check_export_sync.py

test-lint:
	$(BIN)/ruff check torchtune_lit tests

test-readme:
	$(BIN)/python docs/make_readme.py --check

test-site:
	$(BIN)/python docs/build_site.py

test-nbs:
	cd nbs && OMP_NUM_THREADS=1 TUNELIT_BOOK_QUICK=1 ../$(BIN)/nbdev_test --n_workers 2 --timing

# Two workers. --dist loadgroup hands tests out one by one, except that the tests sharing a module fixture (a
# trained start) go to one worker, which builds it once (tests/conftest.py). One thread per worker: two cores.
test-py:
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/ -q --durations=20 -n 2 --dist loadgroup

readme: setup
	$(BIN)/python docs/make_readme.py

site: setup
	$(BIN)/python docs/build_site.py

# Re-run every chapter and save its outputs (plots), then strip noise for clean diffs.
nbs: export
	$(BIN)/python docs/execute_notebooks.py
	$(BIN)/nbdev_clean

clean:
	rm -rf _proc docs/_build
