"""Test and demo support: SGLang's PD classes driven as its schedulers drive them, on host-memory pools."""
