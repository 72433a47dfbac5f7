"""`python -m benchmark ...`: the `bench` command on its own (`specactor bench ...` runs the same command)."""

from benchmark.cli import app

if __name__ == "__main__":
    app()
