"""gpt2port/outfile.py: large outputs appended through O_DIRECT (page-aligned chunks, a padded tail truncated away) or,
where the filesystem refuses it, through the page cache: the same bytes either way, errors surfacing at write or
close, the file always closed."""

from __future__ import annotations

import errno
import fcntl
import os
import threading

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
    monkeypatch.setenv("GPT2PORT_DIRECT_IO", "0")
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
    calls, lock = [], threading.Lock()

    def refuse_direct(fd, data, offset):
        with lock:
            direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
            calls.append(direct)
            refuse = direct and len(calls) == refused + 1
        if refuse:
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.pwrite(fd, data, offset)

    monkeypatch.setattr(outfile, "_write", refuse_direct)
    write_pieces(tmp_path / "out")
    # Up to the refusal every write was direct; once a write went through the cache, every later one did (a write of
    # the other writer thread may have started direct while the flag was being dropped).
    assert calls[: refused + 1] == [True] * (refused + 1) and False in calls
    assert not any(calls[calls.index(False) :])
    assert (tmp_path / "out").read_bytes() == b"".join(PIECES)


def test_a_write_error_surfaces_and_the_file_is_closed(tmp_path, direct_works, monkeypatch):
    def full(fd, data, offset):
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
    assert not any(t.is_alive() for t in f._threads)


def test_an_existing_file_is_never_overwritten(tmp_path, monkeypatch):
    for direct in (True, False):
        monkeypatch.setenv("GPT2PORT_DIRECT_IO", "1" if direct else "0")
        (tmp_path / "out").write_bytes(b"keep")
        with pytest.raises(FileExistsError):
            outfile.open_append(tmp_path / "out")
        assert (tmp_path / "out").read_bytes() == b"keep"


@pytest.mark.parametrize("direct", [True, False])
def test_tensors_poured_into_lent_chunks_come_out_whole(tmp_path, monkeypatch, direct):
    """The conversion's writer copies each tensor straight into the appender's chunks (O_DIRECT) or through the
    prefetcher's ring (page cache). Chunks of 3 pages here, so that rows of every size below are cut by a chunk's
    end: transposed views, casts and 1-D tensors all come out as safetensors wrote them."""
    import torch
    from safetensors.torch import load_file

    from gpt2port.formats.safetensors import stream_safetensors

    monkeypatch.setattr(outfile, "CHUNK", 3 * outfile.BLOCK)
    monkeypatch.setenv("GPT2PORT_DIRECT_IO", "1" if direct else "0")
    g = torch.Generator().manual_seed(0)
    want = {
        "a.weight": torch.randn(37, 101, generator=g).t(),  # a transposed view, 37-float rows
        "b.bias": torch.randn(1001, generator=g),
        "c.weight": torch.randn(300, 17, generator=g),
        "d.weight": torch.randn(64, 2000, generator=g).t(),  # rows of 256 bytes in chunks of 12288
        "e.weight": torch.randn(3, 4099, generator=g),  # rows longer than a chunk's end leaves room for
    }
    for dtype in (torch.float32, torch.bfloat16):
        path = tmp_path / f"{dtype}.safetensors"
        items = [(k, dtype, tuple(v.shape), lambda v=v: v) for k, v in want.items()]
        stream_safetensors(path, items, {"format": "pt"})
        got = load_file(path)
        assert list(got) == list(want)
        for k, v in want.items():
            assert torch.equal(got[k], v.to(dtype)), k
