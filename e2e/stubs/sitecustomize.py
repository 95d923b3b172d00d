"""Stand-ins for modules a text model never calls, so SGLang 0.5.17 imports on the GPU host (see docs/e2e.md).

* ``soundfile``: imported at module level by SGLang's realtime-audio route, never called for a text model;
  the host has no libsndfile wheel. An empty module is enough.
Only added when the real module is missing, so a host that has it keeps it.
"""
import importlib.machinery
import importlib.util
import sys
import types

for _name in ("soundfile",):
    if _name not in sys.modules and importlib.util.find_spec(_name) is None:
        _stub = types.ModuleType(_name)
        # a spec, so importlib.util.find_spec (transformers' availability probe) answers instead of raising
        _stub.__spec__ = importlib.machinery.ModuleSpec(_name, None)
        sys.modules[_name] = _stub
