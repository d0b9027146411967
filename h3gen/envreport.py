"""`h3gen env`: what this machine offers h3gen (versions, devices, codecs), for bug reports and support."""

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version

_PACKAGES = ("torch", "triton", "diffusers", "transformers", "accelerate", "safetensors", "av", "gradio", "fastapi")


def _version(name: str) -> str:
    """The installed distribution's version, read from its metadata: importing diffusers, transformers and gradio
    only to read theirs would take most of a minute on a small machine."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def environment_report() -> list[tuple[str, str]]:
    """(label, value) rows: h3gen, Python, platform, CPU/memory, package versions, accelerators, codecs."""
    import h3gen

    rows = [
        ("h3gen", h3gen.__version__),
        ("python", sys.version.split()[0]),
        ("platform", platform.platform()),
        ("cpu cores", str(os.cpu_count())),
    ]
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        rows.append(("memory", f"{pages * page_size / 2**30:.1f} GiB"))
    except (ValueError, OSError, AttributeError):
        pass
    rows += [(name, _version(name)) for name in _PACKAGES]

    import torch

    if torch.cuda.is_available():
        rows.append(("cuda", f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)"))
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            rows.append(
                (f"cuda:{index}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}")
            )
    else:
        rows.append(("cuda", "not available (CPU only)"))
    try:
        import av

        codecs = [name for name in ("libx264", "aac") if name in av.codecs_available]
        rows.append(("encoders", ", ".join(codecs) or "none of libx264/aac (MP4 output will fail)"))
    except ImportError:
        rows.append(("encoders", "PyAV missing (MP4 output will fail)"))
    rows.append(("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "unset")))
    return rows
