"""gpt2port/outfile.py: large outputs appended through O_DIRECT (page-aligned chunks, a padded tail truncated away) or,
where the filesystem refuses it, through the page cache: the same bytes either way, errors surfacing at write or
close, the file always closed."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

import gpt2port.outfile as outfile

PIECES = [b"", b"h" * 7, os.urandom(5000), os.urandom(outfile.BLOCK), os.urandom(3 * outfile.CHUNK // 2 + 13),
          b"tail"]


def write_pieces(path, pieces=PIECES):
    f = outfile.open_append(path)
    for p in pieces:
        f.write(memoryview(p))
    f.close()
    return f


@pytest.fixture
def direct_works(tmp_path):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")


@pytest.mark.parametrize("size", [0, 1, outfile.BLOCK, outfile.CHUNK, outfile.CHUNK + 1])
def test_direct_writes_exactly_the_bytes_given(tmp_path, direct_works, size):
    data = os.urandom(size)
    f = write_pieces(tmp_path / "out", [data[: size // 3], data[size // 3 :]])
    assert isinstance(f, outfile.DirectAppend)
    assert (tmp_path / "out").read_bytes() == data  # the padding of the last block truncated away


def test_pieces_of_any_size_direct_and_buffered_give_the_same_file(tmp_path, monkeypatch):
    write_pieces(tmp_path / "a")
    monkeypatch.setattr(outfile, "DIRECT", False)
    assert isinstance(write_pieces(tmp_path / "b"), outfile.BufferedAppend)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == b"".join(PIECES)


def test_a_filesystem_refusing_o_direct_at_open_gets_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def refuse(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(outfile.os, "open", refuse)
    assert isinstance(write_pieces(tmp_path / "out"), outfile.BufferedAppend)
    assert (tmp_path / "out").read_bytes() == b"".join(PIECES)


@pytest.mark.parametrize("refused", [0, 1])
def test_a_write_refused_as_direct_io_falls_back_to_the_cache(tmp_path, direct_works, monkeypatch, refused):
    """Refused at the first write (a filesystem taking the flag but not the I/O) or at a later one: the flag is
    dropped, the refused chunk and every later one go through the cache, the file is whole."""
    calls = []

    def refuse_direct(fd, data):
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        calls.append(direct)
        if direct and len(calls) == refused + 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.write(fd, data)

    monkeypatch.setattr(outfile, "_write", refuse_direct)
    write_pieces(tmp_path / "out")
    assert calls[: refused + 1] == [True] * (refused + 1) and not any(calls[refused + 1 :])
    assert (tmp_path / "out").read_bytes() == b"".join(PIECES)


def test_a_write_error_surfaces_and_the_file_is_closed(tmp_path, direct_works, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outfile, "_write", full)
    f = outfile.open_append(tmp_path / "out")
    fd = f._fd
    with pytest.raises(OSError, match="No space") as e:
        f.write(os.urandom(3 * outfile.CHUNK))  # the second chunk's submit finds the first's error
        f.close()
    assert e.value.errno == errno.ENOSPC
    f.abort()
    f.abort()  # idempotent: never closes an fd number twice
    with pytest.raises(OSError):
        os.fstat(fd)
    assert not f._thread.is_alive()


def test_an_existing_file_is_never_overwritten(tmp_path, monkeypatch):
    for direct in (True, False):
        monkeypatch.setattr(outfile, "DIRECT", direct)
        (tmp_path / "out").write_bytes(b"keep")
        with pytest.raises(FileExistsError):
            outfile.open_append(tmp_path / "out")
        assert (tmp_path / "out").read_bytes() == b"keep"
