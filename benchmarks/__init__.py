"""GPU benchmarks, run from the repository root as ``python -m benchmarks.<name>``; their shared pieces are in
:mod:`benchmarks.harness`."""
