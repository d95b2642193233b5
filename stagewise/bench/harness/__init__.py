"""What the benchmark commands share: timing rules, the machine record, progress, plots, workloads, baselines."""
