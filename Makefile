# The two commands of the README are `make demo` and `make test`; both set everything up first.
.PHONY: setup demo test lint typecheck contracts pytest bench manifests

VENV := .venv/bin

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/canopy demo --self-organize

test: setup lint typecheck contracts pytest

lint:
	$(VENV)/ruff check .
	$(VENV)/ruff format --check .

typecheck:
	$(VENV)/mypy

contracts:
	$(VENV)/lint-imports

pytest:
	$(VENV)/pytest

bench: setup
	$(VENV)/canopy bench dataplane

# The chart's CRDs (copied from manifests/crds/) and manifests/install/ (the chart rendered with
# its default values); tests/deploy/test_sync.py fails when they drift.
manifests: setup
	$(VENV)/python scripts/sync_manifests.py
