"""SpecActor's application layer: the `specactor` command line.

It ties the engine library (`specactor_engine`), the pipeline (`tasks`, `flows`) and the benchmark
(`benchmark`) together; none of those import it.
"""
