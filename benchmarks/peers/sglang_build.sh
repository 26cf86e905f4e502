#!/usr/bin/env bash
# Builds the SGLang 0.5.14 GPU bundle on the CPU machine: .sg1/ ... .sgN/ at the repository root
# (git-ignored through .git/info/exclude), each holding sglang-partN.tar.xz (at most 55 MiB, so that
# a part plus the ~6 MB repository fits one device call's 64 MiB) and its .sha256.
#     bash benchmarks/peers/sglang_build.sh                     # parts at $(git rev-parse --show-toplevel)
#     OUT_ROOT=/work/main bash benchmarks/peers/sglang_build.sh # from a worktree: parts where calls are made
# Needs: pip reaching the package registry, xz, strip, python3 with `packaging`.  About 20 minutes
# the first time on 2 cores (xz -9 of the 1.76 GB FlashAttention-3 library dominates; its compressed
# form is cached under $CACHE by checksum, so a rebuild takes a few minutes); ~5 GB in /tmp.
# Install on the GPU machine: benchmarks/peers/sglang_install.sh (one part per call, calls back to back).
set -euo pipefail
ROOT=${OUT_ROOT:-$(git rev-parse --show-toplevel)}
WORK=${WORK:-/tmp/sg_build}
CACHE=${CACHE:-/tmp/sgcache}          # xz of the big kernel library, keyed by its sha256
PY=${PY:-python3}
CHUNK_MIB=${CHUNK_MIB:-55}            # 55 MiB = 57.7 MB a part: a part + the repo stays under 64 MiB
# SGLang 0.5.14 is the newest release whose wheel pins torch==2.11.0, the GPU machine's torch
# (0.5.16/0.5.17 pin it too, but 0.5.17 pins transformers 5.12.1 and kernel 0.4.5; 0.5.18+ pin
# torch 2.13).  Its kernels: sglang-kernel 0.4.4 (built against torch 2.11.0) and flashinfer 0.6.12.
# The script checks the pins from the wheel's METADATA below and stops if they differ.
SGLANG=sglang==0.5.14
KERNELS="sglang-kernel==0.4.4 flashinfer-python==0.6.12"
# Not bundled although sglang 0.5.14 Requires-Dist them (none is imported at module level on the
# `python -m sglang.launch_server` path, found by following every module-level import from
# sglang.launch_server and sglang.srt.entrypoints.http_server, see docs/design/peers.md):
#   flashinfer-cubin (448 MB: precompiled trtllm-gen cubins, Blackwell kernels; FlashInfer JIT-builds
#   what it needs with the machine's nvcc), flash-attn-4 / nvidia-cutlass-dsl / quack-kernels /
#   tilelang / tokenspeed_mla / sgl-deep-gemm / nvidia-mathdx (Blackwell, MLA, FP8 and CuTe-DSL
#   paths), torchao, kernels, datasets, modelscope, mistral_common, outlines, llguidance, anthropic,
#   blobfile, smg-grpc-servicer, torch_memory_saver, py-spy, timm, torchcodec, cuda-python
#   (the machine has cuda-bindings/cuda-core), openai-harmony (gpt-oss only), interegular, easydict.
# Already on the GPU machine (KINDS.md's package list), so not bundled: torch, triton, transformers,
# tokenizers, safetensors, numpy, huggingface-hub, aiohttp, requests, psutil, pillow, pyyaml, jinja2,
# regex, einops, filelock, sentencepiece, tiktoken, torchvision, torchaudio, packaging, tqdm, uvloop,
# prometheus-client, nvidia-ml-py, anyio, httpx, h11, click, attrs, ninja, msgpack, scipy and the
# nvidia-* CUDA 13 runtime wheels of torch 2.11+cu130 (sglang-kernel and flashinfer need no other).
# The rest: what SGLang imports on that path (or a dependency of it needs) that the machine lacks.
# Versions: the newest the registry served on 2026-12-04 that satisfy SGLang's and each other's pins;
# typing-extensions 4.16.0 as in vLLM's bundle: it shadows the machine's own, and an older one breaks
# a newer anyio (`from typing_extensions import sentinel`, seen in the CPU import test).
DEPS="fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 python-multipart==0.0.34 opentelemetry-api==1.45.2
pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
orjson==3.13.0 pyzmq==27.3.0 msgspec==0.23.0 pybase64==1.5.1 partial-json-parser==0.2.1.1.post7
setproctitle==1.3.8 watchfiles==1.3.0 openai==2.6.1 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1
ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2
traitlets==5.16.1 pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4
stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure-eval==0.2.4
compressed-tensors==0.20.1 loguru==0.7.3 gguf==0.19.0 dill==0.4.1
jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
xgrammar==0.2.1 apache-tvm-ffi==0.1.9"
PLATS="--platform manylinux2014_x86_64 --platform any"
for n in 39 38 36 35 34 33 32 31 29 28 27 26 24 17 5; do PLATS="$PLATS --platform manylinux_2_${n}_x86_64"; done

