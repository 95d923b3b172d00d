"""The requirement files scripts/install_cpu.sh installs from: the demo's core set is versioned by the full set."""

from pathlib import Path

from packaging.utils import canonicalize_name

REQ = Path(__file__).resolve().parent.parent / "requirements"


def _names(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_every_core_package_is_pinned_by_the_full_set():
    """`install_cpu.sh --core` installs cpu-core.txt with cpu-common.txt as constraints: a name the full set does
    not pin would come in at whatever version is newest."""
    pinned = set()
    for line in _names(REQ / "cpu-common.txt"):
        name, sep, version = line.partition("==")
        assert sep and version, f"cpu-common.txt: {line!r} is not an exact pin"
        pinned.add(canonicalize_name(name))
    core = _names(REQ / "cpu-core.txt")
    assert core and all("==" not in n for n in core)  # versions come from the full set only
    unpinned = [n for n in core if canonicalize_name(n) not in pinned]
    assert not unpinned, f"pin these in requirements/cpu-common.txt: {unpinned}"
