from gpt2port.cli import run

run()
