"""Side-by-side benchmark harness (docs/benchmarking.md).

`traces` defines the workloads; `systems` is the registry of the things compared, built from the
tables of engine variants (`engine_systems`) and vLLM variants (`vllm_system`) plus `hf_system` and
the oracle's plumbing (`oracle`), all behind `interface.System`; `worker` runs one system once in
its own process (clean RSS, own thread budget), `run` interleaves repeats and writes `results.json` /
`results.md`, and `cli` is the `bench` command.
"""
