"""Carry folders larger than a GPU call's 64 MiB in pieces, one piece a call, and put them back
together on the GPU machine (docs/design/peers.md).

Here, once:

    python3 benchmarks/peers/pieces.py split .vp1 .vp2 --max-mib 30

writes .vp1.p1/, .vp1.p2/, .vp2.p1/, ... (each piece's bytes and a manifest: the folder, its
files, their sizes and checksums; git-ignored as .vp* is). On the GPU machine, one call per
piece, back to back (the machine keeps /tmp for 30 s after a call), each carrying one piece
folder and the project's working tree:

    python3 benchmarks/peers/pieces.py gather --into /tmp/pieces; true

copies the pieces it finds in the working tree under --into and, once every piece of a folder
is there, writes the folder whole as /tmp/pieces/whole/NAME (each file checked against its
checksum). It exits 0 only when every folder it has heard of is whole, so the experiment's call
starts `python3 benchmarks/peers/pieces.py gather --into /tmp/pieces && cd /tmp/pieces/whole &&
...`. Standard library only (the GPU machine installs nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

MANIFEST = "pieces.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split(folder: Path, max_bytes: int) -> list[Path]:
    """``folder``'s files (not recursive) as pieces of at most ``max_bytes`` of file bytes,
    folders NAME.pK beside it; returns them."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    listing = [{"name": p.name, "size": p.stat().st_size, "sha256": sha256(p)} for p in files]
    total = sum(f["size"] for f in listing)
    count = max(1, -(-total // max_bytes))
    stream = b"".join(p.read_bytes() for p in files)
    pieces = []
    for k in range(count):
        piece = folder.with_name(f"{folder.name}.p{k + 1}")
        shutil.rmtree(piece, ignore_errors=True)
        piece.mkdir()
        (piece / "bytes").write_bytes(stream[k * max_bytes : (k + 1) * max_bytes])
        manifest = {"folder": folder.name, "piece": k + 1, "pieces": count, "files": listing}
        (piece / MANIFEST).write_text(json.dumps(manifest))
        pieces.append(piece)
    return pieces


def gather(root: Path, into: Path) -> dict[str, str]:
    """Copy the pieces under ``root`` into ``into``; write each folder whose pieces are all
    there as ``into``/whole/NAME. Returns each folder heard of: "whole" or what it lacks."""
    for manifest in sorted(root.glob(f".*.p*/{MANIFEST}")):
        meta = json.loads(manifest.read_text())
        keep = into / meta["folder"]
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(manifest.parent / "bytes", keep / f"{meta['piece']}.bytes")
        (keep / MANIFEST).write_text(json.dumps(meta))
    state = {}
    for manifest in sorted(into.glob(f"*/{MANIFEST}")):
        meta = json.loads(manifest.read_text())
        state[meta["folder"]] = _assemble(manifest.parent, meta, into / "whole" / meta["folder"])
    return state


def _assemble(keep: Path, meta: dict[str, Any], out: Path) -> str:
    missing = [k for k in range(1, meta["pieces"] + 1) if not (keep / f"{k}.bytes").exists()]
    if missing:
        return f"pieces {missing} of {meta['pieces']} still to come"
    if (out / ".whole").exists():
        return "whole"
    out.mkdir(parents=True, exist_ok=True)
    stream = b"".join((keep / f"{k}.bytes").read_bytes() for k in range(1, meta["pieces"] + 1))
    offset = 0
    for f in meta["files"]:
        target = out / f["name"]
        target.write_bytes(stream[offset : offset + f["size"]])
        offset += f["size"]
        if sha256(target) != f["sha256"]:
            return f"{f['name']}: checksum mismatch (pieces of two different splits?)"
    (out / ".whole").write_text("")
    return "whole"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="here: folders into pieces NAME.pK beside them")
    s.add_argument("folders", nargs="+", type=Path)
    s.add_argument("--max-mib", type=float, default=30.0, help="a piece's bytes (default: 30)")
    g = sub.add_parser("gather", help="on the GPU machine: keep the pieces carried, join folders")
    g.add_argument("--into", type=Path, default=Path("/tmp/pieces"))
    g.add_argument("--root", type=Path, default=Path.cwd(), help="where the pieces came in")
    args = parser.parse_args(argv)
    if args.command == "split":
        for folder in args.folders:
            pieces = split(folder, int(args.max_mib * (1 << 20)))
            print(f"{folder}: {len(pieces)} pieces: {' '.join(str(p) for p in pieces)}")
        return 0
    state = gather(args.root, args.into)
    for folder, what in state.items():
        print(f"[pieces] {folder}: {what}")
    return 0 if state and all(what == "whole" for what in state.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
