"""`--doctor` names the CPU's class (README's per-CPU rows are named so) from /proc/cpuinfo's
vendor, family, model and stepping; an unknown or unreadable one gets no class, never an error."""

from __future__ import annotations

import pytest

from specui.engine.cpu_class import cpu_class
from specui.weights import doctor

AMD, INTEL = "AuthenticAMD", "GenuineIntel"


def info(vendor: str, family: int | str, model: int | str, stepping: int | str = 1) -> dict[str, str]:
    return {"vendor_id": vendor, "cpu family": str(family), "model": str(model), "stepping": str(stepping)}


@pytest.mark.parametrize(("fields", "want"), [
    (info(AMD, 23, 1), "AMD Zen 1 / Zen+ (AVX2 on 128-bit units)"),  # Naples: this README's Zen 1 rows
    (info(AMD, 23, 8), "AMD Zen 1 / Zen+ (AVX2 on 128-bit units)"),
    (info(AMD, 23, 49), "AMD Zen 2"),  # Rome
    (info(AMD, 25, 1), "AMD Zen 3"),  # Milan
    (info(AMD, 25, 33), "AMD Zen 3"),
    (info(AMD, 25, 17), "AMD Zen 4"),  # Genoa
    (info(AMD, 25, 97), "AMD Zen 4"),
    (info(AMD, 25, 160), "AMD Zen 4"),
    (info(AMD, 26, 2), "AMD Zen 5"),
    (info(INTEL, 6, 85, 4), "Intel Skylake"),
    (info(INTEL, 6, 85, 7), "Intel Cascade Lake"),
    (info(INTEL, 6, 85, 11), "Intel Cooper Lake"),
    (info(INTEL, 6, 143), "Intel Sapphire Rapids"),
    (info(INTEL, 6, 207), "Intel Emerald Rapids"),
    (info(INTEL, 6, 42), None),  # a model not in the table
    (info(AMD, 25, 0x30), "AMD Zen 3"),  # Trento
    (info(AMD, 25, 0x90), "AMD Zen 4"),
    (info(AMD, 25, 0xB0), None),  # a family-25 model range no class is known for
    (info(AMD, 23, 0x50), "AMD Zen 1 / Zen+ (AVX2 on 128-bit units)"),
    (info(AMD, 26, 0x50), "AMD Zen 6"),
    (info(AMD, 26, 0x30), None),
    (info(INTEL, 6, 63), "Intel Haswell"),
    (info(INTEL, 6, 79), "Intel Broadwell"),
    (info(INTEL, 6, 106), "Intel Ice Lake"),
    (info(INTEL, 6, 173), "Intel Granite Rapids"),
    (info(INTEL, 6, 85, ""), "Intel Skylake / Cascade Lake / Cooper Lake"),  # stepping hidden
    ({"vendor_id": INTEL, "cpu family": "6", "model": "85"}, "Intel Skylake / Cascade Lake / Cooper Lake"),
    (info(AMD, 21, 2), None),  # an older AMD family
    (info("HygonGenuine", 24, 1), None),
    (info(AMD, "", 1), None),  # unreadable fields
    ({}, None),  # no /proc/cpuinfo (macOS, Windows)
])
def test_vendor_family_model_and_stepping_name_the_class(fields, want):
    assert cpu_class(fields) == want


def test_the_doctor_line_carries_the_class_where_there_is_one(monkeypatch):
    monkeypatch.setattr(doctor, "cpu_class_name", lambda: "AMD Zen 3")
    assert any(line.startswith("CPU: ") and line.endswith("; class: AMD Zen 3") for line in doctor.machine_lines())
    monkeypatch.setattr(doctor, "cpu_class_name", lambda: None)
    assert not any("class:" in line for line in doctor.machine_lines())
