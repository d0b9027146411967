"""One host copy of the streamed weights per machine, shared by the local ranks of a torchrun group.

Under Ulysses sequence parallelism every rank holds the same full weights, so per-rank pinned copies (what SGLang
keeps) multiply host memory by the number of GPUs. Here local rank 0 packs the weights into a file in shared
memory (`/dev/shm`), the other local ranks map the same file and never load those weights at all, and each process
page-locks the mapping for fast copies. The file is unlinked as soon as every rank has mapped it, so nothing is left
behind once the processes end.

Protocol (no process group needed, so it also works before one exists): the owner writes `<name>.part`, renames it
to `<name>` when filled (readers never see a half-written file), and waits for a `<name>.rank<r>` marker from each
reader before unlinking everything.
"""

import atexit
import logging
import os
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ALIGN = 256  # bytes; every buffer starts aligned for any dtype and for vectorized copies


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def local_rank_and_world() -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them; (0, 1) outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def default_key(what: str) -> str:
    """A name the local ranks of one launch agree on: torchrun's run id (or the ranks' shared parent process)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or str(os.getppid())
    return f"h3gen-{run}-{what}".replace("/", "_")


class SharedHostStore:
    """Flat host buffers in one shared-memory file: `allocate` lays them out and maps the file (the owner creates
    it); the owner fills them and calls `publish`. Readers' `allocate` waits until the owner has published."""

    def __init__(
        self,
        key: str,
        *,
        local_rank: int | None = None,
        local_world: int | None = None,
        directory: str | os.PathLike = "/dev/shm",
        timeout: float = 1800.0,
        pin: bool = False,
    ):
        rank, world = local_rank_and_world()
        self.rank = rank if local_rank is None else local_rank
        self.world = world if local_world is None else local_world
        self.path = Path(directory) / key
        self.timeout = timeout
        self.pin = pin
        self.storage: torch.Tensor | None = None
        self.registered = False

    @property
    def owner(self) -> bool:
        """Whether this process writes the weights (local rank 0); the others only map them."""
        return self.rank == 0

    @staticmethod
    def fits(nbytes: int, directory: str | os.PathLike = "/dev/shm") -> bool:
        """Whether `directory` exists and has room for `nbytes`."""
        try:
            return shutil.disk_usage(directory).free >= nbytes
        except OSError:
            return False

    def allocate(self, sizes: list[dict[torch.dtype, int]]) -> list[dict[torch.dtype, torch.Tensor]]:
        """Per entry of `sizes` (element counts per dtype), flat tensors viewing the shared file, in order."""
        layout, total = [], 0
        for entry in sizes:
            placed = {}
            for dtype, count in entry.items():
                placed[dtype] = (total, count)
                total += _align(count * torch.empty(0, dtype=dtype).element_size())
            layout.append(placed)
        total = max(total, ALIGN)
        if self.owner:
            part = self.path.with_name(self.path.name + ".part")
            part.unlink(missing_ok=True)
            atexit.register(self._remove_files)  # if this process dies before publishing, leave nothing behind
            with open(part, "wb") as handle:
                handle.truncate(total)
            self.storage = torch.from_file(str(part), shared=True, size=total, dtype=torch.uint8)
        else:
            self._wait_for(self.path, "the weights local rank 0 is packing")
            size = self.path.stat().st_size
            if size != total:
                raise RuntimeError(
                    f"shared host store {self.path} holds {size} bytes, this rank expects {total}: "
                    "the local ranks did not build the same model."
                )
            self.storage = torch.from_file(str(self.path), shared=True, size=total, dtype=torch.uint8)
            self.path.with_name(f"{self.path.name}.rank{self.rank}").touch()
        self._register()
        return [
            {
                dtype: self.storage[offset : offset + _align(count * torch.empty(0, dtype=dtype).element_size())].view(
                    dtype
                )[:count]
                for dtype, (offset, count) in placed.items()
            }
            for placed in layout
        ]

    def publish(self) -> None:
        """Owner: make the filled file visible to the readers, wait until each has mapped it, then unlink it (the
        mappings stay valid). Readers: nothing."""
        if not self.owner:
            return
        os.replace(self.path.with_name(self.path.name + ".part"), self.path)
        try:
            for rank in range(1, self.world):
                self._wait_for(self.path.with_name(f"{self.path.name}.rank{rank}"), f"local rank {rank} to map them")
        finally:
            self._remove_files()

    def _remove_files(self) -> None:
        names = [self.path, self.path.with_name(self.path.name + ".part")]
        names += [self.path.with_name(f"{self.path.name}.rank{rank}") for rank in range(1, self.world)]
        for name in names:
            name.unlink(missing_ok=True)

    def _wait_for(self, path: Path, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout:.0f} s for {what} ({path}); did a rank fail to load?")
            time.sleep(0.05)

    def _register(self) -> None:
        """Page-lock the mapping (each process registers its own mapping of the shared pages)."""
        if not self.pin or not torch.cuda.is_available():
            return
        result = torch.cuda.cudart().cudaHostRegister(self.storage.data_ptr(), self.storage.numel(), 0)
        if int(result) != 0:
            log.warning(
                "could not page-lock the shared host store (cudaHostRegister error %s); copies from it "
                "will be slower. Raise the locked-memory limit (ulimit -l) to fix this.",
                int(result),
            )
        else:
            self.registered = True

    @property
    def nbytes(self) -> int:
        return 0 if self.storage is None else self.storage.numel()


def shared_store_for_ranks(what: str, nbytes: int, *, pin: bool, directory: str | os.PathLike = "/dev/shm"):
    """A `SharedHostStore` for `what` when this process is one of several local ranks and every rank sees room for
    `nbytes` in `directory` (agreed over the default process group, if one is initialised); otherwise None, with a
    warning when sharing was possible in principle but could not be used."""
    rank, world = local_rank_and_world()
    if world < 2:
        return None
    fits = SharedHostStore.fits(nbytes, directory)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        votes = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(votes, fits)
        fits = all(votes)
    if not fits:
        log.warning(
            "not enough room in %s for one shared host copy of the %s (%.1f GiB); each of the %d local "
            "ranks keeps its own copy.",
            directory,
            what,
            nbytes / 2**30,
            world,
        )
        return None
    return SharedHostStore(default_key(what), local_rank=rank, local_world=world, directory=directory, pin=pin)
