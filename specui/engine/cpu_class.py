"""The CPU's class by name (README's per-CPU table names its rows so), from /proc/cpuinfo's vendor,
family, model and stepping: virtual machines call every EPYC "AMD EPYC" and many Xeons "Intel Xeon
Processor", while a Zen 1 (AVX2 on 128-bit units) and a Zen 4 (AVX-512) differ several times in
what their kernels cost. AMD's families and models as the Linux kernel ranges them; Intel's Xeons."""

from __future__ import annotations

from collections.abc import Mapping

# (family, first model, last model, class), AMD: the Linux kernel's ranges (arch/x86/kernel/cpu/amd.c)
AMD = (
    (0x17, 0x00, 0x2F, "Zen 1 / Zen+ (AVX2 on 128-bit units)"),
    (0x17, 0x50, 0x5F, "Zen 1 / Zen+ (AVX2 on 128-bit units)"),
    (0x17, 0x30, 0x4F, "Zen 2"),
    (0x17, 0x60, 0x7F, "Zen 2"),
    (0x17, 0x90, 0x91, "Zen 2"),
    (0x17, 0xA0, 0xAF, "Zen 2"),
    (0x19, 0x00, 0x0F, "Zen 3"),
    (0x19, 0x20, 0x5F, "Zen 3"),
    (0x19, 0x10, 0x1F, "Zen 4"),
    (0x19, 0x60, 0xAF, "Zen 4"),
    (0x1A, 0x00, 0x2F, "Zen 5"),
    (0x1A, 0x40, 0x4F, "Zen 5"),
    (0x1A, 0x60, 0x7F, "Zen 5"),
    (0x1A, 0x50, 0x5F, "Zen 6"),
    (0x1A, 0x90, 0xAF, "Zen 6"),
    (0x1A, 0xC0, 0xCF, "Zen 6"),
)
# Intel family 6 by model, the server (Xeon) parts; 85 is three generations told apart by stepping
INTEL = {
    63: "Haswell", 79: "Broadwell", 86: "Broadwell", 106: "Ice Lake", 108: "Ice Lake", 143: "Sapphire Rapids",
    207: "Emerald Rapids", 173: "Granite Rapids", 174: "Granite Rapids", 175: "Sierra Forest",
}
SKYLAKE_FAMILY = 85  # Skylake (stepping up to 4), Cascade Lake (5-7), Cooper Lake (10-11)


def cpu_class(info: Mapping[str, str]) -> str | None:
    """E.g. "AMD Zen 3" or "Intel Cascade Lake" for /proc/cpuinfo's first processor's fields; None
    where they name no class known here (or there is no /proc/cpuinfo)."""
    try:
        family, model = int(info["cpu family"]), int(info["model"])
    except (KeyError, ValueError):
        return None
    vendor = info.get("vendor_id", "")
    if vendor == "AuthenticAMD":
        return next((f"AMD {name}" for fam, low, high, name in AMD if fam == family and low <= model <= high), None)
    if vendor != "GenuineIntel" or family != 6:
        return None
    if model == SKYLAKE_FAMILY:
        if not info.get("stepping", "").isdigit():  # a VM may hide it: any of the three
            return "Intel Skylake / Cascade Lake / Cooper Lake"
        stepping = int(info["stepping"])
        return "Intel " + ("Cooper Lake" if stepping >= 10 else "Cascade Lake" if stepping >= 5 else "Skylake")
    return f"Intel {INTEL[model]}" if model in INTEL else None
