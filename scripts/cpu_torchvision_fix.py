"""Lets PyPI's CUDA-built torchvision import on a CPU-only torch, for this project's CPU test environment.

PyPI has no CPU build of torchvision; its `_C` extension needs libc10_cuda.so, so on the CPU torch the
extension is skipped and `torchvision._meta_registrations` then fails with "operator torchvision::nms does
not exist". SGLang imports torchvision (through transformers' image utils and srt/configs), so nothing in
SGLang would import. Defining the two op schemas torchvision registers fake kernels for, before it is first
imported, is enough; nothing in SGLang is changed. Installed as a .pth hook by scripts/install_cpu.sh.
"""
import importlib.abc
import sys

_LIB = None


class _TorchvisionSchemaFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        global _LIB
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        if torch.version.cuda is None and _LIB is None:
            _LIB = torch.library.Library("torchvision", "DEF")
            _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None  # let the normal finders import torchvision itself


def install() -> None:
    if not any(isinstance(f, _TorchvisionSchemaFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionSchemaFinder())
