"""One-off probes: scripts that answered a question once (a kernel's warps, a GEMM's rate, an A/B of build options,
where a profile's time goes). Runnable by hand as ``python -m benchmarks.probes.<name>`` on a GPU; CI only imports
them and reads their ``--help``. The figures they produced are in ``benchmarks/HISTORY.md``; the benchmarks that
``RESULTS.md`` cites live one folder up and run in CI (``--smoke`` or ``--dry-run``).
"""
