"""The one exception type gpt2port raises for bad input: its message is the one line the CLI prints."""


class GPT2PortError(Exception):
    """A user-facing failure. The message names the file, key or repo at fault and the cause."""
