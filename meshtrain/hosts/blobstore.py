"""The host side of shipping: a content-addressed blob store in a workdir, and the trees
the ranks read, built from hardlinks to its blobs.

This file runs on every host under the inventory's interpreter, sent as source over the
SSH connection (``python -c SOURCE query``), so it imports only the standard library: it
works whatever meshtrain version the host has. A request comes as JSON on stdin, the
answer goes as JSON to stdout. Paths are relative to the workdir::

    .meshtrain/blobs/<sha256>            one file's bytes, read-only
    .meshtrain/blobs/verified.json       sha256 -> [size, mtime_ns, inode] when last hashed
    .meshtrain/incoming/<token>/<sha256> uploads of this ship, not yet checked
    .meshtrain/data/<tree>/<name>/...    what a rank reads: hardlinks to blobs

``query`` says which blobs are missing (one round trip for any number of files) and how
much space is free; ``finish`` checks every upload's hash before renaming it into the
store, so an interrupted or corrupted upload never becomes a blob, then builds the trees.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from typing import Any

STORE = ".meshtrain"
BLOBS = f"{STORE}/blobs"
INCOMING = f"{STORE}/incoming"
TREES = f"{STORE}/data"
STAMPS = f"{BLOBS}/verified.json"
STALE_UPLOAD_S = 3600  # an incoming folder this old belongs to a ship that was interrupted
CHUNK = 1 << 20


def sha256_file(path: str) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _load_stamps() -> dict[str, list[int]]:
    try:
        with open(STAMPS) as f:
            stamps = json.load(f)
        return stamps if isinstance(stamps, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_stamps(stamps: dict[str, list[int]]) -> None:
    # Atomic: a second ship into the same workdir at worst loses a stamp (a re-hash later).
    tmp = f"{STAMPS}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(stamps, f)
    os.replace(tmp, STAMPS)


def _blob_ok(digest: str, size: int, stamps: dict[str, list[int]]) -> bool:
    """Whether blobs/<digest> holds those bytes. Hashed again unless its size, mtime and
    inode are those it had when it was last hashed (a blob changed in place is caught)."""
    path = f"{BLOBS}/{digest}"
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_size == size and stamps.get(digest) == _stamp(st):
        return True
    if st.st_size == size and sha256_file(path) == digest:
        stamps[digest] = _stamp(st)
        return True
    os.unlink(path)  # wrong bytes: never hand them to a rank; the launcher sends it again
    stamps.pop(digest, None)
    return False


def _forget_stale_uploads() -> None:
    """Remove what interrupted ships left: their uploads and half-built trees."""
    now = time.time()
    leftovers = [f"{INCOMING}/{n}" for n in os.listdir(INCOMING)]
    leftovers += [f"{TREES}/{n}" for n in os.listdir(TREES) if n.startswith((".build-", ".old-"))]
    for path in leftovers:
        try:
            if now - os.stat(path).st_mtime > STALE_UPLOAD_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def query(request: dict[str, Any]) -> dict[str, Any]:
    """Which of ``request["blobs"]`` ({sha256: size}) are missing or wrong, the free bytes,
    and whether every tree of ``request["trees"]`` is built from the right blobs already
    (then, with nothing missing, no second round trip is needed)."""
    for folder in (BLOBS, INCOMING, TREES):
        os.makedirs(folder, exist_ok=True)
    _forget_stale_uploads()
    stamps = _load_stamps()
    missing = [d for d, size in sorted(request["blobs"].items()) if not _blob_ok(d, size, stamps)]
    _save_stamps(stamps)
    trees_ok = not missing and all(_tree_ok(f"{TREES}/{tree}", files)
                                   for tree, files in request["trees"].items())
    return {"missing": missing, "free": shutil.disk_usage(STORE).free, "trees_ok": trees_ok}


def _tree_ok(root: str, files: list[list[str]]) -> bool:
    """Every file of the tree is the very inode of its blob (a re-sent blob is a new one)."""
    for rel, digest in files:
        try:
            a, b = os.stat(f"{root}/{rel}"), os.stat(f"{BLOBS}/{digest}")
        except OSError:
            return False
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            return False
    return True


def _build_tree(tree: str, files: list[list[str]]) -> None:
    final = f"{TREES}/{tree}"
    if _tree_ok(final, files):
        return
    building = f"{TREES}/.build-{tree}-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    for rel, digest in files:
        target = f"{building}/{rel}"
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(f"{BLOBS}/{digest}", target)
        except OSError:  # a filesystem without hardlinks: a copy reads the same
            shutil.copyfile(f"{BLOBS}/{digest}", target)
    old = f"{TREES}/.old-{tree}-{os.getpid()}"
    if os.path.lexists(final):
        os.rename(final, old)
    try:
        os.rename(building, final)
    except OSError:  # another ship into this workdir built it meanwhile
        shutil.rmtree(building, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def finish(request: dict[str, Any]) -> dict[str, Any]:
    """Move each upload whose bytes hash to its name into the store (``bad``: those that
    did not), then build every tree of ``request["trees"]`` ({tree: [[path, sha256]]})."""
    incoming = f"{INCOMING}/{request['token']}"
    stamps = _load_stamps()
    bad = []
    for digest in sorted(os.listdir(incoming)) if os.path.isdir(incoming) else []:
        path = f"{incoming}/{digest}"
        if sha256_file(path) != digest:
            bad.append(digest)
            continue
        os.chmod(path, 0o444)  # a rank that writes into its data must not change a blob
        os.replace(path, f"{BLOBS}/{digest}")
        stamps[digest] = _stamp(os.stat(f"{BLOBS}/{digest}"))
    shutil.rmtree(incoming, ignore_errors=True)
    _save_stamps(stamps)
    absent = sorted({d for files in request["trees"].values() for _, d in files
                     if not os.path.isfile(f"{BLOBS}/{d}")} - set(bad))
    if not bad and not absent:
        for tree, files in request["trees"].items():
            _build_tree(tree, files)
    return {"bad": bad, "absent": absent}


def main(argv: list[str]) -> int:
    """``query`` or ``finish``: the request on stdin, the answer on stdout."""
    request = json.load(sys.stdin)
    workdir = os.path.expanduser(request["workdir"])
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    answer = {"query": query, "finish": finish}[argv[0]](request)
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
