"""The OCI SDK trimming for the bundle keeps core modules, the named services and what kept code imports."""
from pathlib import Path

from e2e import slim_oci

INIT = '''from . import auth, config, pagination
from .base_client import BaseClient
import os
if os.getenv("NO_SERVICES"):
    pass
else:
    __all__ = ["BaseClient", "auth", "config", "pagination", "dns", "object_storage", "generative_ai_inference",
               "database", "core", "key_management"]
'''


def make_sdk(root: Path) -> Path:
    oci = root / "oci"
    files = {"__init__.py": INIT, "base_client.py": "", "config.py": "from .auth import signers\n",
             "auth/__init__.py": "", "auth/signers.py": "",
             "pagination/__init__.py": "from .. import dns, object_storage\n",
             "generative_ai_inference/__init__.py": "from oci.key_management import x\n",
             "key_management/__init__.py": "", "dns/__init__.py": "", "object_storage/__init__.py": "",
             "database/__init__.py": "", "core/__init__.py": "import oci.util\n"}
    for rel, text in files.items():
        (oci / rel).parent.mkdir(parents=True, exist_ok=True)
        (oci / rel).write_text(text)
    return oci


def test_services_are_listed_but_not_imported_at_module_level(tmp_path):
    assert slim_oci.services(make_sdk(tmp_path)) == {"dns", "object_storage", "generative_ai_inference", "database",
                                                    "core", "key_management"}


def test_slim_keeps_wanted_and_transitively_imported_services_only(tmp_path):
    oci = make_sdk(tmp_path)
    kept = slim_oci.slim(oci)
    # pagination (core) imports dns and object_storage; generative_ai_inference imports key_management
    assert kept == {"generative_ai_inference", "object_storage", "dns", "key_management"}
    left = {p.name for p in oci.iterdir()}
    assert {"auth", "pagination", "config.py", "dns", "key_management"} <= left
    assert not {"database", "core"} & left
