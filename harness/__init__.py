"""Support code for tests and benchmarks (not shipped, not product code): real service processes
on loopback, synthetic data, the chaos proxy and ledger, the fuzz driver, the inspector's run
fixtures, the headless browser's settings. `tests/` and `bench/` import it; it imports neither.
Pytest-only helpers stay in `tests/support/`.
"""
