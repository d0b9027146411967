"""How much host memory a load may take, checked before any weights are read."""

from pathlib import Path

from h3gen.errors import CheckpointError

GiB = 2**30


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, capped by the cgroup limit when one is set (None if unknown)."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        return None
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and available is not None:
            available = min(available, int(limit) - usage)
    return available


def check_host_memory(
    needed_bytes: int,
    what: str,
    available_bytes: int | None = None,
    advice: str = "free memory, use MXFP4 weights, or keep more on the GPU (a larger --gpu-memory)",
) -> None:
    """Refuse, before loading, a plan whose host copies would not fit, saying how much is needed and free, and what
    to do (`advice`)."""
    available = available_host_bytes() if available_bytes is None else available_bytes
    if available is not None and needed_bytes > available:
        raise CheckpointError(
            f"{what} needs {needed_bytes / GiB:.1f} GiB of host memory but only {available / GiB:.1f} GiB is "
            f"available; {advice}."
        )


def folder_bytes(folder) -> int:
    """Bytes of the safetensors files in a component folder (what its host copy will take)."""
    return sum(path.stat().st_size for path in Path(folder).glob("*.safetensors"))
