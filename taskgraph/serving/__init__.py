"""Requests and batching: a workload as a list of requests, packed into
batches of micro-batches (:mod:`.requests`, with the scenarios), and a queue of such batches
simulated back to back (:mod:`.queue`, above the simulator it calls)."""
