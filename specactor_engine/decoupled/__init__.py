"""Decoupled speculation: drafter workers run ahead in their own processes; the verifier never waits.

protocol.py     messages and the chain hash that validates streamed drafts
drafter_worker  the drafter role (run-ahead drafting, realignment on commits)
transport.py    how the verifier reaches a worker (local process; delay injection for tests)
ray_transport   the same interface with workers as Ray actors (drafters on other machines)
sync.py         the verifier's copy of the workers' model: pipeline drafter sync, pushed to workers
buffers.py      the verifier's per-row draft buffers (numpy, batched)
coordinator.py  workers, row pinning, restarts; what the engine calls each round
launch.py       starting the workers from the decoupled config: DrafterWorkers, what the engine holds
"""
