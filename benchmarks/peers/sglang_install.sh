#!/usr/bin/env bash
# Installs the SGLang 0.5.14 bundle (.sg1/ ... .sgN/ at the repository root, from
# benchmarks/peers/sglang_build.sh) into /tmp/sgsite on the GPU machine.  Run from the repository
# root in every call that carries a part, calls back to back (the machine keeps /tmp only while it is
# warm, 30 s after a call):
#     bash benchmarks/peers/sglang_install.sh
# Each part holds one chunk of one byte stream ([rest.tar.xz][flash_ops.abi3.so.xz]) and the
# manifest.  A part whose checksum matches is copied to /tmp/sgsite/.chunks and leaves a marker
# /tmp/sgsite/.partN.ok (idempotent: a part already in is skipped).  Once all N are in, the stream is
# joined, checked against the manifest, unpacked (python3's tarfile/lzma, no xz binary needed; about
# a minute for the 1.76 GB FlashAttention-3 library), the chunks are deleted, and
# `import sglang, sgl_kernel` is tried.  Exit status 0 only once SGLang is unpacked.
set -uo pipefail
DEST=${SGSITE:-/tmp/sgsite}
ROOT=$(pwd)
mkdir -p "$DEST/.chunks"
for dir in "$ROOT"/.sg[0-9]*; do
  [ -d "$dir" ] || continue
  n=${dir##*/.sg}; arc="$dir/sglang-part$n.tar.xz"
  [ -f "$arc" ] || continue
  want=$(cut -d' ' -f1 "$dir/sglang-part$n.sha256")
  if [ -f "$DEST/.part$n.ok" ] && [ "$(cat "$DEST/.part$n.ok")" = "$want" ]; then
    echo "[sgsite] part $n already in"; continue
  fi
  got=$(sha256sum "$arc" | cut -d' ' -f1)
  if [ "$got" != "$want" ]; then echo "[sgsite] part $n: checksum mismatch, skipped" >&2; continue; fi
  if python3 - "$arc" "$DEST/.chunks" <<'PYEOF'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    try:
        t.extractall(sys.argv[2], filter="data")
    except TypeError:
        t.extractall(sys.argv[2])
PYEOF
  then echo "$want" > "$DEST/.part$n.ok"; echo "[sgsite] part $n in"
  else echo "[sgsite] part $n: unpacking failed" >&2; fi
done

if [ ! -f "$DEST/.assembled" ]; then
  [ -f "$DEST/.chunks/manifest.txt" ] || { echo "[sgsite] no part in yet"; exit 1; }
  total=$(awk '$1=="parts"{print $2}' "$DEST/.chunks/manifest.txt")
  missing=""
  for n in $(seq 1 "$total"); do [ -f "$DEST/.part$n.ok" ] || missing="$missing $n"; done
  if [ -n "$missing" ]; then
    echo "[sgsite] $((total - $(echo $missing | wc -w)))/$total parts in; still missing:$missing (carry .sg<N> in a call within 30 s of the last one)"
    exit 1
  fi
  t0=$(date +%s)
  python3 - "$DEST" <<'PYEOF' || { echo "[sgsite] assembling failed" >&2; exit 1; }
import glob, hashlib, io, lzma, os, sys, tarfile
dest = sys.argv[1]; ch = os.path.join(dest, ".chunks")
segs = [l.split() for l in open(os.path.join(ch, "manifest.txt")) if l.startswith("segment")]
chunks = sorted(glob.glob(os.path.join(ch, "chunk.*")))
class Stream:  # the chunks, read in order as one file
    def __init__(self, files): self.files, self.f = list(files), None
    def read(self, n):
        out = b""
        while n > len(out):
            if self.f is None:
                if not self.files: break
                self.f = open(self.files.pop(0), "rb")
            b = self.f.read(n - len(out))
            if not b: self.f.close(); self.f = None; continue
            out += b
        return out
s = Stream(chunks)
for _, name, length, sha, target in segs:
    length = int(length); h = hashlib.sha256(); tmp = os.path.join(ch, name)
    with open(tmp, "wb") as o:
        left = length
        while left:
            b = s.read(min(left, 1 << 24)); h.update(b); o.write(b); left -= len(b)
            if not b: sys.exit(f"stream ends early in {name}")
    if h.hexdigest() != sha: sys.exit(f"{name}: checksum mismatch")
    if name.endswith(".tar.xz"):
        with tarfile.open(tmp, "r:xz") as t:
            try: t.extractall(dest, filter="tar")
            except TypeError: t.extractall(dest)
    else:
        out = os.path.join(dest, target); os.makedirs(os.path.dirname(out), exist_ok=True)
        with lzma.open(tmp) as i, open(out + ".tmp", "wb") as o:
            while b := i.read(1 << 24): o.write(b)
        os.replace(out + ".tmp", out); os.chmod(out, 0o755)
    os.remove(tmp)
for c in chunks: os.remove(c)
PYEOF
  date +%s > "$DEST/.assembled"
  echo "[sgsite] all $total parts unpacked into $DEST in $(( $(date +%s) - t0 )) s"
fi

PYTHONPATH="$DEST" python3 - <<'PYEOF'
from importlib.metadata import version, PackageNotFoundError
from packaging.version import Version
need = {  # on the GPU machine: version SGLang 0.5.14 or a bundled wheel pins or needs (printed, not fixed)
    "torch": ("==", "2.11.0"), "torchaudio": ("==", "2.11.0"), "transformers": ("==", "5.8.1"),
    "huggingface-hub": (">=", "0.34"), "typing-extensions": (">=", "4.14.1"), "anyio": (">=", "4.5"),
    "httpx": (">=", "0.23"), "prometheus-client": (">=", "0.20.0"), "packaging": (">=", "24.2"),
    "aiohttp": (">=", "3.9"), "uvloop": (">=", "0.19"), "nvidia-ml-py": (">=", "12"),
}
notes = []
for name, (op, want) in need.items():
    try: v = version(name)
    except PackageNotFoundError: notes.append(f"{name} missing"); continue
    ok = Version(v) == Version(want) if op == "==" else Version(v) >= Version(want)
    if not ok: notes.append(f"{name} {v} (wants {op}{want})")
print("[sgsite] version check:", "ok" if not notes else "; ".join(notes))
import torch, sgl_kernel, sglang
print(f"[sgsite] sglang {sglang.__version__}, sgl_kernel {getattr(sgl_kernel, '__version__', version('sglang-kernel'))}, "
      f"torch {torch.__version__}, from {sglang.__file__.rsplit('/', 2)[0]}")
from sgl_kernel.flash_attn import flash_attn_with_kvcache  # loads flash_ops (FA3)
import sglang.srt.entrypoints.http_server  # the server's whole import path
print("[sgsite] sgl_kernel.flash_ops and sglang.srt.entrypoints.http_server import")
PYEOF
rc=$?
cat <<EOF2
[sgsite] to serve (docs/design/peers.md, SGLang):
  export PYTHONPATH=$DEST HF_HUB_OFFLINE=1 SGLANG_DISABLE_REQUEST_LOGGING=1
  python3 -m sglang.launch_server --model-path MODEL_DIR --load-format dummy --dtype bfloat16 \\
      --context-length 4096 --port 8101 --served-model-name default --skip-server-warmup
EOF2
exit $rc
