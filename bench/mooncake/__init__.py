"""Microbenchmark of the `mooncake` transport: page-run batch writes between two processes (`python -m bench.mooncake`)."""
