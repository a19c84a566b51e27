"""A load that will not fit in memory is refused, with the figures, before any weight is read
(specui/weights/load_memory.py): the kernel would kill the app halfway through it."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from conftest import tiny_llama

from specui.errors import SpecUIError
from specui.weights import load_memory
from specui.weights.load_memory import check_plain_load, folder_weights, peak_bytes

CPU = torch.device("cpu")


@pytest.fixture
def folders(tmp_path):
    """A tiny Llama saved in float32 and in bfloat16."""
    model = tiny_llama(0, hidden=64).float()
    model.save_pretrained(tmp_path / "f32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    return tmp_path, sum(p.numel() for p in model.state_dict().values())


def test_a_folders_parameters_and_dtype_from_its_headers(folders, tmp_path):
    root, count = folders
    assert folder_weights(root / "f32") == (count, torch.float32)
    assert folder_weights(root / "bf16") == (count, torch.bfloat16)
    (tmp_path / "empty").mkdir()
    assert folder_weights(tmp_path / "empty") is None  # nothing to read (pickled weights, a hub id): no check
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")
    assert folder_weights(bad) is None  # loading it says what is wrong


def test_a_sharded_folder_counts_every_shard_its_index_names(tmp_path):
    for i, shape in enumerate(([4, 8], [3])):
        header = json.dumps({"w": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 2]}}).encode()
        (tmp_path / f"model-0000{i}.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert folder_weights(tmp_path) is None  # no index, no model.safetensors: not told
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00000.safetensors", "b": "model-00001.safetensors"}}))
    assert folder_weights(tmp_path) == (35, torch.bfloat16)


def test_the_peaks_follow_the_measured_table():
    f32, bf16 = torch.float32, torch.bfloat16
    assert peak_bytes("none", bf16, bf16, False, False) == pytest.approx(2.4)  # mapped, read by every forward
    assert peak_bytes("none", f32, f32, False, True) == pytest.approx(6.4)  # and the copy --dtype auto times
    assert peak_bytes("int4", bf16, f32, False, False) == pytest.approx(3.6)  # converted to bfloat16 first
    assert peak_bytes("w4a8", f32, f32, False, False) == pytest.approx(1.9)
    assert peak_bytes("w4a8", f32, None, True, False) == pytest.approx(7.2)  # a GGUF, dequantized as read
    assert peak_bytes("none", bf16, None, True, False) == pytest.approx(2.7)


def test_a_load_that_will_not_fit_is_refused_before_any_weight_is_read(folders, monkeypatch):
    from specui.weights import concrete
    from specui.weights.loading import ModelSpec

    root, count = folders

    def never(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(concrete.AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setattr(load_memory, "free_memory", lambda device: 1000)  # bytes
    with pytest.raises(SpecUIError, match=r"needs about .* GiB of memory to load in float32 .*mapped.*this machine "
                                          r"has 0\.0 GiB available \(a load may plan on 90% of it.*\); choose a "
                                          r"smaller model"):
        concrete.load_concrete(ModelSpec(str(root / "f32"), "float32", "cpu", "none"), "target")
    # room for the bfloat16 files loaded as they are, not for them converted to float32: the refusal says what fits
    monkeypatch.setattr(load_memory, "free_memory", lambda device: int(count * 2.6 / 0.9))
    with pytest.raises(SpecUIError, match=r"bfloat16 weights converted as read.*--quantization none --dtype "
                                          r"bfloat16 would need about"):
        concrete.load_concrete(ModelSpec(str(root / "bf16"), "float32", "cpu", "none"), "target")


def test_what_fits_and_what_is_not_checked_passes(folders, monkeypatch):
    root, count = folders
    monkeypatch.setattr(load_memory, "free_memory", lambda device: count * 8)
    check_plain_load("x", str(root / "f32"), None, True, None, "w4a8", torch.float32, CPU, False)
    monkeypatch.setattr(load_memory, "free_memory", lambda device: 1000)
    with pytest.raises(SpecUIError):  # the same load, with no room
        check_plain_load("x", str(root / "f32"), None, True, None, "w4a8", torch.float32, CPU, False)
    check_plain_load("org/name", "org/name", None, False, None, "none", torch.float32, CPU, True)  # a hub id
    check_plain_load("x", str(root / "f32"), None, True, None, "4bit", torch.float32, CPU, False)  # bitsandbytes
    check_plain_load("x", str(root), "m.gguf", True, None, "none", torch.float32, CPU, False)  # no reader: no table


@pytest.mark.bundled
def test_a_ggufs_parameters_from_its_header(monkeypatch):
    from specui.weights.gguf_blocks import open_gguf
    from specui.weights.sources import BUNDLED, locate

    where, name, _ = locate(BUNDLED)
    reader = open_gguf(f"{where}/{name}")
    assert 134e6 < load_memory.gguf_weights(reader) < 136e6  # SmolLM2-135M
    monkeypatch.setattr(load_memory, "free_memory", lambda device: 1 << 30)
    with pytest.raises(SpecUIError, match=r"135M parameters.*a GGUF is dequantized as it is read"):
        check_plain_load(BUNDLED, where, name, True, reader, "w4a8", torch.float32, CPU, False)


def test_a_control_groups_limit_bounds_the_memory_available(tmp_path):
    """In a container /proc/meminfo shows the host's memory; the limit of the process's group (or of
    an ancestor) is where the kernel kills, less what the group uses, its file cache counted free."""
    from specui.engine.host_memory import cgroup_room

    v2 = "0::/app/worker\n"
    assert cgroup_room(tmp_path, v2) is None  # no memory controller: no limit
    group = tmp_path / "app" / "worker"
    group.mkdir(parents=True)
    (group / "memory.max").write_text("max\n")
    assert cgroup_room(tmp_path, v2) is None
    (group / "memory.max").write_text(f"{8 << 30}\n")
    (group / "memory.current").write_text(f"{3 << 30}\n")
    (group / "memory.stat").write_text(f"anon 123\nfile {1 << 30}\nactive_file 5\n")
    assert cgroup_room(tmp_path, v2) == 6 << 30
    (tmp_path / "app" / "memory.max").write_text(f"{4 << 30}\n")  # the parent's limit is tighter
    (tmp_path / "app" / "memory.current").write_text(f"{3 << 30}\n")
    assert cgroup_room(tmp_path, v2) == 1 << 30  # (its statistics unreadable: no cache counted free)
    v1 = "4:memory:/box\n2:cpu,cpuacct:/box\n"
    box = tmp_path / "memory" / "box"
    box.mkdir(parents=True)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_room(tmp_path, v1) is None
    (box / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")
    (box / "memory.usage_in_bytes").write_text(f"{5 << 30}\n")
    (box / "memory.stat").write_text("total_cache 0\n")
    assert cgroup_room(tmp_path, v1) == 0  # over its limit already: nothing left


def test_free_memory_is_the_lesser_of_the_systems_and_the_groups(monkeypatch):
    from specui.engine import host_memory

    monkeypatch.setattr(host_memory, "cgroup_room", lambda root: 1 << 20)
    assert host_memory.free_memory(CPU) == 1 << 20
    monkeypatch.setattr(host_memory, "cgroup_room", lambda root: None)
    assert host_memory.free_memory(CPU) > 1 << 20  # MemAvailable


def test_a_pair_load_gives_the_heap_it_freed_back(tiny_dirs, monkeypatch):
    """load_pair hands what the load freed (a GGUF's dequantized tensors, matrices packed one by one)
    back to the system, also when it fails: a 1.07B Q4_0 GGUF on w4a8 held 3.4 GiB after loading, 1.4
    after malloc_trim (2026-12-05)."""
    from specui.service import pair
    from specui.weights.loading import ModelSpec

    released = []
    monkeypatch.setattr(pair, "release_freed_memory", lambda: released.append(1))
    target_dir, draft_dir, _ = tiny_dirs
    pair.load_pair(ModelSpec(str(target_dir), dtype="float32", device="cpu"), None)
    assert released == [1]
    with pytest.raises(SpecUIError):
        pair.load_pair(ModelSpec(str(target_dir / "nowhere"), dtype="float32", device="cpu"), None)
    assert released == [1, 1]


def test_only_the_models_weight_files_are_counted(folders, tmp_path):
    """A converted GGUF's four_bit.safetensors and a hub folder's consolidated copy beside its shards
    are not the model's weights: counting them refused loads that fit."""
    import shutil

    root, count = folders
    folder = tmp_path / "converted"
    shutil.copytree(root / "f32", folder)
    shutil.copy(folder / "model.safetensors", folder / "four_bit.safetensors")
    assert folder_weights(folder) == (count, torch.float32)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}}))
    shutil.copy(folder / "model-00001-of-00001.safetensors", folder / "consolidated.safetensors")
    assert folder_weights(folder) == (count, torch.float32)
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + b"{}")  # a corrupt length: not read
    assert folder_weights(huge) is None
    (huge / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")  # not a header
    assert folder_weights(huge) is None
