"""Benchmarks for maxnnx: training throughput, decode and kernels, plus the peers we compare to."""
