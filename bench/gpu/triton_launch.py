"""One tiny Triton kernel compiled and launched on a device (``cuda``, or ``cpu`` under Triton's
interpreter, with ``TRITON_INTERPRET=1`` set by the caller): the first thing the step check runs, in a
process of its own with a time limit. Triton builds its launcher with the machine's C compiler and
Python headers at the first launch; where that fails, every forward through the Triton kernels fails
too, and this says so first, in one line. Exit status 0 when the kernel ran and its result is right."""

import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    x = torch.arange(100, dtype=torch.float32, device=device)
    t = time.perf_counter()
    add_one[(1,)](x, 100, BLOCK=128)
    right = torch.equal(x.cpu(), torch.arange(1, 101, dtype=torch.float32))
    print(f"triton {triton.__version__}: add_one compiled and launched on {device} in {time.perf_counter() - t:.1f} s; "
          f"result {'right' if right else 'WRONG'}", flush=True)
    return 0 if right else 1


if __name__ == "__main__":
    sys.exit(main())
