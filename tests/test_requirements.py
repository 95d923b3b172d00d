"""The requirement files scripts/install_cpu.sh installs from: the demo's core set is versioned by the full set."""

import re
from pathlib import Path

REQ = Path(__file__).resolve().parent.parent / "requirements"


def _names(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_core_package_is_pinned_by_the_full_set():
    """`install_cpu.sh --core` installs cpu-core.txt with cpu-common.txt as constraints: a name the full set does
    not pin would come in at whatever version is newest."""
    pins = {}
    for line in _names(REQ / "cpu-common.txt"):
        name, sep, version = line.partition("==")
        assert sep and version, f"cpu-common.txt: {line!r} is not an exact pin"
        pins[_canonical(name)] = version
    core = _names(REQ / "cpu-core.txt")
    assert core and all("==" not in n for n in core)  # versions come from the full set only
    unpinned = [n for n in core if _canonical(n) not in pins]
    assert not unpinned, f"pin these in requirements/cpu-common.txt: {unpinned}"
