"""How a device channel's bytes move (``device_channel.py``): a pair's two-rank group (gloo between
CPU workers, NCCL between distinct GPUs), its point-to-point sends and receives with a deadline each,
and CUDA IPC between two workers of one GPU (only plain fields cross the socket, never a pickle)."""

from __future__ import annotations

import logging
import re
from datetime import timedelta

import torch

from hetserve.runtime.workers.wire import DTYPES, MalformedMessage

# torch names the shared-memory file of a CUDA IPC reference counter /torch_<pid>_<random>_<n>
_REFCOUNT_FILE = re.compile(rb"/torch_[0-9A-Za-z_]{1,60}")
_REFCOUNT_SLOTS = 10000  # counters per such file (torch's CUDA_IPC_REF_COUNTER_FILE_SIZE): an offset's bound
log = logging.getLogger("hetserve.runtime.workers.channel_backends")


class ChannelError(ConnectionError):
    """A transfer on a device channel that failed, timed out or was refused."""


class IpcOpenFailed(ChannelError):
    """``open_ipc`` failed after it began to open the sender's allocations; it released the rest."""


def pair_group(kind: str, rank: int, store, host: str, device: torch.device, timeout_s: float):
    """The pair's two-rank group, connected (NCCL's communicator made by a first one-element transfer)."""
    from torch.distributed import ProcessGroupGloo

    # joining waits for the peer to finish loading; each transfer has its own deadline (``wait``)
    timeout = timedelta(seconds=max(timeout_s, 60.0))
    if kind == "gloo":
        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        return ProcessGroupGloo(store, rank, 2, opts)
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    group = ProcessGroupNCCL(store, rank, 2, opts)
    probe = torch.zeros(1, device=device)
    op = group.send if rank == 0 else group.recv
    wait(op([probe], 1 - rank, 0), timeout_s)
    return group


def wire_device(kind: str, device: torch.device) -> torch.device:
    """Where a received tensor lands: host memory for gloo, this worker's device otherwise."""
    return torch.device("cpu") if kind == "gloo" else device


def isend(group, kind: str, rank: int, t: torch.Tensor, seq: int):
    if kind == "gloo" and t.device.type != "cpu":
        t = t.cpu()  # gloo moves host memory
    return group.send([t], 1 - rank, tag(seq))


def tag(seq: int) -> int:
    return seq % (1 << 31)


def wait(work, timeout_s: float) -> None:
    if not work.wait(timedelta(seconds=timeout_s)):
        raise ChannelError(f"no transfer within {timeout_s:.1f} s")


def share_cuda(t: torch.Tensor) -> list:
    """The plain fields by which another process of this GPU opens ``t`` (CUDA IPC), no pickling."""
    fields = list(t.untyped_storage()._share_cuda_())
    return fields + [t.storage_offset()]


def _counter_ok(h) -> bool:
    """Whether ``h`` names its reference counter as torch's share does (file, offset in bounds)."""
    return (isinstance(h, list) and len(h) == 9 and isinstance(h[4], bytes)
            and _REFCOUNT_FILE.fullmatch(h[4]) is not None and type(h[5]) is int and 0 <= h[5] < _REFCOUNT_SLOTS)


def release_ipc(handles, device: torch.device) -> int:
    """Tell the sender that the allocations named by ``handles`` will not be opened here. Its share
    set each one's reference counter to 1 and only the receiver lowers it (as opening and then
    freeing would): unreleased, the sender's block stays allocated for its process's lifetime.
    Only well-formed handles are released; returns how many. Never raises (a refusal's clean-up)."""
    done = 0
    for h in handles if isinstance(handles, list) else ():
        if _counter_ok(h):
            try:
                torch.UntypedStorage._release_ipc_counter(h[4], h[5], device=device)
                done += 1
            except Exception as exc:  # noqa: BLE001 - the sender may be gone, its counter file with it
                log.debug("CUDA IPC counter %r not released: %s", h[4], exc)
    return done


def open_ipc(handles, specs: list, device: torch.device) -> dict[str, torch.Tensor]:
    """Copies, in this process's memory, of the sender's tensors named by CUDA IPC handles. Every
    handle is checked before any is opened (MalformedMessage: the caller releases them all); a
    failure once opening began raises ``IpcOpenFailed``, the handles not opened released here."""
    if not isinstance(handles, list) or len(handles) != len(specs):
        raise MalformedMessage("a CUDA IPC header must name one allocation per tensor")
    for h, (name, dtype, shape, nbytes) in zip(handles, specs):
        ok = (_counter_ok(h) and h[0] == device.index and isinstance(h[1], bytes)
              and all(type(v) is int and v >= 0 for v in (h[2], h[3], h[8]))
              and isinstance(h[6], bytes) and isinstance(h[7], bool))
        if not ok or h[8] * DTYPES[dtype].itemsize + nbytes > h[2]:
            raise MalformedMessage(f"CUDA IPC handle of {name!r} is not one this runtime writes")
    out, opened = {}, 0
    try:
        with torch.cuda.device(device):
            for h, (name, dtype, shape, nbytes) in zip(handles, specs):
                storage = torch.UntypedStorage._new_shared_cuda(*h[:8])
                opened += 1  # from here its counter is lowered when ``storage`` is freed
                view = torch.empty(0, dtype=DTYPES[dtype], device=device).set_(storage, h[8], shape)
                out[name] = view.clone()  # a device copy; the sender's memory is released with ``storage``
            torch.cuda.current_stream(device).synchronize()
    except Exception as exc:
        release_ipc(handles[opened:], device)
        raise IpcOpenFailed(f"CUDA IPC open failed: {type(exc).__name__}: {exc}") from exc
    return out