mkdir -p "$WORK/wheels" "$CACHE"
rm -rf "$WORK/site" "$WORK/pack"; mkdir -p "$WORK/site" "$WORK/pack"
# Wheels are kept between runs (pip skips what is already in the folder).  The sglang wheel is
# cp312 manylinux_2_34 (glibc >= 2.34 on the GPU machine: its Python 3.12.3 is Ubuntu 24.04's, 2.39).
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATS \
  -d "$WORK/wheels" $SGLANG $KERNELS $DEPS

# Unpack every wheel into one site folder (what `pip install --target` does), check the pins, trim.
# shellcheck disable=SC2086
$PY - "$WORK" $SGLANG $KERNELS $DEPS <<'PYEOF'
import glob, os, re, shutil, subprocess, sys, zipfile
work = sys.argv[1]; site = os.path.join(work, "site")
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
pins = {norm(a.split("==")[0]): a.split("==")[1] for a in sys.argv[2:]}
wheels = []  # only the pinned wheels: $WORK/wheels may hold others from earlier runs
for w in sorted(glob.glob(os.path.join(work, "wheels", "*.whl"))):
    name, ver = os.path.basename(w).split("-")[:2]
    if pins.get(norm(name)) == ver: wheels.append(w)
if len(wheels) != len(pins): sys.exit(f"{len(pins)} wheels pinned, {len(wheels)} found")
print(f"[build] {len(wheels)} wheels")
def size(p):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs if not os.path.islink(os.path.join(d, f)))
for w in wheels:
    z = zipfile.ZipFile(w)
    if os.path.basename(w).startswith("sglang-0.5.14"):
        meta = z.read("sglang-0.5.14.dist-info/METADATA").decode()
        for pin in ("torch==2.11.0", "sglang-kernel==0.4.4", "flashinfer_python[cu13]==0.6.12", "xgrammar==0.2.1", "apache-tvm-ffi==0.1.9", "openai==2.6.1", "soundfile==0.13.1"):
            if f"Requires-Dist: {pin}\n" not in meta:
                sys.exit(f"sglang 0.5.14 METADATA does not pin {pin}")
    for i in z.infolist():
        z.extract(i, site)
        mode = (i.external_attr >> 16) & 0o777
        if mode:
            os.chmod(os.path.join(site, i.filename), mode)
print(f"[build] unpacked: {size(site)/2**20:.0f} MiB")
drop = [
    # sgl_kernel: sm90/common_ops is what load_utils.py loads at compute capability 9.0; sm100/ is for
    # every other capability (Blackwell).  flashmla_ops: MLA models only (its import is guarded).
    # flash_ops.abi3.so (FlashAttention 3, 1.76 GB, no debug info to strip) STAYS: server_args.py's
    # _get_default_attn_backend returns "fa3" for MHA models (Llama) on Hopper with CUDA >= 12.3.
    "sgl_kernel/sm100", "sgl_kernel/flashmla_ops.abi3.so",
    # sglang: the diffusion server (sglang.srt never imports sglang.multimodal_gen), pip's file lists
    "sglang/multimodal_gen", "sglang-0.5.14.dist-info/RECORD", "sglang-0.5.14.dist-info/scm_file_list.json",
    # xgrammar's static library + C++ headers (for linking against xgrammar; nothing here does).
    # tvm_ffi keeps its headers and dlpack, unlike vLLM's bundle: SGLang 0.5.14 JIT-compiles its
    # RMSNorm, RoPE and KV-cache store kernels (sglang/jit_kernel, through tvm_ffi.cpp.load_inline
    # and nvcc) on the default CUDA path, and FlashInfer JIT-compiles the same way; both need them,
    # and flashinfer/data (its CUDA sources, CUTLASS and CCCL headers) stays for the same reason.
    "xgrammar/lib", "xgrammar/include",
]
for d in drop:
    p = os.path.join(site, d)
    if os.path.isdir(p): shutil.rmtree(p)
    elif os.path.exists(p): os.remove(p)
    else: sys.exit(f"expected path missing: {d}")
# One patch: SGLang 0.5.14 pins transformers 5.8.1; the GPU machine has 5.17.0, which has its own
# "qwen3_asr" config, and sglang/srt/configs/qwen3_asr.py registers that name again without
# exist_ok, so `import sglang.srt.server_args` (every launch) raises ValueError.  exist_ok=True lets
# SGLang's class replace it, as with transformers 5.8.1 (seen in the CPU import test, 2026-12-04).
qa = os.path.join(site, "sglang/srt/configs/qwen3_asr.py")
src = open(qa).read()
for name, cls in (("qwen3_asr", "Qwen3ASRConfig"), ("qwen3_asr_thinker", "Qwen3ASRThinkerConfig")):
    old = f'AutoConfig.register("{name}", {cls})\n'
    if old not in src: sys.exit(f"qwen3_asr.py: expected line missing: {old!r}")
    src = src.replace(old, f'AutoConfig.register("{name}", {cls}, exist_ok=True)\n')
