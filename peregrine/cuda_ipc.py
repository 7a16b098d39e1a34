"""GPU memory that the other processes of one host can map: plain cudaMalloc allocations shared
through CUDA IPC handles, called through the CUDA runtime that PyTorch has already loaded.

Used by the tensor-parallel all-reduce over peer memory (distributed.py): each rank allocates a
buffer, sends its handle to the other ranks, and maps theirs; a kernel on this rank's GPU then
reads and writes the peers' buffers directly (over NVLink where the GPUs have it)."""
from __future__ import annotations

import ctypes
import functools

_IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


def _loaded_cudart() -> str:
    """The path of the CUDA runtime library loaded in this process (by PyTorch), else its name."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip().split(" ")[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    import torch
    major = (torch.version.cuda or "12").split(".")[0]
    return f"libcudart.so.{major}"


class CudaRuntime:
    """The few CUDA runtime calls that IPC needs; every failure raises RuntimeError."""

    def __init__(self, path: str | None = None) -> None:
        import torch
        torch.cuda.init()  # loads the runtime and creates this device's context
        self.lib = lib = ctypes.CDLL(path or _loaded_cudart())
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaMalloc.argtypes = [ctypes.POINTER(vp), sz]
        lib.cudaFree.argtypes = [vp]
        lib.cudaMemset.argtypes = [vp, ctypes.c_int, sz]
        lib.cudaDeviceSynchronize.argtypes = []
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), vp]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(vp), _IpcHandle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [vp]
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            msg = self.lib.cudaGetErrorString(err).decode(errors="replace")
            raise RuntimeError(f"{what} failed: CUDA error {err} ({msg})")

    def malloc_zeroed(self, nbytes: int) -> int:
        """A zero-filled allocation of nbytes on the current device; its address."""
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(ptr), nbytes), "cudaMalloc")
        self._check(self.lib.cudaMemset(ptr, 0, nbytes), "cudaMemset")
        self._check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def ipc_handle(self, ptr: int) -> bytes:
        """The handle another process opens to map the allocation that starts at ptr."""
        handle = _IpcHandle()
        self._check(self.lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)),
                    "cudaIpcGetMemHandle")
        # NOTE: bytes(handle), not handle.reserved, which stops at the first zero byte.
        return bytes(handle)

    def open_ipc_handle(self, handle: bytes) -> int:
        """Map another process's allocation into this one (for this device); its address here."""
        if len(handle) != _IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle has {_IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        ptr = ctypes.c_void_p()
        h = _IpcHandle()
        ctypes.memmove(ctypes.addressof(h), handle, _IPC_HANDLE_BYTES)
        self._check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS),
                    "cudaIpcOpenMemHandle")
        return int(ptr.value)

    def close_ipc_handle(self, ptr: int) -> None:
        self._check(self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


@functools.lru_cache(maxsize=1)
def cuda_runtime() -> CudaRuntime:
    return CudaRuntime()
