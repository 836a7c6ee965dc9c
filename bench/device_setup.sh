# Source this on a lent GPU machine, in the repository root: `. bench/device_setup.sh`.
# That image's Python is a venv (/opt/torch/.venv) holding torch, numpy, scipy, networkx, rich,
# PyYAML, pytest, hypothesis and transformers; tg's other dependencies travel as wheels in .whl/
# (carry it; .git/info/exclude ignores it): pydantic (with pydantic_core, annotated_types,
# typing_inspection, typing_extensions), simpy, sybil and gguf (with tqdm and requests), and a
# transformers 5 with its own dependencies, installed where the image's is older (4.x lacks
# gpt-oss and DeepSeek-V3, which tests/test_families.py compares against). There `pip` is the
# system's, whose `tg` cannot import networkx: install with `python3 -m pip`
# (bench/results/h200-2026-11-26). Fill .whl/ with `pip download --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 -d .whl pydantic simpy sybil gguf
# transformers` (and drop numpy's wheels: the image's numpy serves).
python3 -m pip install -q --no-index --find-links .whl pydantic simpy sybil gguf
python3 -c 'import sys, transformers; sys.exit(int(transformers.__version__.split(".")[0]) < 5)' \
    || python3 -m pip install -q --no-index --find-links .whl -U transformers
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e .
PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH"
export PATH
