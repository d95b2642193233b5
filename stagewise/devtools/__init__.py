"""Maintainers' tools: checks that a change still compiles and runs on the GPUs, not lessons.

- `compile_gate`, `compile_specs`, `compile_worker`  compile every kernel launch for sm_75 / sm_80 / sm_90
  with no GPU present (registers, spills, shared memory); `scripts/compile_gate.py` runs it
- `device_check`, `device_report`, `e2e_device`      the one-command check on a GPU machine
  (`benchmarks/gpu/run.sh`): environment, test suite, kernel benchmarks, whole-model decode, in JSON and markdown
- `gpu/`                                             the kernel microbenchmarks the check's `kernels` section runs

They sit above `bench/` (the device check runs the engine benchmarks and uses their harness).
"""
