# The two set-up commands of the README:
#   make trace   install everything, then print the shape flow of a short prompt through the real model
#   make test    install everything, then run the whole test suite
PROMPT ?= The capital of France is

.PHONY: install trace test lint
install:
	./scripts/install.sh

trace: install
	.venv/bin/trace "$(PROMPT)"

test: install
	.venv/bin/python -m pytest -q

lint:
	.venv/bin/ruff check stagewise tests
