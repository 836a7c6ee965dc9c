"""Requests and batching: a workload as a list of requests, packed into batches of
micro-batches (:mod:`.requests`), and a queue of such batches simulated back to back
(:mod:`.queue`)."""
