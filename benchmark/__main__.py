"""`python -m benchmark ...`: the `bench` command before it is wired into `specactor`."""

from benchmark.cli import app

if __name__ == "__main__":
    app()
