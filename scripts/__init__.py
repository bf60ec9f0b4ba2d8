"""Scripts beside the package, by role; run each as a file (``python scripts/bench/bench_join.py``).

- top level: ``setup.sh`` (the venv), ``test.sh`` (every CI check), ``gen_protos.py`` (protocol/gen/);
- ``bench/``: benchmarks (``bench_*.py``), the modules only they use, and ``results/``;
- ``tools/``: the WAN emulator, chaos, RPC fuzzing, checkpoint crashes;
- ``workers/``: the all-reduce peer processes that benchmarks and tests start;
- ``examples/``: your own training loop on the Python API.

A script run as a file puts the checkout on ``sys.path`` itself, so ``from scripts.tools.wan_emulator
import ...`` works however it is started; tests import the same modules as ``scripts.<role>.<name>``.
"""
