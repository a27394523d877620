from gpt2port.cli import main

main()
