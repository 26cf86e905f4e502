"""benchmarks/peers/pieces.py: folders split here into pieces, carried one a call, put back
together on the GPU machine byte for byte (checked against the folders themselves)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.peers.pieces import gather, split

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "pieces.py"


def test_pieces_carried_one_a_call_make_the_folders_again(tmp_path: Path) -> None:
    here, device = tmp_path / "here", tmp_path / "device"
    folder = here / ".vp1"
    folder.mkdir(parents=True)
    files = {"a.tar.xz": os.urandom(70_000), "a.sha256": b"abc  a.tar.xz\n", "empty": b""}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    pieces = split(folder, 30_000)
    assert [p.name for p in pieces] == [".vp1.p1", ".vp1.p2", ".vp1.p3"]
    assert sum((p / "bytes").stat().st_size for p in pieces) == sum(map(len, files.values()))

    into = tmp_path / "tmp-pieces"
    for k, piece in enumerate(pieces):  # one call each: the working tree holds that piece alone
        call = device / f"call{k}"
        shutil.copytree(piece, call / piece.name)
        cmd = [sys.executable, str(SCRIPT), "gather", "--into", str(into), "--root", str(call)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        last = k == len(pieces) - 1
        assert done.returncode == (0 if last else 1), done.stdout + done.stderr
        assert ("whole" if last else "still to come") in done.stdout
    whole = into / "whole" / ".vp1"
    for name, data in files.items():
        assert (whole / name).read_bytes() == data


def test_a_piece_of_another_split_is_caught(tmp_path: Path) -> None:
    folder = tmp_path / ".vp2"
    folder.mkdir()
    (folder / "x").write_bytes(os.urandom(50_000))
    first = split(folder, 30_000)
    kept = tmp_path / "kept"
    shutil.copytree(first[0], kept / first[0].name)
    (folder / "x").write_bytes(os.urandom(50_000))  # rebuilt: a new split of other bytes
    second = split(folder, 30_000)
    shutil.copytree(second[1], kept / second[1].name)
    state = gather(kept, tmp_path / "into")
    assert "checksum mismatch" in state[".vp2"]
