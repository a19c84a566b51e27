"""`python -m specui.bench`: every method and peer, per workload, with figures (specui.bench.suite)."""

from specui.bench.suite import main

if __name__ == "__main__":
    raise SystemExit(main())
