# Source this on a lent GPU machine, in the repository root: `. bench/device_setup.sh`.
# That image's Python is a venv (/opt/torch/.venv) holding torch, numpy, scipy, networkx, rich,
# PyYAML, pytest, hypothesis and transformers; tg's other dependencies travel as wheels in .whl/
# (carry it; .git/info/exclude ignores it): pydantic (with pydantic_core, annotated_types,
# typing_inspection, typing_extensions), simpy and sybil. There `pip` is the system's, whose
# `tg` cannot import networkx: install with `python3 -m pip` (bench/results/h200-2026-11-26).
python3 -m pip install -q --no-index --find-links .whl pydantic simpy sybil
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e .
PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH"
export PATH
