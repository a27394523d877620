"""Usage errors in one line: click's own (an unknown option, a missing argument, a value out of range) print four
lines (usage, a hint, a blank, the error); gpt2port's promise is one `error: ...` line naming the option, exit 2.
The group class below is the hook every command's parsing passes through. Click only: imported at `--help`."""

from __future__ import annotations

import contextlib
import types

import click


def _show(self, file=None) -> None:
    where = f" ({self.ctx.command_path} --help)" if self.ctx is not None else ""
    text = " ".join(line.strip() for line in self.format_message().splitlines() if line.strip())
    click.echo(f"error: {text}{where}", file=file, err=True)


@contextlib.contextmanager
def _one_line():
    try:
        yield
    except click.UsageError as e:
        e.show = types.MethodType(_show, e)  # click's main() reports an error through its show()
        raise


class OneLineUsageGroup(click.Group):
    """A click group whose usage errors, its own and each command's, are one line (the exit code stays click's 2)."""

    def make_context(self, *args, **kwargs):
        with _one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line():
            return super().invoke(ctx)
