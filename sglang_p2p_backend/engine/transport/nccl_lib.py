"""The ctypes binding of libnccl the `nccl` transport uses: loading the library, the structs and function
signatures it calls, result codes and error strings.

A small ctypes layer over the `libnccl.so.2` that torch already loaded (so there is one NCCL per
process). Why not an existing binding:
- SGLang's `pynccl_wrapper.NCCLLibrary` binds `ncclCommInitRankConfig` but not `ncclCommAbort` nor
  `ncclCommGetAsyncError`, which non-blocking init and abort need; and the engine must not import SGLang.
- torch.distributed's ProcessGroupNCCL takes a config and can abort, but every dynamic pair would need its own
  store rendezvous and watchdog thread; pairs come and go with decode instances.
- `cupy.cuda.nccl` can abort but has no `ncclConfig_t` (no per-communicator cap, no non-blocking init).
- nccl4py covers all of it but is 0.x and pulls cuda.core / cuda-bindings that SGLang deployments lack.
The config struct passed is the NCCL 2.17 prefix of `ncclConfig_t` with `version = 2.17.0`: NCCL copies only
`size` bytes and fills later fields with defaults, so one layout works from 2.17 through 2.30.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

from sglang_p2p_backend.engine.transport.base import TransportError

# ncclResult_t values (nccl.h)
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
NCCL_UINT8 = 1  # ncclUint8
_CONFIG_UNDEF_INT = -(2**31)
_CONFIG_MAGIC = 0xCAFEBEEF
_MIN_VERSION = 21700  # minCTAs/maxCTAs in ncclConfig_t and non-blocking communicators
#: the soname torch's CUDA libraries link: loading it returns the copy already mapped
DEFAULT_LIBRARY = "libnccl.so.2"


def nccl_version_code(major: int, minor: int, patch: int) -> int:
    """NCCL_VERSION(X, Y, Z) of nccl.h (the >= 2.9 encoding)."""
    return major * 10000 + minor * 100 + patch


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class NcclConfig(ctypes.Structure):
    """The NCCL 2.17 prefix of ncclConfig_t (fields are append-only across versions)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]

    @classmethod
    def make(cls, *, blocking: bool, max_ctas: Optional[int], split_share: bool = False) -> "NcclConfig":
        cfg = cls()
        cfg.size = ctypes.sizeof(cls)
        cfg.magic = _CONFIG_MAGIC
        cfg.version = nccl_version_code(2, 17, 0)
        cfg.blocking = 1 if blocking else 0
        cfg.cgaClusterSize = _CONFIG_UNDEF_INT
        # min = max pins the channel count: fewer channels would cost bandwidth without saving memory
        cfg.minCTAs = max_ctas if max_ctas else _CONFIG_UNDEF_INT
        cfg.maxCTAs = max_ctas if max_ctas else _CONFIG_UNDEF_INT
        cfg.netName = None
        cfg.splitShare = 1 if split_share else _CONFIG_UNDEF_INT
        return cfg


def _wheel_library() -> Optional[str]:
    try:
        import nvidia.nccl  # the nvidia-nccl-cu12/cu13 wheel torch depends on
    except ImportError:
        return None
    for root in getattr(nvidia.nccl, "__path__", []):
        candidate = os.path.join(root, "lib", "libnccl.so.2")
        if os.path.exists(candidate):
            return candidate
    return None


class NcclLibrary:
    """ctypes functions of libnccl used here. Loading "libnccl.so.2" after `import torch` returns the copy torch's
    CUDA library already mapped (the dynamic loader matches the soname)."""

    _instance: Optional["NcclLibrary"] = None
    _instance_lock = threading.Lock()

    def __init__(self, path: Optional[str] = None):
        path = path or DEFAULT_LIBRARY
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            # torch not loaded yet, or a libnccl outside the loader's path: the nvidia-nccl wheel's copy
            wheel = _wheel_library()
            if path != DEFAULT_LIBRARY or wheel is None:
                raise TransportError(f"cannot load NCCL ({path}): {e}; set SGLANG_NCCL_SO_PATH") from e
            self.lib = ctypes.CDLL(wheel)
        L = self.lib
        p_comm = ctypes.c_void_p
        self._sig(L.ncclGetVersion, [ctypes.POINTER(ctypes.c_int)])
        self._sig(L.ncclGetUniqueId, [ctypes.POINTER(NcclUniqueId)])
        self._sig(
            L.ncclCommInitRankConfig,
            [ctypes.POINTER(p_comm), ctypes.c_int, NcclUniqueId, ctypes.c_int, ctypes.POINTER(NcclConfig)],
        )
        self._sig(L.ncclCommGetAsyncError, [p_comm, ctypes.POINTER(ctypes.c_int)])
        self._sig(L.ncclCommAbort, [p_comm])
        self._sig(L.ncclCommSplit, [p_comm, ctypes.c_int, ctypes.c_int, ctypes.POINTER(p_comm), ctypes.POINTER(NcclConfig)])
        self._sig(L.ncclCommDestroy, [p_comm])
        for name in ("ncclSend", "ncclRecv"):
            self._sig(
                getattr(L, name),
                [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, p_comm, ctypes.c_void_p],
            )
        self._sig(L.ncclGroupStart, [])
        self._sig(L.ncclGroupEnd, [])
        L.ncclGetErrorString.restype = ctypes.c_char_p
        L.ncclGetErrorString.argtypes = [ctypes.c_int]
        L.ncclGetLastError.restype = ctypes.c_char_p
        L.ncclGetLastError.argtypes = [p_comm]
        v = ctypes.c_int()
        self.check(L.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        self.version = v.value
        if self.version < _MIN_VERSION:
            raise TransportError(f"NCCL {self.version} is too old: per-communicator config needs NCCL >= 2.17")

    @staticmethod
    def _sig(fn, argtypes) -> None:
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes

    @classmethod
    def get(cls, path: Optional[str] = None) -> "NcclLibrary":
        """The process's one binding, loaded from `path` (EngineConfig.nccl_library) by the first call."""
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls(path)
            return cls._instance

    def error_text(self, code: int, comm: Optional[int] = None) -> str:
        text = self.lib.ncclGetErrorString(code).decode(errors="replace")
        last = self.lib.ncclGetLastError(comm).decode(errors="replace") if comm is not None else ""
        return f"{text} ({code})" + (f": {last}" if last else "")

    def check(self, code: int, what: str, comm: Optional[int] = None) -> int:
        """Raise TransportError unless `code` is success or in-progress; returns the code."""
        if code not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise TransportError(f"{what} failed: {self.error_text(code, comm)}")
        return code

    def async_error(self, comm: int) -> int:
        out = ctypes.c_int()
        code = self.lib.ncclCommGetAsyncError(comm, ctypes.byref(out))
        return out.value if code == NCCL_SUCCESS else code
