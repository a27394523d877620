"""The `gpt2port` program: `python -m gpt2port`, and the console script's entry (run). It holds SIGINT and SIGTERM
(gpt2port.signals) before the command line and the commands load, so that nothing of a Ctrl-C lands in them."""

from gpt2port.signals import program_start


def run() -> None:
    program_start()
    from gpt2port.cli import run as run_cli

    run_cli()


if __name__ == "__main__":
    run()