open(qa, "w").write(src)
for p in glob.glob(os.path.join(site, "**", "__pycache__"), recursive=True):
    shutil.rmtree(p)
# Strip DWARF debug info where a library carries it (xgrammar's bindings: ~50 MB of it).
for so in glob.glob(os.path.join(site, "**", "*.so*"), recursive=True):
    if os.path.islink(so) or not os.path.isfile(so): continue
    before = os.path.getsize(so)
    subprocess.run(["strip", "--strip-debug", so], check=False, capture_output=True)
    after = os.path.getsize(so)
    if before - after > 1 << 20:
        print(f"[build] strip {os.path.relpath(so, site)}: {before/2**20:.1f} -> {after/2**20:.1f} MiB")
print(f"[build] after trimming: {size(site)/2**20:.0f} MiB")
big = sorted(((os.path.getsize(os.path.join(d, f)), os.path.relpath(os.path.join(d, f), site)) for d, _, fs in os.walk(site) for f in fs), reverse=True)[:8]
for s, p in big: print(f"[build]   {s/2**20:8.1f} MiB  {p}")
PYEOF

# Packing.  The FlashAttention-3 library alone compresses to far more than one part, so the bundle is
# one byte stream cut into 55 MiB chunks: [rest.tar.xz][flash_ops.abi3.so.xz], each an xz stream
# (xz -9, two threads).  Every part is a .tar.xz of its chunk (already compressed: xz -0 only makes
# it a tar.xz) plus manifest.txt (the two segments' lengths and sha256, the part count).  install.sh
# gathers the chunks part by part and unpacks once all are in.
cd "$WORK/site"
BIG=sgl_kernel/flash_ops.abi3.so
sha=$(sha256sum "$BIG" | cut -c1-64)
if [ ! -f "$CACHE/flash_ops.abi3.so.xz" ] || [ "$(cat "$CACHE/flash_ops.src.sha256" 2>/dev/null)" != "$sha" ]; then
  echo "[build] compressing $BIG (1.76 GB; ~20 min on 2 cores)"
  xz -9 -T2 -c "$BIG" > "$CACHE/flash_ops.abi3.so.xz.tmp"
  mv "$CACHE/flash_ops.abi3.so.xz.tmp" "$CACHE/flash_ops.abi3.so.xz"; echo "$sha" > "$CACHE/flash_ops.src.sha256"
fi
find . \( -type f -o -type l \) ! -path "./$BIG" | sed 's|^\./||' | LC_ALL=C sort > ../rest.txt
tar --owner=0 --group=0 --numeric-owner --mtime=2026-06-26 -cf - -T ../rest.txt | xz -9 -T2 > ../pack/rest.tar.xz
cp "$CACHE/flash_ops.abi3.so.xz" ../pack/flash_ops.abi3.so.xz
cd ../pack
cat rest.tar.xz flash_ops.abi3.so.xz | split -b "${CHUNK_MIB}M" -d -a 2 - chunk.
N=$(ls chunk.* | wc -l)
{ echo "parts $N"
  echo "segment rest.tar.xz $(stat -c %s rest.tar.xz) $(sha256sum rest.tar.xz | cut -c1-64) ."
  echo "segment flash_ops.abi3.so.xz $(stat -c %s flash_ops.abi3.so.xz) $(sha256sum flash_ops.abi3.so.xz | cut -c1-64) $BIG"
} > manifest.txt
EXCLUDE=$(git -C "$ROOT" rev-parse --path-format=absolute --git-common-dir)/info/exclude  # .git is a file in a worktree
for d in "$ROOT"/.sg[0-9]*; do [ -d "$d" ] && rm -rf "$d"; done
i=0
for c in chunk.*; do
  i=$((i + 1)); mkdir -p "$ROOT/.sg$i" stage; rm -f stage/*
  mv "$c" "stage/chunk.$(printf %02d $i)"; cp manifest.txt stage/
  tar --owner=0 --group=0 --numeric-owner --mtime=2026-06-26 -C stage -cf - . | xz -0 -T1 > "$ROOT/.sg$i/sglang-part$i.tar.xz"
  ( cd "$ROOT/.sg$i" && sha256sum "sglang-part$i.tar.xz" > "sglang-part$i.sha256" )
  grep -qxF "/.sg$i/" "$EXCLUDE" 2>/dev/null || echo "/.sg$i/" >> "$EXCLUDE"
done
echo "[build] $N parts; rest.tar.xz $(($(stat -c %s rest.tar.xz) >> 20)) MiB, flash_ops.abi3.so.xz $(($(stat -c %s flash_ops.abi3.so.xz) >> 20)) MiB"
ls -l "$ROOT"/.sg*/sglang-part*.tar.xz
