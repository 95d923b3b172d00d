"""One prefill-decode pair's state: the two-sided data path, communicator pool and budget, staging, arrivals, liveness."""
