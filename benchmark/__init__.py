"""Side-by-side benchmark harness (BENCHMARK.md, issue 4).

`traces` defines the workloads, `systems` the things compared (a registry: `hf`, `ar`,
`coupled`, `oracle`; later `vllm`, `decoupled`, `specactor`), `worker` runs one system once
in its own process (clean RSS, own thread budget), `run` interleaves repeats and writes
`results.json` / `results.md`, and `cli` is the `bench` command.
"""
