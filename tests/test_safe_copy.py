"""The copy-back unpacker against crafted tar streams: only regular files and directories,
names checked, caps enforced, nothing created outside the new directory, nothing left
behind on a refusal."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tree_snapshot import snapshot

from meshtrain.hosts.safe_copy import CopyLimits, UnsafeRunDirectory, checked_parts, unpack_tar


def tar_bytes(*members: tuple[tarfile.TarInfo, bytes | None], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar archive of the given headers, written without touching any filesystem."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = "",
          mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


@pytest.fixture
def world(tmp_path: Path) -> tuple[Path, Path]:
    """``out`` (where the run lands) beside ``victim``, a tree a hostile stream aims at."""
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.mkdir()
    (victim / "bashrc").write_text("safe\n")
    return out, victim


def test_a_real_run_directory_is_unpacked(world: tuple[Path, Path]) -> None:
    out, _ = world
    data = tar_bytes(entry("./", tarfile.DIRTYPE, mode=0o755), entry("./summary.json", data=b"{}\n"),
                     entry("./ranks", tarfile.DIRTYPE), entry("./ranks/a.log", data=b"x" * 100_000),
                     entry("./run.sh", data=b"#!/bin/sh\n", mode=0o755))
    unpack_tar(io.BytesIO(data), out / "run")
    assert (out / "run/summary.json").read_bytes() == b"{}\n"
    assert (out / "run/ranks/a.log").stat().st_size == 100_000
    assert os.access(out / "run/run.sh", os.X_OK)
    assert sorted(p.name for p in out.iterdir()) == ["run"]  # the temporary folder was renamed


@pytest.mark.parametrize(("members", "message"), [
    # The symlink chain of the tarfile data-filter bypass: link, then a file through it.
    ([entry("a", tarfile.SYMTYPE, link="VICTIM"), entry("a/bashrc", data=b"owned\n")],
     "link 'a' -> 'VICTIM'"),
    ([entry("d", tarfile.DIRTYPE), entry("d/l", tarfile.SYMTYPE, link="../../victim/bashrc"),
      entry("d/l", data=b"owned\n")], "link 'd/l' -> '../../victim/bashrc'"),
    ([entry("h", tarfile.LNKTYPE, link="VICTIM/bashrc"), entry("h", data=b"owned\n")],
     "hardlink 'h' -> 'VICTIM/bashrc'"),
    ([entry("../victim/bashrc", data=b"owned\n")], "name '../victim/bashrc' goes up a directory"),
    ([entry("ok/../../x", data=b"owned\n")], "goes up a directory"),
    ([entry("VICTIM/bashrc", data=b"owned\n")], "absolute name"),
    ([entry("null", tarfile.CHRTYPE)], "device 'null'"),
    ([entry("disk", tarfile.BLKTYPE)], "device 'disk'"),
    ([entry("pipe", tarfile.FIFOTYPE)], "fifo 'pipe'"),
    ([entry("esc\x1b[2J", data=b"")], "name 'esc\\x1b[2J' holds a control character"),
    ([entry("x" * 300, data=b"")], "longer than 255 bytes"),
    ([entry("/".join(["x" * 200] * 6), data=b"")], "longer than 1024 bytes"),
    ([entry("/".join(["d"] * 70) + "/f", data=b"")], "deeper than 64 levels"),
    ([entry("twice", data=b"1"), entry("twice", data=b"2")], "'twice' is sent twice"),
])
def test_hostile_entries_are_refused_and_leave_nothing(
        world: tuple[Path, Path], members: list[tuple[tarfile.TarInfo, bytes | None]], message: str) -> None:
    out, victim = world
    for info, _ in members:  # aim at the real victim folder
        info.name = info.name.replace("VICTIM", str(victim))
        info.linkname = info.linkname.replace("VICTIM", str(victim))
    message = message.replace("VICTIM", str(victim))
    before = snapshot(out.parent, mtimes=False)
    with pytest.raises(UnsafeRunDirectory) as refused:
        unpack_tar(io.BytesIO(tar_bytes(entry("ok.txt", data=b"fine"), *members)), out / "run")
    assert message in str(refused.value)
    assert snapshot(out.parent, mtimes=False) == before  # not even the half-made run directory is left


def test_the_default_caps_fit_real_runs() -> None:
    assert (CopyLimits().max_bytes, CopyLimits().max_files) == (64 << 30, 100_000)


def test_a_nul_in_a_name_is_refused() -> None:
    # tarfile cuts names at NUL on reading, so this is checked for the SFTP path's sake.
    with pytest.raises(UnsafeRunDirectory, match="NUL"):
        checked_parts("a\x00b")


def test_caps_on_bytes_and_entries_name_the_option(world: tuple[Path, Path]) -> None:
    out, _ = world
    small, huge = tarfile.TarInfo("a"), tarfile.TarInfo("model.pt")
    small.size, huge.size = 1, 1 << 40  # a header announcing 1 TiB: refused before a byte is read
    stream = io.BytesIO(small.tobuf(tarfile.PAX_FORMAT) + b"x" + b"\0" * 511 + huge.tobuf(tarfile.PAX_FORMAT))
    with pytest.raises(UnsafeRunDirectory, match=r"more than 1048576 bytes in total \(at 'model.pt'\); "
                                                 "raise the cap with --copy-back-limit"):
        unpack_tar(stream, out / "run", CopyLimits(max_bytes=1 << 20))
    many = tar_bytes(*[entry(f"f{i}", data=b"") for i in range(11)])
    with pytest.raises(UnsafeRunDirectory, match="more than 10 entries.*--copy-back-files"):
        unpack_tar(io.BytesIO(many), out / "run", CopyLimits(max_files=10))
    assert list(out.iterdir()) == []


def test_a_huge_extended_header_is_refused_before_it_is_read(world: tuple[Path, Path]) -> None:
    out, _ = world
    header = tarfile.TarInfo("././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, 1 << 32  # 4 GiB of "metadata" would be read into memory
    with pytest.raises(UnsafeRunDirectory, match="extended tar header"):
        unpack_tar(io.BytesIO(header.tobuf(tarfile.GNU_FORMAT) + b"\0" * 4096), out / "run")
    assert list(out.iterdir()) == []


def test_an_existing_destination_is_never_replaced(world: tuple[Path, Path]) -> None:
    out, _ = world
    (out / "run").mkdir()
    (out / "run" / "keep").write_text("mine")
    with pytest.raises(OSError):
        unpack_tar(io.BytesIO(tar_bytes(entry("x", data=b"1"))), out / "run")
    assert (out / "run" / "keep").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["run"]


class ListingServer:
    """What a hostile SFTP server could answer: a real OpenSSH sftp-server never lists such
    names, so the listing is given here, as paramiko's own SFTPAttributes."""

    def __init__(self, names: list[tuple[str, int]]) -> None:
        self.names = names

    def listdir_attr(self, path: str) -> list[object]:
        import paramiko

        listing = []
        for name, mode in self.names:
            attr = paramiko.SFTPAttributes()
            attr.filename, attr.st_mode, attr.st_size = name, mode, 1
            listing.append(attr)
        return listing

    def open(self, path: str, mode: str) -> io.BytesIO:
        class File(io.BytesIO):
            def readv(self, chunks: list[tuple[int, int]]) -> Iterator[bytes]:  # as paramiko's SFTPFile
                for offset, size in chunks:
                    self.seek(offset)
                    yield self.read(size)
        return File(b"x")

    def readlink(self, path: str) -> str:
        return "/etc"


@pytest.mark.parametrize(("name", "mode", "message"), [
    ("..", stat.S_IFDIR | 0o755, "goes up a directory"),
    ("/etc", stat.S_IFREG | 0o644, "not a plain file name"),
    ("a/../../x", stat.S_IFREG | 0o644, "not a plain file name"),
    ("a\x00b", stat.S_IFREG | 0o644, "not a plain file name"),
    ("a", stat.S_IFLNK | 0o777, "link 'a' -> '/etc'"),
    ("a", stat.S_IFCHR | 0o644, "device 'a'"),
    ("a", stat.S_IFIFO | 0o644, "fifo 'a'"),
    ("a", stat.S_IFSOCK | 0o644, "entry 'a' of mode"),
])
def test_the_sftp_path_refuses_what_the_tar_path_refuses(
        world: tuple[Path, Path], name: str, mode: int, message: str) -> None:
    from meshtrain.hosts.safe_copy import unpack_sftp

    out, _ = world
    with pytest.raises(UnsafeRunDirectory, match=message.replace("(", "\\(")):
        unpack_sftp(ListingServer([("ok", stat.S_IFREG | 0o644), (name, mode)]), "run", out / "run")
    assert list(out.iterdir()) == []
